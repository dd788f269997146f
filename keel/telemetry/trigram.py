"""Trigram Bloom filters: one per row group and string column, to skip row groups for LIKE '%x%'.

A row group can hold a value containing "needle" only if every trigram of "needle" ("nee", "eed",
"edl", "dle") occurs somewhere in its values; the filter answers "maybe" or "certainly not".
Trigrams are taken over the column's concatenated UTF-8 bytes (vectorized with numpy; the few
trigrams that straddle two values only add false positives, never false negatives). A trigram is a
24-bit number; each sets `HASHES` bits of an m-bit filter (m a power of two, about 10 bits per
distinct trigram of the fullest row group: ~1-2% false positives per trigram, so a needle with
several trigrams passes a filter by chance far less often than that).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

HASHES = 3
_MULTIPLIERS = np.array([0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D], dtype=np.uint32)[:HASHES]
_BITS_PER_TRIGRAM = 10
_MIN_BITS = 1 << 10


def utf8_bytes(values: pa.Array) -> np.ndarray:
    """The bytes of a string array's values, concatenated (uint8 [total bytes])."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_large_string(values.type) or pa.types.is_large_binary(values.type):
        offset_type = np.int64
    else:
        offset_type = np.int32
    buffers = values.buffers()
    if len(values) == 0 or buffers[2] is None:
        return np.zeros(0, dtype=np.uint8)
    offsets = np.frombuffer(buffers[1], dtype=offset_type)[
        values.offset : values.offset + len(values) + 1
    ]
    return np.frombuffer(buffers[2], dtype=np.uint8)[offsets[0] : offsets[-1]]


def trigrams(data: np.ndarray) -> np.ndarray:
    """Every trigram of a byte string as a 24-bit number (uint32 [len - 2])."""
    if data.size < 3:
        return np.zeros(0, dtype=np.uint32)
    wide = data.astype(np.uint32)
    return (wide[:-2] << 16) | (wide[1:-1] << 8) | wide[2:]


def distinct_trigrams(values: pa.Array, scratch: np.ndarray) -> np.ndarray:
    """The distinct trigrams of `values` (uint32, sorted). `scratch` is a zeroed bool [2**24]
    array, returned zeroed: marking a bitmap is several times faster than np.unique here."""
    found = trigrams(utf8_bytes(values))
    scratch[found] = True
    present = np.flatnonzero(scratch).astype(np.uint32)
    scratch[present] = False
    return present


def filter_bits(distinct_counts: list[int]) -> int:
    """The filter size in bits for row groups with these distinct-trigram counts."""
    wanted = max(_MIN_BITS, _BITS_PER_TRIGRAM * max(distinct_counts, default=0))
    return 1 << int(np.ceil(np.log2(wanted)))


def positions(trigram_ids: np.ndarray, bits: int) -> np.ndarray:
    """Bit positions of each trigram (int64 [HASHES, n])."""
    shift = np.uint32(32 - int(np.log2(bits)))
    hashed = trigram_ids.astype(np.uint32)[None, :] * _MULTIPLIERS[:, None]
    return (hashed >> shift).astype(np.int64)


def build_filter(distinct: np.ndarray, bits: int) -> np.ndarray:
    """A filter over `distinct` trigrams (uint8 [bits / 8])."""
    filter_bytes = np.zeros(bits // 8, dtype=np.uint8)
    where = positions(distinct, bits).ravel()
    np.bitwise_or.at(filter_bytes, where >> 3, (1 << (where & 7)).astype(np.uint8))
    return filter_bytes


def may_contain(filters: np.ndarray, bits: int, needle_trigrams: np.ndarray) -> np.ndarray:
    """May each row group hold every trigram? filters: uint8 [row groups, bits / 8] -> bool [rg]."""
    if needle_trigrams.size == 0:
        return np.ones(filters.shape[0], dtype=bool)
    where = positions(needle_trigrams, bits).ravel()
    hits = filters[:, where >> 3] & (1 << (where & 7)).astype(np.uint8)[None, :]
    return np.all(hits != 0, axis=1)


def pattern_trigrams(pattern: str) -> np.ndarray:
    """Trigrams every match of a LIKE pattern must contain: those of its literal runs between the
    wildcards % and _ (DuckDB's LIKE has no escape character unless ESCAPE is given)."""
    found: list[np.ndarray] = []
    run = []
    for char in pattern + "%":
        if char in "%_":
            if run:
                found.append(trigrams(np.frombuffer("".join(run).encode("utf-8"), dtype=np.uint8)))
            run = []
        else:
            run.append(char)
    if not found:
        return np.zeros(0, dtype=np.uint32)
    return np.unique(np.concatenate(found))
