"""Decontamination against real eval items (GSM8K test) planted into real text (WikiText-2)."""

from __future__ import annotations

import gzip
import json
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from keel.core.errors import UsageError
from keel.data.bloom import BloomFilter
from keel.data.decontam import DecontamConfig, EvalSet, build_index, find_windows, run_decontam
from keel.data.documents import StageReport, document_id, write_texts
from keel.data.ngrams import hashed_windows, words
from keel.flow import RunOptions

SHARED = Path(__file__).resolve().parents[3] / "shared"  # beside the repository, as CI has it
GSM8K = str((SHARED if SHARED.exists() else Path("/work/shared")) / "datasets/gsm8k/test.jsonl")
WIKITEXT = Path(__file__).parents[2] / "keel" / "experiments" / "sample" / "wikitext2.jsonl.gz"
GSM8K_SET = EvalSet(GSM8K, fields=("question", "answer"), name="gsm8k")
NGRAM = 13


@pytest.fixture(scope="module")
def eval_texts() -> list[str]:
    return [item[field] for item in gsm8k_items() for field in ("question", "answer")]


def gsm8k_items() -> list[dict]:
    with open(GSM8K, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture(scope="module")
def eval_ngrams(eval_texts) -> set[tuple[str, ...]]:
    """The ground truth, by plain Python tuples: every 13-gram, and every shorter text whole."""
    grams = set()
    for text in eval_texts:
        tokens = words(text)
        if len(tokens) < NGRAM:
            assert len(tokens) == 11
            grams.add(tuple(tokens))
        grams.update(tuple(tokens[i : i + NGRAM]) for i in range(len(tokens) - NGRAM + 1))
    return grams


@pytest.fixture(scope="module")
def paragraphs() -> list[str]:
    with gzip.open(WIKITEXT, "rt", encoding="utf-8") as handle:
        articles = [json.loads(line)["text"] for line in handle]
    lines = [line for text in articles for line in text.split("\n")]
    return [line for line in lines if len(line.split()) >= 40 and not line.startswith("=")]


def contaminated(text: str, grams: set[tuple[str, ...]]) -> bool:
    """Whether `text` holds one of `grams` (GSM8K's one short text has 11 words)."""
    tokens = words(text)
    return any(
        tuple(tokens[i : i + n]) in grams for n in (11, NGRAM) for i in range(len(tokens) - n + 1)
    )


def window(text: str, first: int) -> str:
    """The raw text of words first .. first+12 of an eval text, punctuation between them kept."""
    spans = [m.span() for m in re.finditer(r"\w+", text)]
    return text[spans[first][0] : spans[first + NGRAM - 1][1]]


def disguise(text: str, rng: random.Random) -> str:
    """Other case and punctuation, the same words after normalisation."""
    text = re.sub(r"\s+", lambda _: rng.choice([" , ", " -- ", ";\n", "  "]), text)
    return text.upper().replace("’", "'")


def plant(text: str, insert: str, rng: random.Random) -> str:
    spaces = [m.start() for m in re.finditer(" ", text)]
    at = rng.choice(spaces)
    return f"{text[:at]} {insert} {text[at + 1 :]}"


def read_documents(directory: Path) -> list[dict]:
    parts = sorted(directory.glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(part) for part in parts]).to_pylist()


@pytest.fixture(scope="module")
def planted(paragraphs, eval_texts, eval_ngrams):
    """WikiText paragraphs, 80 of them with a 13-word window of a GSM8K item planted (half of
    those in other case and punctuation), one with a whole short answer; and the clean rest."""
    rng = random.Random(0)
    clean = [p for p in paragraphs if not contaminated(p, eval_ngrams)]
    assert len(clean) == len(paragraphs), "the WikiText sample itself holds GSM8K n-grams"
    texts = list(clean)
    chosen = rng.sample(range(len(texts)), 81)
    long_texts = [t for t in eval_texts if len(words(t)) >= NGRAM]
    for number, doc in enumerate(chosen[:80]):
        item = rng.choice(long_texts)
        raw = window(item, rng.randrange(len(words(item)) - NGRAM + 1))
        texts[doc] = plant(texts[doc], disguise(raw, rng) if number % 2 else raw, rng)
    short = next(t for t in eval_texts if len(words(t)) < NGRAM)
    texts[chosen[80]] = plant(texts[chosen[80]], short, rng)
    planted_ids = {document_id(texts[doc]) for doc in chosen}
    assert all(contaminated(texts[doc], eval_ngrams) for doc in chosen)
    return texts, planted_ids


