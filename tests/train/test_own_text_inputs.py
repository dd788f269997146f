"""`keel train --data PATH` reads what DataKit's stages read: compressed JSON Lines and text,
.ndjson, a directory mixing formats, and a DataKit output directory (its parts, not its side
tables)."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from keel.data.dedup import run_exact_dedup
from keel.data.token_cache import TokenCache
from keel.train.own_text import document_texts, eval_name, resolve_data

TEXTS = [
    f"document number {n}: " + " ".join(f"w{(n * 7 + i) % 50}" for i in range(40))
    for n in range(12)
]


def _lines(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": text, "source": "mine"}) + "\n" for text in texts).encode()


def test_compressed_jsonl_a_mixed_directory_and_a_datakit_output_are_training_data(tmp_path):
    (tmp_path / "train.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_lines(TEXTS)))
    resolved = resolve_data(str(tmp_path / "train.jsonl.zst"), str(tmp_path / "prefix"), 300)
    assert TokenCache(resolved.cache).manifest.documents == len(TEXTS)

    mixed = tmp_path / "mixed"
    (mixed / "more").mkdir(parents=True)
    (mixed / "a.ndjson").write_bytes(_lines(TEXTS[:5]))
    (mixed / "more" / "b.txt.gz").write_bytes(gzip.compress(TEXTS[5].encode()))
    (mixed / "notes.md").write_text("not a document")
    (mixed / "tokenizer.json").write_text('{"model": {}}')  # not JSON Lines: not read
    resolved = resolve_data(str(mixed), str(tmp_path / "prefix"), 300)
    assert TokenCache(resolved.cache).manifest.documents == 6
    assert document_texts(str(mixed), "--eval-data") == TEXTS[:6]  # what eval scores, in order
    assert document_texts(str(mixed), "--eval-data", limit=2) == TEXTS[:2]

    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.table({"text": TEXTS + TEXTS[:3]}), raw)
    run_exact_dedup(str(raw), str(tmp_path / "deduped"))  # parts, removed.parquet, stage.json
    resolved = resolve_data(str(tmp_path / "deduped"), str(tmp_path / "prefix"), 300)
    assert TokenCache(resolved.cache).manifest.documents == len(TEXTS)


def test_an_eval_set_is_named_without_its_compression_suffix():
    assert [eval_name(p) for p in ("v/val.jsonl.gz", "val.txt", "held/", "x.text.zst")] == [
        "val",
        "val",
        "held",
        "x",
    ]
