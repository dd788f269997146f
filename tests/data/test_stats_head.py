"""`keel data stats` counts text bytes (UTF-8 of the text, not file size), tokens of a cache and
histograms; `keel data head` shows documents matching a DuckDB condition."""

import gzip
import json
import os
import random
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keel.core.errors import UsageError
from keel.data.documents import document_id
from keel.data.head import head
from keel.data.stats import data_stats
from keel.data.token_cache import Manifest, ShardWriter, write_manifest
from keel.flow import RunOptions


def write_documents(directory, texts, **columns):
    directory.mkdir()
    table = pa.table(
        {"id": [document_id(t) for t in texts], "text": texts, "source": ["s"] * len(texts)}
        | columns
    )
    half = len(texts) // 2
    pq.write_table(table.slice(0, half), directory / "part-00000-of-00002.parquet")
    pq.write_table(table.slice(half), directory / "part-00001-of-00002.parquet")
    pq.write_table(table.slice(0, 1), directory / "removed.parquet")  # a side table: not counted


def test_stats_of_a_document_set(tmp_path):
    texts = ["é" * 10, "a" * 100, "b" * 300, "c" * 5000]  # 20, 100, 300 and 5000 UTF-8 bytes
    write_documents(
        tmp_path / "docs",
        texts,
        language=["en", "fr", None, "en"],
        quality_score=[0.05, 0.95, None, 1.0],
    )
    stats = data_stats(str(tmp_path / "docs"))
    assert (stats.kind, stats.documents, stats.files, stats.bytes) == ("documents", 4, 2, 5420)
    assert stats.file_bytes == sum(
        p.stat().st_size for p in (tmp_path / "docs").glob("part-*.parquet")
    )
    assert stats.length.bins == [
        ("0-64", 1),
        ("64-256", 1),
        ("256-1Ki", 1),
        ("1Ki-4Ki", 0),
        ("4Ki-16Ki", 1),
    ]
    assert (stats.language.bins, stats.language.nulls) == ([("en", 2), ("fr", 1)], 1)
    quality = dict(stats.quality.bins)
    assert (quality["0.0-0.1"], quality["0.9-1.0"], sum(quality.values())) == (1, 2, 3)
    assert stats.quality.nulls == 1
    plain = tmp_path / "plain"
    write_documents(plain, ["x"])
    assert data_stats(str(plain)).language is None and data_stats(str(plain)).quality is None
    emptied = tmp_path / "emptied"  # a committed set a filter left no document in
    emptied.mkdir()
    (emptied / "_SUCCESS").write_text("{}")
    assert (data_stats(str(emptied)).documents, data_stats(str(emptied)).bytes) == (0, 0)


def test_stats_of_a_token_cache_counts_tokens_and_document_lengths(tmp_path):
    eos = 0
    lengths = [3, 70, 300]  # tokens per document, EOS included
    tokens = np.concatenate([np.r_[np.ones(n - 1), eos] for n in lengths]).astype(np.uint16)
    writer = ShardWriter(str(tmp_path), np.dtype("<u2"), eos, shard_bytes=100)
    writer.append(tokens, np.cumsum(lengths))
    shards = tuple(writer.close())
    assert len(shards) == 2
    write_manifest(
        str(tmp_path),
        Manifest("0" * 64, 100, "uint16", eos, "<eos>", len(tokens), len(lengths), shards),
    )
    stats = data_stats(str(tmp_path))
    assert (stats.kind, stats.documents, stats.tokens, stats.bytes) == (
        "token_cache",
        3,
        373,
        None,
    )
    assert stats.length.unit == "tokens"
    assert stats.length.bins == [("0-64", 1), ("64-256", 1), ("256-1Ki", 1)]


def test_head_shows_matching_documents_in_order_and_a_bad_condition_is_one_line(tmp_path):
    texts = [f"document {i}" for i in range(10)]
    write_documents(tmp_path / "docs", texts, quality_score=[i / 10 for i in range(10)])
    path = str(tmp_path / "docs")
    assert [d["text"] for d in head(path, 3)] == texts[:3]
    matching = head(path, 2, "quality_score >= 0.45 AND text LIKE '%document%'")
    assert [d["text"] for d in matching] == ["document 5", "document 6"]
    assert head(path, 5, "quality_score > 2") == []
    with pytest.raises(UsageError, match=r"^--where 'no_such_column > 1': Binder Error: .*no_such"):
        head(path, 1, "no_such_column > 1")
    with pytest.raises(UsageError, match="not a document set"):
        head(str(tmp_path), 1)


