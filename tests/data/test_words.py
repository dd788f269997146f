"""keel.data.words finds exactly the words of keel's normalization as pyarrow computes it
(lowercase, runs of punctuation and symbols to a space, split on white space): for every Unicode
code point and on real text; its hashes tell distinct words apart."""

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from keel.data import words

SAMPLES = Path(__file__).resolve().parents[2] / "keel" / "experiments" / "sample"


def reference_words(texts: pa.Array) -> list[list[str]]:
    """The normalization as pyarrow's kernels compute it (keel's way until Dec 2026)."""
    spaced = pc.replace_substring_regex(pc.utf8_lower(texts), r"[\p{P}\p{S}]+", " ")
    split = pc.utf8_split_whitespace(spaced).to_pylist()
    return [[word for word in text if word] if text is not None else [] for text in split]


def assert_same_words(texts: pa.Array) -> None:
    expected = reference_words(texts)
    hashes, offsets = words.word_hashes(texts)
    assert np.diff(offsets).tolist() == [len(text) for text in expected]
    flat = [word for text in expected for word in text]
    # each word alone is one word: its hash, made the same way, must be the one found in place
    alone, alone_offsets = words.word_hashes(pa.array(flat, pa.string()))
    assert np.diff(alone_offsets).tolist() == [1] * len(flat)
    assert np.array_equal(hashes, alone)


def test_every_code_point_splits_or_joins_words_as_the_regex_normalization_does():
    code_points = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    texts = pa.array([f"ab{chr(c)}cd" for c in code_points], pa.string())
    expected = reference_words(texts)
    hashes, offsets = words.word_hashes(texts)
    counts = np.diff(offsets)
    assert counts.tolist() == [len(text) for text in expected]
    separators = sum(len(text) == 2 for text in expected)
    assert 5_000 < separators < 20_000  # punctuation, symbols, spaces: a few thousand of them
    joined = np.flatnonzero(counts == 1)
    assert np.array_equal(
        hashes[offsets[joined]],
        words.word_hashes(pa.array([expected[i][0] for i in joined], pa.string()))[0],
    )


def test_real_text_gives_the_same_words_in_slices_nulls_and_large_strings():
    with gzip.open(SAMPLES / "wikitext2.jsonl.gz", "rt") as lines:
        articles = [json.loads(line)["text"] for line in lines]
    with gzip.open(SAMPLES / "crawl.jsonl.gz", "rt") as lines:
        pages = [json.loads(line)["html"] for line in lines]  # markup: symbols everywhere
    mixed = "«¿Qué?» — ÉTÉ naïve\u00a0café\u3000東京 😀x😀"  # 2-, 3- and 4-byte characters
    blob = "QUJD" * 50_000  # one 200,000-byte word, as base64 in a crawled page
    edges = [None, "", "   ", "a", mixed, "x" * 8, "y" * 16, "z" * 64, "w" * 65, f"a {blob} b"]
    texts = pa.array(articles + pages + edges, pa.string())
    assert_same_words(texts)
    assert_same_words(texts.slice(7, 20))  # a slice starts at an offset into the buffers
    assert_same_words(texts.cast(pa.large_string()))


def test_distinct_words_get_distinct_hashes():
    with gzip.open(SAMPLES / "wikitext2.jsonl.gz", "rt") as lines:
        texts = pa.array([json.loads(line)["text"] for line in lines], pa.string())
    vocabulary = {word for text in reference_words(texts) for word in text}
    vocabulary = sorted(vocabulary | {"a" * n for n in range(1, 80)} | {"a\x00", "a\x00\x00"})
    hashes, _ = words.word_hashes(pa.array(vocabulary, pa.string()))
    assert len(vocabulary) > 5_000 and len(np.unique(hashes)) == len(vocabulary)


def reference_hash(word: bytes) -> int:
    """The module doc's word hash, one word at a time in Python (arithmetic mod 2**64)."""
    if len(word) > words.LONG_WORD:
        return xxhash.xxh3_64_intdigest(word)
    mask, k = 2**64 - 1, 0x9E3779B97F4A7C15

    def fmix64(h: int) -> int:
        h ^= h >> 33
        h = (h * 0xFF51AFD7ED558CCD) & mask
        h ^= h >> 33
        h = (h * 0xC4CEB9FE1A85EC53) & mask
        return h ^ (h >> 33)

    h = (len(word) * k) & mask
    for start in range(0, len(word), 8):
        chunk = int.from_bytes(word[start : start + 8].ljust(8, b"\0"), "little")
        h = fmix64(((h * k) & mask) ^ chunk)
    return h


def test_word_hashes_follow_the_documented_formula():
    """Shingles and signatures, and so which documents a run removes, depend on these values:
    a faster implementation must give the same ones."""
    vocabulary = ["a", "ab", "word", "eightchr", "ninechars", "x" * 16, "y" * 17, "z" * 64]
    vocabulary += ["w" * 65, "naïve", "東京", "a\x00"]
    hashes, _ = words.word_hashes(pa.array(vocabulary, pa.string()))
    assert hashes.tolist() == [reference_hash(word.encode()) for word in vocabulary]
