"""Word n-grams as 128-bit hashes, fast: the matching machinery of decontamination.

Text is normalised to words (lowercased runs of word characters, so case and punctuation do not
matter). Every distinct word gets one xxh3-128; an n-gram's hash is a fixed combination of its
words' hashes (sum of position constant x word hash, per 64-bit half), computed for all windows of
a block of texts at once with numpy: about 4x faster than hashing each n-gram's string.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
import xxhash

from keel.data import documents
from keel.data.bloom import hash128

BLOCKWORDS = 1 << 20
"""Words hashed at once (bounds the arrays of hashed_windows: ~50 bytes per word)."""

WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """The normalised words of a text (module doc): lowercased runs of word characters."""
    if text.isascii():  # ASCII lowercasing keeps every character's class and offset
        return WORD.findall(text.lower())
    return [word.lower() for word in WORD.findall(text)]


def coefficients(ngram: int) -> np.ndarray:
    """Fixed odd constants, one per position and hash half: uint64 [ngram, 2]."""
    values = [
        xxhash.xxh3_64_intdigest(f"keel.decontam/{j}/{h}".encode()) | 1
        for j in range(ngram)
        for h in (0, 1)
    ]
    return np.array(values, dtype=np.uint64).reshape(ngram, 2)


def blocks(tokens: list[list[str]]) -> Iterator[tuple[int, list[list[str]]]]:
    """Consecutive runs of texts of about BLOCKWORDS words: (index of the first, the run)."""
    start, size = 0, 0
    for end, text in enumerate(tokens):
        if size and size + len(text) > BLOCKWORDS:
            yield start, tokens[start:end]
            start, size = end, 0
        size += len(text)
    if start < len(tokens):
        yield start, tokens[start:]


def hashed_windows(
    coefficients: np.ndarray, tokens: list[list[str]], lengths: Sequence[int]
) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Every window of each of `lengths` (ascending) that lies inside one text: (length, text
    index [V], first word [V], hash uint64 [V, 2]). Hash: sum_j coefficients[j] * h(word_j)."""
    sizes = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    total = int(offsets[-1])
    if total == 0:
        return
    encoded = pa.array(itertools.chain.from_iterable(tokens), pa.string()).dictionary_encode()
    vocabulary = hash128(word.encode("utf-8") for word in encoded.dictionary.to_pylist())
    ids = encoded.indices.to_numpy()
    halves = [np.ascontiguousarray(vocabulary[ids, half]) for half in (0, 1)]
    doc = np.repeat(np.arange(len(tokens)), sizes)
    room = offsets[1:][doc] - np.arange(total)  # words from each position to its text's end
    sums = [np.zeros(total, dtype=np.uint64) for _ in halves]
    term = np.empty(total, dtype=np.uint64)
    for j in range(max(lengths)):
        for half, (word_hash, total_hash) in enumerate(zip(halves, sums, strict=True)):
            np.multiply(word_hash[j:], coefficients[j, half], out=term[: total - j])
            total_hash[: total - j] += term[: total - j]
        if j + 1 in lengths:
            starts = np.flatnonzero(room >= j + 1)
            hashed = np.column_stack([sums[0][starts], sums[1][starts]])
            yield j + 1, doc[starts], starts - offsets[doc[starts]], hashed


def contains(keys: np.ndarray, hashed: np.ndarray) -> np.ndarray:
    """Which rows of `hashed` [n, 2] are among `keys` [2, m] (sorted by row 0): bool [n]."""
    if not keys.shape[1]:
        return np.zeros(len(hashed), dtype=bool)
    where = np.minimum(np.searchsorted(keys[0], hashed[:, 0]), keys.shape[1] - 1)
    return (keys[0][where] == hashed[:, 0]) & (keys[1][where] == hashed[:, 1])


def remove_windows(text: str, windows: Sequence[tuple[int, int]]) -> str | None:
    """`text` without the words of `windows` (first word, length) and whatever lies between two
    removed words; a space doubled by a cut becomes one. None when no word is left."""
    spans = [match.span() for match in WORD.finditer(text)]
    cut = {word for first, length in windows for word in range(first, first + length)}
    pieces, cursor = [], 0
    for is_cut, run in itertools.groupby(range(len(spans)), key=cut.__contains__):
        if is_cut:
            run = list(run)
            pieces.append(text[cursor : spans[run[0]][0]])
            cursor = spans[run[-1]][1]
    pieces.append(text[cursor:])
    kept = pieces[0]
    for piece in pieces[1:]:
        kept += piece.lstrip(" \t") if not kept or kept.endswith((" ", "\t")) else piece
    kept = documents.normalize_text(kept)
    return kept if WORD.search(kept) else None
