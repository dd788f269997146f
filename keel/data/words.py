"""The words of a batch of texts and their 64-bit hashes, found in one pass over the UTF-8 bytes.

A word is a maximal run of characters that are neither Unicode punctuation or symbols
(`\\p{P}`, `\\p{S}`) nor white space, after lowercasing: exactly the words pyarrow gives for
`utf8_split_whitespace(replace_substring_regex(utf8_lower(text), "[\\p{P}\\p{S}]+", " "))`
(keel's normalization, done that way until Dec 2026), which tests/data/test_words.py checks for
every code point and on real text.

Why by hand: that normalization in pyarrow is a regex replace and a white-space split that build
the words as strings, then a dictionary of the distinct words to hash each once: on 15,000
WikiText documents (23 MB) those steps took ~0.67 s of a fuzzy-dedup worker's time against
~0.26 s here (2-core VM, Dec 2026). Here the lowercased bytes are classified with a table (one
entry per byte for ASCII; for the other characters, decoded from their UTF-8 bytes, one entry per
code point of the Basic Multilingual Plane and a lookup of the few others), and the table comes
from pyarrow's own regex and white-space test, so both agree by construction.

A word's hash reads its bytes eight at a time (little-endian, zero-padded at the end), from
h = its length * K: h = fmix64(h * K ^ chunk) per chunk, murmur3's 64-bit finalizer, so words
of up to eight bytes hash without collisions and longer ones collide with odds ~2**-64; a word
of more than 64 bytes (a base64 blob) is hashed with xxh3-64 instead, one by one. The hashes
are for one run's shingles and signatures: nothing stores them across versions.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

_SEPARATOR_PATTERN = r"[\p{P}\p{S}]"
_K = np.uint64(0x9E3779B97F4A7C15)
_FMIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
_SHIFT = np.uint64(33)
_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [2**64 - 1], dtype=np.uint64)
"""_MASKS[k]: the low k bytes of a 64-bit word (k = 8: all of it)."""
_BMP = 0x10000
LONG_WORD = 64
"""Bytes above which a word is hashed by xxh3 alone (see _hash_words)."""


def fmix64(values: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer: every input bit affects every output bit (a new array)."""
    values = values ^ (values >> _SHIFT)
    values *= _FMIX_1
    values ^= values >> _SHIFT
    values *= _FMIX_2
    values ^= values >> _SHIFT
    return values


def word_hashes(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The hash of every word of every text, in order: flat uint64 [n_words], and the index of
    each text's first word, int64 [n_texts + 1] (text d owns hashes[offsets[d]:offsets[d + 1]];
    a null or empty text has none)."""
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
        texts = texts.cast(pa.large_string())
    lower = pc.utf8_lower(texts)
    if lower.null_count:  # a null's bytes are not part of the text (Arrow allows any there)
        lower = lower.fill_null("")
    offsets, data = _bytes_of(lower)
    padded = np.concatenate([data, np.zeros(8, dtype=np.uint8)])  # reads past a word's end
    separator = _separators(data, padded)
    word = ~separator
    begins = word.copy()
    begins[1:] &= separator[:-1]
    ends = word.copy()
    ends[:-1] &= separator[1:]
    filled = offsets[1:] > offsets[:-1]  # a word never runs from one text into the next
    firsts, lasts = offsets[:-1][filled], offsets[1:][filled] - 1
    begins[firsts] = word[firsts]
    ends[lasts] = word[lasts]
    starts = np.flatnonzero(begins)
    lengths = np.flatnonzero(ends) + 1 - starts
    return _hash_words(padded, starts, lengths), np.searchsorted(starts, offsets).astype(np.int64)


def _bytes_of(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A string array's offsets (int64 [n + 1], from 0) and UTF-8 bytes (uint8)."""
    width = np.int64 if pa.types.is_large_string(texts.type) else np.int32
    _, offsets_buffer, data_buffer = texts.buffers()
    offsets = np.frombuffer(
        offsets_buffer, width, len(texts) + 1, texts.offset * np.dtype(width).itemsize
    ).astype(np.int64)
    start, end = int(offsets[0]), int(offsets[-1])
    if end == start:
        return offsets - start, np.zeros(0, dtype=np.uint8)
    return offsets - start, np.frombuffer(data_buffer, np.uint8, end - start, start)


def _separators(data: np.ndarray, padded: np.ndarray) -> np.ndarray:
    """Which bytes belong to a separator character (punctuation, symbol or white space): bool
    [len(data)] (`padded`: the bytes and 8 zeros after them)."""
    separator = np.take(_ascii_table(), data)
    leads = np.flatnonzero(data >= 0xC0)  # the first byte of each character beyond ASCII
    if not len(leads):
        return separator
    code_points, widths = _decode(padded, leads)
    is_separator = np.empty(len(leads), dtype=bool)
    basic = code_points < _BMP
    is_separator[basic] = _bmp_table()[code_points[basic]]
    if not basic.all():  # beyond the BMP (emoji, rare scripts): a lookup of the distinct ones
        distinct, inverse = np.unique(code_points[~basic], return_inverse=True)
        is_separator[~basic] = _classify(distinct)[inverse]
    hits, hit_widths = leads[is_separator], widths[is_separator]
    for k in range(4):
        separator[hits[hit_widths > k] + k] = True
    return separator


