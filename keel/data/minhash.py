"""MinHash signatures and LSH band keys of documents, vectorised over a batch with numpy.

A document's shingles are its word n-grams after normalization: lowercase, every run of Unicode
punctuation or symbols (`\\p{P}`, `\\p{S}`) replaced by a space, split on whitespace (found in
one pass over the UTF-8 bytes by keel.data.words). A document
with fewer than `ngram` words (but at least one) has one shingle: all its words. A document with
no words has no shingles and no signature: it is never a near-duplicate of anything.

Hashing, all in 64-bit integer arithmetic:
- each word is hashed from its bytes (keel.data.words); a shingle's hash combines its words'
  hashes as a polynomial (h = h * M + w, wrapping at 2**64) finished with murmur3's fmix64, so
  no shingle string is ever built;
- the signature is one-permutation MinHash with optimal densification (Li, Owen and Zhang 2012;
  Shrivastava 2017): each shingle is hashed once more under `seed`; the high 32 bits of that hash
  pick one of `num_perm` bins, the low 31 bits are its value, and signature[i] is the smallest
  value in bin i. A bin no shingle fell into takes the value of the first non-empty bin along a
  probe sequence fixed by (i, seed), the same for every document, so two documents collide on an
  entry with probability their Jaccard similarity, as with `num_perm` separate permutations;
- entries are uint32 (448 bytes per document at 112 bins).

Why not k permutations (datasketch's and datatrove's way, this module's until Dec 2026): they
cost num_perm multiply-mod-min operations per shingle, 1.7 s of CPU for 15,000 documents on the
benchmark machine, against 0.11 s for one hash per shingle; the estimate of the Jaccard
similarity is as good (200 pairs of 20-500 words, estimate - truth: sd 0.041 against 0.039).

The fraction of equal signature entries of two documents estimates the Jaccard similarity of their
shingle sets. LSH cuts the signature into `bands` bands of `rows` entries; two documents whose
entries agree on a whole band share that band's key, so pairs of similarity s become candidates
with probability 1 - (1 - s**rows)**bands (0.924 at s = 0.8 for 14 bands of 8).

Batches are worked in slices of _SLICE_DOCS documents: the arrays of a slice stay in cache and
reuse the allocator's memory, where a whole 15,000-document batch's arrays (30 MB each) are fresh
pages every time (signatures 3x slower on the benchmark machine).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from keel.data import words
from keel.data.words import fmix64

EMPTY = np.uint32(0xFFFFFFFF)
"""The signature entry of a document without shingles."""

_WORD_MIX = np.uint64(0x9E3779B97F4A7C15)
_VALUE_BITS = np.uint64(0x7FFFFFFF)
"""A bin's value: the low 31 bits of the shingle's hash (never EMPTY)."""
_SLICE_DOCS = 1024
"""Documents hashed at once (see the module docstring)."""
_HALF = np.uint64(32)


def shingle_hashes(texts: pa.Array, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of every text's word n-grams, in order: flat uint64 [n_shingles], and the index
    of each text's first shingle, int64 [n_texts + 1] (text d owns
    shingles[offsets[d]:offsets[d + 1]], empty when it has no words)."""
    word_hashes, word_offsets = words.word_hashes(texts)
    lengths = np.diff(word_offsets)
    counts = np.where(lengths >= ngram, lengths - ngram + 1, np.minimum(lengths, 1))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if len(word_hashes) == 0:
        return np.zeros(0, dtype=np.uint64), offsets
    windows = _ngram_windows(word_hashes, word_offsets, ngram)
    if len(windows) == offsets[-1]:  # no text of 1 to ngram - 1 words
        return fmix64(windows), offsets
    hashes = np.empty(offsets[-1], dtype=np.uint64)
    full = np.repeat(lengths >= ngram, counts)  # which shingles are whole n-grams
    hashes[full] = windows
    hashes[~full] = _whole_texts(word_hashes, word_offsets, lengths, ngram)
    return fmix64(hashes), offsets


def _ngram_windows(word_hashes: np.ndarray, word_offsets: np.ndarray, ngram: int) -> np.ndarray:
    """The polynomial hash of every n-word window inside a document, in order: windows over the
    flat word array by slices, then those that cross a document's end dropped (the last
    ngram - 1 starts before each document's end: a start that falls in an earlier document is
    within ngram - 1 of that one's end too)."""
    count = len(word_hashes) - ngram + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    windows = word_hashes[:count].copy()
    for k in range(1, ngram):
        windows *= _WORD_MIX
        windows += word_hashes[k : k + count]
    inside = np.ones(count, dtype=bool)
    for back in range(1, ngram):
        starts = word_offsets[1:] - back
        inside[starts[(starts >= 0) & (starts < count)]] = False
    return windows[inside]


def _whole_texts(
    word_hashes: np.ndarray, word_offsets: np.ndarray, lengths: np.ndarray, ngram: int
) -> np.ndarray:
    """The polynomial hash of all the words of each document with 1 to ngram - 1 words."""
    short = np.flatnonzero((lengths > 0) & (lengths < ngram))
    hashes = np.zeros(len(short), dtype=np.uint64)
    for k in range(ngram - 1):
        inside = k < lengths[short]
        word = word_hashes[np.where(inside, word_offsets[short] + k, 0)]
        hashes = np.where(inside, hashes * _WORD_MIX + word, hashes)
    return hashes