def test_bloom_false_positive_rate_matches_its_formula_and_misses_nothing():
    rng = np.random.default_rng(0)
    bloom = BloomFilter.for_capacity(50_000, 1e-3)
    added = rng.integers(0, 2**64, size=(50_000, 2), dtype=np.uint64)
    bloom.add(added)
    assert bloom.query(added).all()
    others = rng.integers(0, 2**64, size=(500_000, 2), dtype=np.uint64)
    measured = bloom.query(others).mean()
    expected = bloom.expected_false_positive_rate()
    assert 0.7 * expected < measured < 1.3 * expected, f"measured {measured:.2e}, {expected:.2e}"
    assert abs(expected - 1e-3) < 1e-4 and 0.45 < bloom.fill_ratio() < 0.55


def test_bloom_pickles_as_its_bits():
    bloom = BloomFilter.for_capacity(100_000, 1e-6)
    hashes = np.random.default_rng(1).integers(0, 2**64, size=(1000, 2), dtype=np.uint64)
    bloom.add(hashes)
    payload = pickle.dumps(bloom)
    assert len(payload) < bloom.bits.nbytes + 200
    copy = pickle.loads(payload)
    assert copy.query(hashes).all() and copy.count == 1000
    assert np.array_equal(copy.bits, bloom.bits)


def test_every_planted_ngram_is_caught_and_clean_text_is_not(tmp_path, planted, eval_ngrams):
    texts, planted_ids = planted
    source = write_texts(tmp_path / "in", texts, 2, "wikitext2")
    config = DecontamConfig(eval_sets=(GSM8K_SET,))
    report = run_decontam(source, str(tmp_path / "out"), config, options=RunOptions(workers=2))

    found = pq.read_table(tmp_path / "out" / "contaminated.parquet").to_pylist()
    flagged = {row["id"] for row in found}
    truth = {document_id(t) for t in texts if contaminated(t, eval_ngrams)}
    assert truth == planted_ids
    false_negatives, false_positives = truth - flagged, flagged - truth
    clean = len(texts) - len(truth)
    rate = len(false_positives) / clean
    message = (
        f"false negatives {len(false_negatives)} of {len(truth)}; false positives "
        f"{len(false_positives)} of {clean} clean documents (rate {rate:.2e})"
    )
    print(message)
    assert not false_negatives and not false_positives, message
    assert all(row["eval_set"] == "gsm8k" and row["overlap"] >= 1 for row in found)

    kept = [row["id"] for row in read_documents(tmp_path / "out")]
    assert set(kept).isdisjoint(truth) and len(kept) == len(texts) - len(truth)
    assert report.dropped == {"contaminated:gsm8k": len(truth)}
    assert StageReport.read(str(tmp_path / "out")).documents_in == len(texts)
    summary = json.loads((tmp_path / "out" / "report.json").read_text())["eval_sets"]["gsm8k"]
    assert summary["items"] == 1319 and summary["short_texts"] == 1
    assert summary["documents_flagged"] == summary["documents_dropped"] == len(truth)


def test_a_loose_bloom_filter_only_costs_candidates_not_false_flags(paragraphs):
    """At a 1% filter, about 1% of clean windows pass the filter; the exact check rejects all."""
    index = build_index(DecontamConfig(eval_sets=(GSM8K_SET,), false_positive_rate=0.01))
    assert not any(find_windows(index, paragraphs))
    tokens = [words(p) for p in paragraphs]
    hashes = np.concatenate(
        [h for _, _, _, h in hashed_windows(index.coefficients, tokens, (NGRAM,))]
    )
    rate = index.bloom.query(hashes).mean()
    print(f"Bloom candidates among {len(hashes)} clean 13-grams: {rate:.2%} (configured 1%)")
    assert 0.005 < rate < 0.015


