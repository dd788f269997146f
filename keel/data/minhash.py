"""MinHash signatures and LSH band keys of documents, vectorised over a batch with numpy.

A document's shingles are its word n-grams after normalization: lowercase, every run of Unicode
punctuation or symbols (`\\p{P}`, `\\p{S}`) replaced by a space, split on whitespace. A document
with fewer than `ngram` words (but at least one) has one shingle: all its words. A document with
no words has no shingles and no signature: it is never a near-duplicate of anything.

Hashing, all in 64-bit integer arithmetic:
- each distinct word of a batch is hashed once with xxh3-64; a shingle's hash combines its words'
  hashes as a polynomial (h = h * M + w, wrapping at 2**64) finished with murmur3's fmix64, so
  no shingle string is ever built;
- permutation i maps a shingle hash h to (a_i * h + b_i) mod (2**61 - 1), the product wrapping
  at 2**64 first (as datasketch and datatrove compute it); a_i, b_i are drawn from `seed`;
- signature[i] is the minimum over the document's shingles, kept as its top 32 of 61 bits
  (uint32: 448 bytes per document at 112 permutations).

The fraction of equal signature entries of two documents estimates the Jaccard similarity of their
shingle sets. LSH cuts the signature into `bands` bands of `rows` entries; two documents whose
entries agree on a whole band share that band's key, so pairs of similarity s become candidates
with probability 1 - (1 - s**rows)**bands (0.924 at s = 0.8 for 14 bands of 8).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

MERSENNE_PRIME = (1 << 61) - 1
EMPTY = np.uint32(0xFFFFFFFF)
"""The signature entry of a document without shingles."""

_PRIME = np.uint64(MERSENNE_PRIME)
_WORD_MIX = np.uint64(0x9E3779B97F4A7C15)
_FMIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
_BLOCK_SHINGLES = 2048
"""Shingles permuted at once: a [2048, num_perm] uint64 block (1.8 MiB at 112) stays in cache."""
_PUNCTUATION = r"[\p{P}\p{S}]+"


def normalized_words(texts: pa.Array | pa.ChunkedArray) -> pa.ListArray:
    """Each text's words after normalization (lowercase, punctuation and symbols to spaces, split on
    whitespace): [n_docs] lists of strings; a null text has no words."""
    texts = texts.combine_chunks() if isinstance(texts, pa.ChunkedArray) else texts
    spaced = pc.replace_substring_regex(pc.utf8_lower(texts), _PUNCTUATION, " ")
    return pc.utf8_split_whitespace(spaced)


def shingle_hashes(words: pa.ListArray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of every document's word n-grams, in order: flat uint64 [n_shingles], and the index
    of each document's first shingle, int64 [n_docs + 1] (document d owns
    shingles[offsets[d]:offsets[d + 1]], empty when it has no words)."""
    flat = pc.list_flatten(words)
    nonempty = pc.greater(pc.binary_length(flat), 0)  # the split leaves "" at the ends
    parents = pc.list_parent_indices(words).to_numpy()[nonempty.to_numpy(zero_copy_only=False)]
    flat = flat.filter(nonempty)
    lengths = np.bincount(parents, minlength=len(words)).astype(np.int64)
    word_offsets = np.concatenate([[0], np.cumsum(lengths)])
    counts = np.where(lengths >= ngram, lengths - ngram + 1, np.minimum(lengths, 1))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    if len(flat) == 0:
        return np.zeros(0, dtype=np.uint64), offsets
    encoded = flat.dictionary_encode()
    vocabulary = encoded.dictionary.cast(pa.binary()).to_pylist()
    word_hashes = np.fromiter(
        (xxhash.xxh3_64_intdigest(word) for word in vocabulary),
        dtype=np.uint64,
        count=len(vocabulary),
    )[encoded.indices.to_numpy()]
    hashes = np.empty(offsets[-1], dtype=np.uint64)
    full = np.repeat(lengths >= ngram, counts)  # which shingles are whole n-grams
    hashes[full] = _ngram_windows(word_hashes, word_offsets, lengths, ngram)
    hashes[~full] = _whole_texts(word_hashes, word_offsets, lengths, ngram)
    return _fmix64(hashes), offsets


