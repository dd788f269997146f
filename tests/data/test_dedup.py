"""Exact and fuzzy dedup on real files: what they remove, what they write, and that they are
deterministic. The labelled near-duplicate set comes from benchmarks/dedup_bench.py (built from the
WikiText-2 articles bundled with keel)."""

import importlib.util
import json
import random
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keel.core.errors import UsageError
from keel.data import dedup, minhash
from keel.data.dedup import ExactDedupConfig, run_exact_dedup
from keel.data.documents import StageReport, document_id
from keel.data.fuzzy import FuzzyDedupConfig, run_fuzzy_dedup
from keel.flow import LocalBackend, RunOptions

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "dedup_bench.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("dedup_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["dedup_bench"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


@pytest.fixture(scope="module")
def pool():
    with LocalBackend(workers=2) as backend:
        yield RunOptions(backend=backend)


@pytest.fixture(scope="module")
def labelled():
    return bench.build_labelled_set(bench.articles_from_sample(), seed=0)


@pytest.fixture(scope="module")
def labelled_dir(labelled, tmp_path_factory):
    directory = tmp_path_factory.mktemp("labelled") / "docs"
    bench.write_documents(labelled.rows, directory)
    return directory


def _write(rows, directory: Path, files: int = 2) -> str:
    bench.write_documents(rows, directory, files)
    return str(directory)


def _doc(text: str, source: str) -> dict:
    return {"id": document_id(text), "text": text, "source": source}


def _removed(directory: Path) -> list[dict]:
    return pq.read_table(directory / "removed.parquet").to_pylist()


def _true_jaccard(left: str, right: str) -> float:
    """The Jaccard of two texts' word 5-gram sets, by the benchmark's own (string) shingles."""
    a, b = bench.shingle_set(left), bench.shingle_set(right)
    return len(a & b) / len(a | b)


def _kept(directory: Path) -> list[dict]:
    return pq.read_table(sorted(directory.glob("part-*.parquet"))).to_pylist()


# -- exact ------------------------------------------------------------------------------------


@pytest.fixture(params=["one read", "two reads"])
def exact_reads(request, monkeypatch):
    """Exact dedup's two designs (keel.data.dedup): one read in input order, for a few files,
    and a shuffle of text hashes then a second read, for many. Each exact test runs both."""
    if request.param == "two reads":
        monkeypatch.setattr(dedup, "ONE_READ_MAX_FILES", 0)
    return request.param


def test_exact_dedup_removes_exactly_the_planted_copies(labelled, tmp_path, pool, exact_reads):
    rng = random.Random(1)
    rows = [dict(row, source=f"doc-{n}") for n, row in enumerate(labelled.rows[:300])]
    for n, original in enumerate(rng.sample(rows, 60)):  # copies land after their original
        position = rng.randint(rows.index(original) + 1, len(rows))
        rows.insert(position, dict(original, source=f"copy-{n}"))
    source = _write(rows, tmp_path / "in")
    report = run_exact_dedup(source, str(tmp_path / "out"), options=pool)

    removed = {(row["id"], row["source"]) for row in _removed(tmp_path / "out")}
    planted = {(row["id"], row["source"]) for row in rows if row["source"].startswith("copy")}
    hits = len(removed & planted)
    precision, recall = hits / len(removed), hits / len(planted)
    assert (precision, recall) == (1.0, 1.0), f"precision {precision:.3f}, recall {recall:.3f}"
    kept = _kept(tmp_path / "out")
    assert sorted(row["source"] for row in kept) == sorted(f"doc-{n}" for n in range(300))
    assert (report.documents_in, report.documents_out) == (360, 300)


def test_one_read_and_two_reads_write_the_same_tables(labelled, tmp_path, pool, monkeypatch):
    rows = labelled.rows[:200] + [dict(row, source="copy") for row in labelled.rows[50:120:3]]
    source = _write(rows + labelled.rows[100:160], tmp_path / "in", files=3)
    run_exact_dedup(source, str(tmp_path / "one"), options=pool)
    monkeypatch.setattr(dedup, "ONE_READ_MAX_FILES", 0)
    run_exact_dedup(source, str(tmp_path / "two"), options=pool)
    for name in ("part-*.parquet", "removed.parquet"):
        one, two = (pq.read_table(sorted((tmp_path / d).glob(name))) for d in ("one", "two"))
        assert one.num_rows > 0 and one.equals(two), name
    stages = [json.loads((tmp_path / d / "stage.json").read_text()) for d in ("one", "two")]
    assert stages[0] == stages[1] and stages[0]["dropped"] == {"exact_duplicate": 84}


def test_exact_dedup_writes_removed_rows_and_stage_json(tmp_path, pool, exact_reads):
    rows = [_doc("a b c", "s0"), _doc("d e f", "s1"), _doc("a b c", "s2"), _doc("a b c", "s3")]
    run_exact_dedup(_write(rows, tmp_path / "in"), str(tmp_path / "out"), options=pool)
    assert _removed(tmp_path / "out") == [
        {"id": document_id("a b c"), "duplicate_of": document_id("a b c"), "similarity": 1.0,
         "source": source}
        for source in ("s2", "s3")
    ]  # fmt: skip
    stage = json.loads((tmp_path / "out" / "stage.json").read_text())
    assert stage["stage"] == "exact_dedup"
    assert (stage["documents_in"], stage["documents_out"]) == (4, 2)
    assert stage["dropped"] == {"exact_duplicate": 2}
    assert stage["dropped_sample"] == {"exact_duplicate": [document_id("a b c")] * 2}
    assert StageReport.read(str(tmp_path / "out")).dropped == {"exact_duplicate": 2}


def test_exact_dedup_keeps_the_first_copy_across_files_in_input_order(tmp_path, pool, exact_reads):
    texts = ["late", "x y", "first", "x y", "only", "first", "late"]  # 2 files: 4 + 3 rows
    rows = [_doc(text, f"s{n}") for n, text in enumerate(texts)]
    run_exact_dedup(_write(rows, tmp_path / "in"), str(tmp_path / "out"), options=pool)
    kept = _kept(tmp_path / "out")
    assert [(row["text"], row["source"]) for row in kept] == [
        ("late", "s0"), ("x y", "s1"), ("first", "s2"), ("only", "s4")
    ]  # fmt: skip
    assert sorted((row["source"], row["duplicate_of"]) for row in _removed(tmp_path / "out")) == [
        ("s3", document_id("x y")), ("s5", document_id("first")), ("s6", document_id("late"))
    ]  # fmt: skip


def test_input_without_ids_gets_them_from_the_text(tmp_path, pool, exact_reads):
    rows = [{"text": text, "source": "s"} for text in ("one two", "three", "one two")]
    run_exact_dedup(_write(rows, tmp_path / "in", 1), str(tmp_path / "out"), options=pool)
    kept = _kept(tmp_path / "out")
    assert sorted(row["id"] for row in kept) == sorted(
        [document_id("one two"), document_id("three")]
    )
    assert [row["id"] for row in _removed(tmp_path / "out")] == [document_id("one two")]


# -- fuzzy ------------------------------------------------------------------------------------


LABELLED = FuzzyDedupConfig(max_source_drop=1.0)
"""The labelled set's sources are its labels (near-truncate, ...): whole sources are copies."""


def test_fuzzy_dedup_finds_the_labelled_near_duplicates(labelled, labelled_dir, tmp_path, pool):
    report = run_fuzzy_dedup(str(labelled_dir), str(tmp_path / "out"), LABELLED, options=pool)
    removed = {row["id"] for row in _removed(tmp_path / "out")}
    score = bench.scores(removed, labelled.duplicates)
    summary = (
        f"precision {score['precision']:.3f}, recall {score['recall']:.3f}, F1 {score['f1']:.3f} "
        f"({len(removed)} removed, {len(labelled.duplicates)} true, {len(labelled.rows)} docs)"
    )
    assert score["f1"] >= 0.95, summary
    assert report.documents_out == len(labelled.rows) - len(removed)


@pytest.mark.parametrize(
    ("stage", "config"), [(run_fuzzy_dedup, LABELLED), (run_exact_dedup, ExactDedupConfig())]
)
def test_one_and_two_workers_write_the_same_files(stage, config, labelled_dir, tmp_path, pool):
    outputs = []
    with LocalBackend(workers=1) as single:
        for name, options in (("w1", RunOptions(backend=single)), ("w2", pool)):
            stage(str(labelled_dir), str(tmp_path / name), config, options=options)
            outputs.append({p.name: p.read_bytes() for p in sorted((tmp_path / name).iterdir())})
    assert outputs[0] == outputs[1]
    assert {"removed.parquet", "stage.json", "part-00000-of-00002.parquet"} <= set(outputs[0])


def test_fuzzy_dedup_writes_removed_rows_and_stage_json(labelled, tmp_path, pool):
    original = next(row for row in labelled.rows if row["source"] == "original")
    words = original["text"].split()
    near = " ".join(words[:-20])  # the last 20 words dropped
    prefixed = " ".join(["extra"] * 8 + words[:-20])  # and 8 words added in front
    rows = [
        dict(original, source="first"),
        _doc("an unrelated document about something else entirely, and short", "other"),
        _doc(near, "near"),
        _doc(prefixed, "prefixed"),
    ]
    run_fuzzy_dedup(_write(rows, tmp_path / "in"), str(tmp_path / "out"), options=pool)

    removed = _removed(tmp_path / "out")
    assert [(row["id"], row["duplicate_of"], row["source"]) for row in removed] == [
        (document_id(near), original["id"], "near"),
        (document_id(prefixed), original["id"], "prefixed"),
    ]
    expected = [_true_jaccard(original["text"], text) for text in (near, prefixed)]
    assert [row["similarity"] for row in removed] == pytest.approx(expected)  # not the estimate
    assert all(0.8 < row["similarity"] < 1.0 for row in removed)
    stage = json.loads((tmp_path / "out" / "stage.json").read_text())
    assert (stage["stage"], stage["documents_in"], stage["documents_out"]) == ("fuzzy_dedup", 4, 2)
    assert stage["dropped"] == {"near_duplicate": 2}
    assert stage["dropped_sample"] == {"near_duplicate": [document_id(near), document_id(prefixed)]}
    assert stage["details"]["config"]["num_perm"] == 112
    assert {row["source"] for row in _kept(tmp_path / "out")} == {"first", "other"}


def test_fuzzy_dedup_keeps_one_copy_of_a_repeated_id(tmp_path, pool):
    """An id repeated in the input is two documents: the later copy goes, naming its own id,
    and the kept documents stay in input order."""
    text = " ".join(f"word{n}" for n in range(40))
    rows = [_doc(text, "a"), _doc("something else entirely here", "b"), _doc(text, "c")]
    run_fuzzy_dedup(_write(rows, tmp_path / "in", files=1), str(tmp_path / "out"), options=pool)
    [removed] = _removed(tmp_path / "out")
    assert (removed["source"], removed["duplicate_of"]) == ("c", rows[0]["id"])
    assert [row["source"] for row in _kept(tmp_path / "out")] == ["a", "b"]


def test_short_documents_are_one_shingle_and_empty_ones_have_none():
    texts = pa.array(["The cat sat.", "the CAT, sat", "the cat sits", "", "?!", None])
    signature = minhash.signatures(texts, 112, 5, 1)
    assert (signature[0] == signature[1]).all()  # same words after normalization
    assert minhash.estimated_jaccard(signature[0], signature[2]) < 0.1
    assert (signature[3:] == minhash.EMPTY).all()
    keys = minhash.band_keys(signature[:3], 14, 8, 1)
    assert keys.shape == (3, 14) and (keys[0] == keys[1]).all()


def test_shingle_sets_are_each_documents_distinct_shingles_sorted():
    """Verification intersects these sets: a repeated or unsorted shingle would miscount the
    shared ones. Checked against Python sets of shingle_hashes' top halves, across the slices
    the documents are hashed in (2,500 documents), with empty, null and repetitive ones."""
    rng = np.random.default_rng(5)
    texts = [
        " ".join(f"w{n}" for n in rng.integers(0, 60, rng.integers(0, 300))) for _ in range(2500)
    ]
    texts[10:14] = ["", None, "one two", "la la la la la la la la la la"]
    texts[-1] = ""
    flat, offsets = minhash.shingle_sets(pa.array(texts), 5)
    hashes, starts = minhash.shingle_hashes(pa.array(texts), 5)
    assert len(offsets) == len(texts) + 1
    for doc in range(len(texts)):
        expected = sorted({int(h) >> 32 for h in hashes[starts[doc] : starts[doc + 1]]})
        assert flat[offsets[doc] : offsets[doc + 1]].tolist() == expected


def test_signature_estimates_jaccard():
    rng = np.random.default_rng(0)
    words = [f"w{n}" for n in rng.integers(0, 10_000, 400)]
    edited = list(words)
    for position in rng.choice(400, 12, replace=False):
        edited[position] = "changed"
    true = len(bench.shingle_set(" ".join(words)) & bench.shingle_set(" ".join(edited))) / len(
        bench.shingle_set(" ".join(words)) | bench.shingle_set(" ".join(edited))
    )
    signature = minhash.signatures(pa.array([" ".join(words), " ".join(edited)]), 112, 5, 1)
    assert minhash.estimated_jaccard(signature[0], signature[1]) == pytest.approx(true, abs=0.12)


def test_signatures_of_many_pairs_estimate_jaccard_without_bias():
    """One-permutation MinHash with densification: over many pairs of 10-400 words, the fraction
    of equal entries tracks the true Jaccard (a densification that borrowed from empty or
    differently chosen bins would bias short documents' estimates), and no document with words
    keeps an empty entry."""
    rng = np.random.default_rng(1)
    texts, truths = [], []
    for _ in range(150):
        words = [f"w{n}" for n in rng.integers(0, 100_000, int(rng.integers(10, 400)))]
        edited = list(words)
        for position in rng.choice(len(words), int(rng.integers(1, 1 + len(words) // 8))):
            edited[position] = f"x{position}"
        left, right = bench.shingle_set(" ".join(words)), bench.shingle_set(" ".join(edited))
        truths.append(len(left & right) / len(left | right))
        texts += [" ".join(words), " ".join(edited)]
    signature = minhash.signatures(pa.array(texts), 112, 5, 3)
    assert not (signature == minhash.EMPTY).any()
    errors = minhash.estimated_jaccard(signature[0::2], signature[1::2]) - np.array(truths)
    assert abs(errors.mean()) < 0.01
    assert errors.std() < 0.06


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"bands": 10}, "bands * rows must equal num_perm"),
        ({"num_perm": 100}, "bands * rows must equal num_perm"),
        ({"threshold": 0.0}, "threshold must be in (0, 1]"),
        ({"threshold": 1.5}, "threshold must be in (0, 1]"),
        ({"ngram": 0}, "ngram must be at least 1"),
        ({"num_shards": 0}, "num_shards must be at least 1"),
    ],
)
def test_fuzzy_config_rejects_bad_values(fields, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        FuzzyDedupConfig(**fields)


def test_exact_config_rejects_bad_shards():
    with pytest.raises(UsageError, match="num_shards must be at least 1"):
        ExactDedupConfig(num_shards=0)