def test_remove_spans_cuts_only_the_matching_words(tmp_path, eval_texts):
    item = next(t for t in eval_texts if t.startswith("Janet"))
    raw = window(item, 0)  # "Janet’s ducks lay 16 eggs per day. She eats three for breakfast"
    before, after = "The lake froze early that year.", "Nobody in the village expected it."
    text = f"{before} {raw} {after}"
    clean = "A clean document stays as it is."
    source = write_texts(tmp_path / "in", [text, clean, f"({raw})"], 1, "wikitext2")
    config = DecontamConfig(eval_sets=(GSM8K_SET,), mode="remove_spans")
    report = run_decontam(source, str(tmp_path / "out"), config, options=RunOptions(workers=1))

    rows = read_documents(tmp_path / "out")
    assert [r["text"] for r in rows] == [f"{before} {after}", clean]
    assert rows[0]["id"] == document_id(rows[0]["text"])
    # A document with nothing left but punctuation is dropped.
    assert report.dropped == {"contaminated:gsm8k": 1} and report.documents_out == 2
    found = pq.read_table(tmp_path / "out" / "contaminated.parquet").to_pylist()
    assert found == [
        {"id": document_id(t), "eval_set": "gsm8k", "overlap": 1} for t in (text, f"({raw})")
    ]
    summary = json.loads((tmp_path / "out" / "report.json").read_text())["eval_sets"]["gsm8k"]
    assert (summary["documents_cleaned"], summary["documents_dropped"]) == (1, 1)


def test_output_is_byte_identical_for_one_and_two_workers(tmp_path, planted):
    texts, _ = planted
    source = write_texts(tmp_path / "in", texts[:300], 3, "wikitext2")
    config = DecontamConfig(eval_sets=(GSM8K_SET,), mode="remove_spans")
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        run_decontam(source, str(out), config, RunOptions(workers=workers))
        outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outputs[0] == outputs[1]
    assert "contaminated.parquet" in outputs[0] and "part-00000-of-00003.parquet" in outputs[0]


def test_short_items_match_whole_and_min_matches_sets_the_bar(tmp_path):
    path = tmp_path / "tiny.jsonl"
    items = [{"question": "What is the capital of France?"}, {"question": "Name a prime."}]
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    index = build_index(DecontamConfig(eval_sets=(EvalSet(str(path)),), ngram=5))
    assert index.names == ("tiny",) and index.lengths == (3, 5)
    texts = ["so: what IS the capital of france? Paris.", "name a prime number", "a prime"]
    assert find_windows(index, texts) == [{"tiny": [(1, 5), (2, 5)]}, {"tiny": [(0, 3)]}, {}]
    # Two overlapping 5-grams flag the first text at min_matches=2, not at 3.
    for bar, kept in ((2, 2), (3, 3)):
        source = write_texts(tmp_path / f"in{bar}", texts, 1, "wikitext2")
        config = DecontamConfig(eval_sets=(EvalSet(str(path)),), ngram=5, min_matches=bar)
        assert (
            run_decontam(
                source, str(tmp_path / f"out{bar}"), config, RunOptions(workers=1)
            ).documents_out
            == kept
        )


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst", ".parquet"])
def test_eval_sets_read_from_compressed_jsonl_and_parquet(tmp_path, suffix):
    rows = gsm8k_items()[:50]
    path = tmp_path / f"gsm{suffix}"
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    if suffix == ".jsonl.gz":
        path.write_bytes(gzip.compress(lines))
    elif suffix == ".jsonl.zst":
        path.write_bytes(zstandard.ZstdCompressor().compress(lines))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    plain = tmp_path / "gsm.jsonl"
    plain.write_bytes(lines)
    index = build_index(DecontamConfig(eval_sets=(EvalSet(str(path), ("question", "answer")),)))
    reference = build_index(
        DecontamConfig(eval_sets=(EvalSet(str(plain), ("question", "answer")),))
    )
    assert index.names == ("gsm",)
    assert np.array_equal(index.keys[0], reference.keys[0]) and index.stats[0]["items"] == 50


def test_a_missing_eval_file_or_field_is_a_usage_error(tmp_path):
    source = write_texts(tmp_path / "in", ["some text"], 1, "wikitext2")
    missing = DecontamConfig(eval_sets=(EvalSet(str(tmp_path / "nope.jsonl")),))
    with pytest.raises(UsageError, match=r"nope\.jsonl"):
        run_decontam(source, str(tmp_path / "out"), missing)
    wrong_field = DecontamConfig(eval_sets=(EvalSet(GSM8K, fields=("question", "prompt")),))
    with pytest.raises(UsageError, match=r"test\.jsonl has no field 'prompt'"):
        run_decontam(source, str(tmp_path / "out"), wrong_field)
    parquet = tmp_path / "eval.parquet"
    pq.write_table(pa.table({"question": ["a b c"]}), parquet)
    with pytest.raises(UsageError, match=r"eval\.parquet has no field 'answer'"):
        build_index(DecontamConfig(eval_sets=(EvalSet(str(parquet), fields=("answer",)),)))