def keel(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "keel", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_text_bytes_fall_after_a_filter_and_quality_without_a_model_says_so(tmp_path):
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "her", "dog", "ran", "to"]
    words += ["our", "park", "with", "one", "red", "ball"]
    texts = [" ".join(rng.choice(words) for _ in range(60 + i)) for i in range(40)]
    texts += [f"short {i}" for i in range(20)]  # fewer than 50 words: the filter drops them
    write_documents(tmp_path / "docs", texts)
    scored = keel("data", "quality", "-i", "docs", "-o", "scored", "--workers", "1", cwd=tmp_path)
    assert scored.returncode == 0, scored.stderr
    assert "no model (--model), so quality_score is not computed" in scored.stderr
    kept = keel("data", "filter", "-i", "scored", "-o", "kept", "--workers", "1", cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr
    before = keel("data", "stats", "scored", "--json", cwd=tmp_path)
    after = keel("data", "stats", "kept", "--json", "--png", "kept.png", cwd=tmp_path)
    assert after.returncode == 0, after.stderr
    before, after = json.loads(before.stdout), json.loads(after.stdout)
    assert before["documents"] == 60 and 0 < after["documents"] <= 40  # the short ones go
    assert before["bytes"] == sum(len(text.encode()) for text in texts)  # text, not files
    assert after["bytes"] < before["bytes"]
    assert (tmp_path / "kept.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = keel("data", "head", "kept", "--where", "language = ", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("error: --where 'language = ': Parser Error")


def test_stats_and_head_read_raw_jsonl_text_and_parquet_files(tmp_path):
    texts = [f"document {i} " + "word " * (i * 40) for i in range(8)]
    language = ["en", "fr", None, "en", "en", "de", "en", "fr"]
    score = [0.05, 0.95, None, 1.0, 0.5, 0.5, 0.2, 0.8]
    write_documents(tmp_path / "docs", texts, language=language, quality_score=score)
    records = [
        {"text": t, "language": lang, "quality_score": q, "source": "web" if i % 3 else "books"}
        for i, (t, lang, q) in enumerate(zip(texts, language, score, strict=True))
    ]
    lines = ["".join(json.dumps(r) + "\n" for r in half) for half in (records[:5], records[5:])]
    for number, text in enumerate(lines):
        (tmp_path / f"raw-{number}.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    options = RunOptions(workers=2)
    stored, raw = data_stats(str(tmp_path / "docs")), data_stats(str(tmp_path / "raw-*.jsonl.gz"))
    assert (raw.kind, raw.files, raw.stage) == ("documents", 2, None)
    assert raw.file_bytes == sum(p.stat().st_size for p in tmp_path.glob("raw-*.jsonl.gz"))
    for name in ("documents", "bytes", "length", "language", "quality"):
        assert getattr(raw, name) == getattr(stored, name), name
    (tmp_path / "txt").mkdir()
    for number, text in enumerate(texts[:3]):
        (tmp_path / "txt" / f"{number}.txt").write_text(text)
    text_stats = data_stats(str(tmp_path / "txt" / "*.txt"), options)
    assert (text_stats.documents, text_stats.bytes) == (3, sum(len(t) for t in texts[:3]))

    glob = str(tmp_path / "raw-*.jsonl.gz")
    shown = head(glob, 3, "source = 'web' AND quality_score >= 0.5", options)
    assert [d["text"] for d in shown] == [texts[1], texts[4], texts[5]]  # across both files
    assert shown[0]["id"] == document_id(texts[1]) and shown[0]["language"] == "fr"
    assert head(glob, 2, "source = 'nowhere'", options) == []
    with pytest.raises(UsageError, match=r"^--where 'nosuch = 1': Binder Error"):
        head(glob, 1, "nosuch = 1", options)
    parts = str(tmp_path / "docs" / "part-*.parquet")
    assert [d["text"] for d in head(parts, 5, "quality_score > 0.9")] == [texts[1], texts[3]]
    assert head(str(tmp_path / "txt" / "2.txt"), 1)[0]["text"] == texts[2]
    pages = tmp_path / "pages.jsonl"  # records for `keel data extract`: html, no text
    pages.write_text(json.dumps({"html": "<p>hi</p>", "url": "https://x.org"}) + "\n")
    (page,) = head(str(pages), 1, "html LIKE '%hi%'", options)
    assert (page["html"], page["text"], page["url"]) == ("<p>hi</p>", None, "https://x.org")