def _decode(padded: np.ndarray, leads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The code point (uint32) and byte width of the character at each of `leads` (valid UTF-8:
    pyarrow's utf8_lower has checked it; `padded`: the bytes and at least 3 zeros after them)."""
    first = padded[leads].astype(np.uint32)
    widths = np.where(first >= 0xF0, 4, np.where(first >= 0xE0, 3, 2))
    code_points = first & np.where(widths == 2, 0x1F, np.where(widths == 3, 0x0F, 0x07))
    for k in range(1, 4):
        more = widths > k
        code_points = np.where(
            more, (code_points << 6) | (padded[leads + k].astype(np.uint32) & 0x3F), code_points
        )
    return code_points.astype(np.uint32), widths


def _hash_words(padded: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each word's hash (see the module docstring): uint64 [len(starts)] (`padded`: the bytes
    and 8 zeros after them). Words longer than LONG_WORD bytes (a base64 blob, minified code)
    are hashed with xxh3 one by one, so the chunk loop runs at most LONG_WORD / 8 times."""
    if not len(starts):
        return np.zeros(0, dtype=np.uint64)
    # every 8-byte window of the bytes, by its first byte (an unaligned view: no copy)
    windows = np.ndarray((len(padded) - 7,), np.uint64, padded.data, 0, (1,))
    # the first 8 bytes of every word at once (most words have no more): h = length * K, then
    # fmix64(h * K ^ chunk); a long word's hash is replaced below
    hashes = lengths.astype(np.uint64) * _K
    hashes *= _K
    hashes ^= windows[starts] & _MASKS[np.minimum(lengths, 8)]
    hashes = fmix64(hashes)
    long = np.flatnonzero(lengths > LONG_WORD)
    words = np.flatnonzero((lengths > 8) & (lengths <= LONG_WORD))
    chunk = 1
    while len(words):
        left = lengths[words] - 8 * chunk
        values = windows[starts[words] + 8 * chunk] & _MASKS[np.minimum(left, 8)]
        hashes[words] = fmix64(hashes[words] * _K ^ values)
        words = words[left > 8]
        chunk += 1
    for word in long.tolist():
        start = int(starts[word])
        hashes[word] = xxhash.xxh3_64_intdigest(padded[start : start + lengths[word]].tobytes())
    return hashes


@functools.cache
def _ascii_table() -> np.ndarray:
    """bool [256]: the ASCII bytes that are separators (bytes >= 0x80 are decoded instead)."""
    table = np.zeros(256, dtype=bool)
    table[:128] = _classify(np.arange(128, dtype=np.uint32))
    return table


@functools.cache
def _bmp_table() -> np.ndarray:
    """bool [65536]: the code points of the Basic Multilingual Plane that are separators."""
    code_points = np.arange(_BMP, dtype=np.uint32)
    code_points[0xD800:0xE000] = ord("a")  # surrogates are not characters
    return _classify(code_points)


def _classify(code_points: np.ndarray) -> np.ndarray:
    """Whether each code point is punctuation, a symbol or white space, asked of pyarrow (the
    regex engine and the white-space test of that normalization): bool [len(code_points)]."""
    characters = _utf8_strings(code_points)
    punctuation = pc.match_substring_regex(characters, _SEPARATOR_PATTERN)
    return pc.or_(punctuation, pc.utf8_is_space(characters)).to_numpy(zero_copy_only=False)


def _utf8_strings(code_points: np.ndarray) -> pa.StringArray:
    """One string per code point (no surrogates), its UTF-8 encoding."""
    points = code_points.astype(np.uint32)
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= _BMP)
    offsets = np.zeros(len(points) + 1, dtype=np.int32)
    np.cumsum(widths, out=offsets[1:])
    data = np.zeros(int(offsets[-1]), dtype=np.uint8)
    first_bits = np.array([0, 0, 0xC0, 0xE0, 0xF0], dtype=np.uint32)[widths]
    for k in range(4):
        inside = widths > k
        shift = 6 * (widths[inside] - 1 - k)
        bits = (points[inside] >> shift.astype(np.uint32)) & np.where(k == 0, 0xFF, 0x3F)
        data[offsets[:-1][inside] + k] = (bits | np.where(k == 0, first_bits[inside], 0x80)).astype(
            np.uint8
        )
    return pa.StringArray.from_buffers(len(points), pa.py_buffer(offsets), pa.py_buffer(data))