def _ngram_windows(
    word_hashes: np.ndarray, word_offsets: np.ndarray, lengths: np.ndarray, ngram: int
) -> np.ndarray:
    """The polynomial hash of every n-word window inside a document, in order: windows over the
    flat word array by slices, then those that cross a document's end dropped."""
    count = len(word_hashes) - ngram + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    windows = word_hashes[:count].copy()
    for k in range(1, ngram):
        windows *= _WORD_MIX
        windows += word_hashes[k : k + count]
    ends = np.repeat(word_offsets[1:], lengths)[:count]  # the end of each window start's document
    return windows[np.arange(count) + ngram <= ends]


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


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The (a, b) of each permutation, uint64 [num_perm] each: 1 <= a < p, 0 <= b < p."""
    generator = np.random.default_rng(seed)
    a = generator.integers(1, MERSENNE_PRIME, size=num_perm, dtype=np.uint64)
    b = generator.integers(0, MERSENNE_PRIME, size=num_perm, dtype=np.uint64)
    return a, b


def signatures(
    texts: pa.Array | pa.ChunkedArray, num_perm: int, ngram: int, seed: int
) -> np.ndarray:
    """MinHash signatures of a batch of texts: uint32 [n_docs, num_perm]; rows of documents
    without words are all EMPTY."""
    shingles, offsets = shingle_hashes(normalized_words(texts), ngram)
    return minhash(shingles, offsets, *permutations(num_perm, seed))


def minhash(shingles: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per document, the minimum over its shingles of each permutation: uint32 [n_docs, num_perm].

    Works through the flat shingle array in blocks of _BLOCK_SHINGLES, whatever the documents'
    lengths: a block's minimum per document segment is merged into that document's row."""
    n_docs, num_perm = len(offsets) - 1, len(a)
    best = np.full((n_docs, num_perm), MERSENNE_PRIME, dtype=np.uint64)
    block = np.empty((_BLOCK_SHINGLES, num_perm), dtype=np.uint64)
    folded = np.empty_like(block)
    starts = offsets[:-1][np.diff(offsets) > 0]
    for low in range(0, len(shingles), _BLOCK_SHINGLES):
        high = min(low + _BLOCK_SHINGLES, len(shingles))
        values, carry = block[: high - low], folded[: high - low]
        np.multiply(shingles[low:high, None], a, out=values)
        values += b
        np.right_shift(values, np.uint64(61), out=carry)  # x mod p = (x & p) + (x >> 61) ...
        values &= _PRIME
        values += carry
        np.subtract(values, _PRIME, out=values, where=values >= _PRIME)  # ... minus p if >= p
        inner = starts[(starts > low) & (starts < high)]
        segments = np.concatenate([[low], inner]) - low
        docs = np.searchsorted(offsets, segments + low, side="right") - 1
        mins = np.minimum.reduceat(values, segments, axis=0)
        best[docs] = np.minimum(best[docs], mins)
    result = (best >> np.uint64(29)).astype(np.uint32)
    result[np.diff(offsets) == 0] = EMPTY
    return result


def band_keys(signature: np.ndarray, bands: int, rows: int, seed: int) -> np.ndarray:
    """One int64 key per (document, band): [n_docs, bands]. Documents share a band's key when
    their `rows` entries of that band are equal (other equal keys are 2**-64 accidents, which
    verification removes). Bands use different multipliers, so keys of different bands differ."""
    multipliers = np.random.default_rng([seed, 0xBA4D]).integers(
        1, 2**63, size=(bands, rows), dtype=np.uint64
    ) | np.uint64(1)
    values = signature[:, : bands * rows].reshape(len(signature), bands, rows).astype(np.uint64)
    return _fmix64((values * multipliers).sum(axis=2, dtype=np.uint64)).view(np.int64)


def estimated_jaccard(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """The fraction of equal entries of signatures [..., num_perm] (broadcast): float64 [...]."""
    return np.mean(left == right, axis=-1)


def _fmix64(values: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer: every input bit affects every output bit."""
    values = values ^ (values >> np.uint64(33))
    values = values * _FMIX_1
    values = values ^ (values >> np.uint64(33))
    values = values * _FMIX_2
    return values ^ (values >> np.uint64(33))