def signatures(
    texts: pa.Array | pa.ChunkedArray, num_perm: int, ngram: int, seed: int
) -> np.ndarray:
    """MinHash signatures of a batch of texts: uint32 [n_docs, num_perm]; rows of documents
    without words are all EMPTY."""
    parts = [np.zeros((0, num_perm), dtype=np.uint32)]
    for shingles, offsets in _sliced_shingle_hashes(texts, ngram):
        parts.append(minhash(shingles, offsets, num_perm, seed))
    return np.concatenate(parts)


def _sliced_shingle_hashes(
    texts: pa.Array | pa.ChunkedArray, ngram: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`shingle_hashes` of the texts' normalized words, _SLICE_DOCS documents at a time (see the
    module docstring), in order."""
    texts = texts.combine_chunks() if isinstance(texts, pa.ChunkedArray) else texts
    for low in range(0, len(texts), _SLICE_DOCS):
        yield shingle_hashes(texts.slice(low, _SLICE_DOCS), ngram)


def minhash(shingles: np.ndarray, offsets: np.ndarray, num_perm: int, seed: int) -> np.ndarray:
    """One-permutation MinHash of each document's shingles (`shingle_hashes`' two arrays):
    uint32 [n_docs, num_perm], densified; rows of documents without shingles are all EMPTY."""
    n_docs = len(offsets) - 1
    counts = np.diff(offsets)
    hashed = fmix64(shingles ^ _seed_mix(seed))
    bins = ((hashed >> np.uint64(32)) * np.uint64(num_perm)) >> np.uint64(32)
    bins += np.repeat(np.arange(n_docs, dtype=np.uint64) * np.uint64(num_perm), counts)
    best = np.full(n_docs * num_perm, EMPTY, dtype=np.uint32)
    np.minimum.at(best, bins, (hashed & _VALUE_BITS).astype(np.uint32))
    best = best.reshape(n_docs, num_perm)
    filled = best != EMPTY
    rows, columns = np.nonzero(~filled & (counts > 0)[:, None])
    probes = _probe_orders(num_perm, seed)
    for step in range(num_perm):  # a document with a shingle has a filled bin: <= num_perm probes
        if not len(rows):
            break
        source = probes[columns, step]
        found = filled[rows, source]
        best[rows[found], columns[found]] = best[rows[found], source[found]]
        rows, columns = rows[~found], columns[~found]
    return best


@functools.cache
def _probe_orders(num_perm: int, seed: int) -> np.ndarray:
    """The bins an empty bin i borrows from, in order of preference: row i is a permutation of
    the bins, drawn from `seed`; int64 [num_perm, num_perm]."""
    generator = np.random.default_rng([seed, 0xD5])
    return np.stack([generator.permutation(num_perm) for _ in range(num_perm)])


def _seed_mix(seed: int) -> np.uint64:
    """The 64-bit word a shingle hash is xored with before its bin and value are drawn."""
    return np.random.default_rng([seed, 0x0F]).integers(0, 2**63, dtype=np.uint64)


def shingle_sets(texts: pa.Array | pa.ChunkedArray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Each document's distinct shingles, sorted: flat uint32 [n_distinct], and the index of each
    document's first, int64 [n_docs + 1] (as `shingle_hashes` returns them). A shingle here is
    the top 32 bits of its hash: half the bytes to ship and hold, and two documents of a few
    hundred shingles share a value by accident with odds ~1e-5, which moves their Jaccard by
    1 / (shingles in their union).

    Each document's shingles are sorted on their own, in place: one small sort per document
    (a Python loop, ~1 us each) is ~10x faster than one sort of (document, shingle) keys over
    the whole batch (0.09 -> 0.01 s for 7,800 documents), which pays log(batch) comparisons
    per shingle where log(document) suffice."""
    flats, sizes = [np.zeros(0, dtype=np.uint32)], [np.zeros(0, dtype=np.int64)]
    for hashes, offsets in _sliced_shingle_hashes(texts, ngram):
        values = (hashes >> _HALF).astype(np.uint32)
        for low, high in itertools.pairwise(offsets.tolist()):
            values[low:high].sort()
        distinct = np.ones(len(values), dtype=bool)
        distinct[1:] = values[1:] != values[:-1]
        distinct[offsets[:-1][offsets[:-1] < len(values)]] = True  # each document's first
        counts = np.diff(offsets)
        owners = np.repeat(np.arange(len(counts)), counts)
        sizes.append(np.bincount(owners[distinct], minlength=len(counts)))
        flats.append(values[distinct])
    size = np.concatenate(sizes)
    return np.concatenate(flats), np.concatenate([[0], np.cumsum(size)]).astype(np.int64)


def band_keys(signature: np.ndarray, bands: int, rows: int, seed: int) -> np.ndarray:
    """One int64 key per (document, band): [n_docs, bands]. Documents share a band's key when
    their `rows` entries of that band are equal (other equal keys are 2**-64 accidents, which
    verification removes). Bands use different multipliers, so keys of different bands differ."""
    multipliers = np.random.default_rng([seed, 0xBA4D]).integers(
        1, 2**63, size=(bands, rows), dtype=np.uint64
    ) | np.uint64(1)
    values = signature[:, : bands * rows].reshape(len(signature), bands, rows).astype(np.uint64)
    return fmix64((values * multipliers).sum(axis=2, dtype=np.uint64)).view(np.int64)


def estimated_jaccard(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """The fraction of equal entries of signatures [..., num_perm] (broadcast): float64 [...]."""
    return np.mean(left == right, axis=-1)
