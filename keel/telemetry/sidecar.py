"""A segment's sidecar index (`<segment>.idx`) and the predicates it answers.

Per row group it holds: min/max of the time column, trigram Bloom filters for string columns (LIKE,
and equality on long strings), exact postings for key columns (value -> row groups), and value
counts for low-cardinality columns (which also answer COUNT / GROUP BY without a scan). Which
columns get what is declared in the namespace's options or, left open, chosen per segment from the
data. The file carries the checksum of the segment it indexes and a checksum of itself: a missing,
torn or mismatched index loads as None, and the segment is then scanned whole (never pruned) until
the index is rebuilt.

Layout: b"KIDX1", header length (u64), JSON header, filter bytes, xxh3-64 of everything before.
"""

from __future__ import annotations

import itertools
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from keel.core import paths
from keel.telemetry import trigram
from keel.telemetry.schema import NamespaceOptions

MAGIC = b"KIDX1"
_LENGTH = struct.Struct("<Q")
_DIGEST = struct.Struct("<Q")
COUNT_MAX_VALUES = 256  # a column with at most this many distinct values gets value counts
POSTINGS_MAX_VALUES = 65_536
POSTINGS_MAX_MEAN_BYTES = 32  # ids get postings; long text (messages) gets Bloom filters
BLOOM_MIN_MEAN_BYTES = 12
KEY_MAX_VALUE_BYTES = 1_024  # longer values get no postings and no value counts
BLOOM_MAX_VALUE_BYTES = 64 << 10  # longer values add no trigrams to a Bloom filter


@dataclass(frozen=True)
class Equals:
    """column = v or column IN (v, ...); values are of the column's Python type."""

    column: str
    values: tuple[Any, ...]


@dataclass(frozen=True)
class Like:
    column: str
    pattern: str


@dataclass(frozen=True)
class TimeRange:
    """low <(=) column <(=) high, in epoch counts of `unit` (the column's); None = unbounded."""

    column: str
    unit: str
    low: int | None = None
    high: int | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True


Predicate = Equals | Like | TimeRange


@dataclass
class SegmentIndex:
    checksum: str
    row_group_rows: np.ndarray  # int64 [row groups]
    time_column: str | None = None
    time_unit: str | None = None  # the time column's own unit: bounds never overflow
    time_min: np.ndarray | None = None  # int64 [row groups] in time_unit; all-null: max int64
    time_max: np.ndarray | None = None
    blooms: dict[str, tuple[int, np.ndarray]] = field(
        default_factory=dict
    )  # bits, uint8 [rg, bits/8]
    postings: dict[str, dict[Any, np.ndarray]] = field(default_factory=dict)  # value -> rg ids
    counts: dict[str, tuple[list[Any], np.ndarray]] = field(default_factory=dict)  # [values, rg]
    # Row groups holding a value too long for the column's postings or Bloom filters (bool [rg]):
    # always candidates for a lookup there, so the index stays small and never drops a match.
    postings_overlong: dict[str, np.ndarray] = field(default_factory=dict)
    blooms_overlong: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def row_groups(self) -> int:
        return len(self.row_group_rows)

    def candidates(self, predicates: list[Predicate]) -> np.ndarray:
        """Row groups that may hold rows matching every predicate (bool [row groups])."""
        keep = np.ones(self.row_groups, dtype=bool)
        for predicate in predicates:
            keep &= self._may_match(predicate)
        return keep

    def value_counts(self, column: str) -> dict[Any, int] | None:
        """Exact {value: rows} over the segment (None as a value counts nulls), if indexed."""
        if column not in self.counts:
            return None
        values, counts = self.counts[column]
        totals = counts.sum(axis=1)
        return {value: int(total) for value, total in zip(values, totals, strict=True) if total}

    def _may_match(self, predicate: Predicate) -> np.ndarray:
        everything = np.ones(self.row_groups, dtype=bool)
        if isinstance(predicate, TimeRange):
            if (
                predicate.column != self.time_column
                or predicate.unit != self.time_unit
                or self.time_min is None
            ):
                return everything
            keep = everything.copy()
            if predicate.low is not None:
                keep &= (
                    self.time_max >= predicate.low
                    if predicate.low_inclusive
                    else self.time_max > predicate.low
                )
            if predicate.high is not None:
                keep &= (
                    self.time_min <= predicate.high
                    if predicate.high_inclusive
                    else self.time_min < predicate.high
                )
            return keep
        if isinstance(predicate, Like):
            if predicate.column not in self.blooms:
                return everything
            bits, filters = self.blooms[predicate.column]
            keep = trigram.may_contain(filters, bits, trigram.pattern_trigrams(predicate.pattern))
            return keep | self._overlong(self.blooms_overlong, predicate.column)
        if predicate.column in self.counts:
            values, counts = self.counts[predicate.column]
            rows = [values.index(v) for v in predicate.values if v is not None and v in values]
            return counts[rows].sum(axis=0) > 0 if rows else ~everything
        if predicate.column in self.postings:
            keep = self._overlong(self.postings_overlong, predicate.column).copy()
            for value in predicate.values:
                groups = self.postings[predicate.column].get(value)
                if groups is not None:
                    keep[groups] = True
            return keep
        if predicate.column in self.blooms and all(isinstance(v, str) for v in predicate.values):
            bits, filters = self.blooms[predicate.column]
            keep = self._overlong(self.blooms_overlong, predicate.column).copy()
            for value in predicate.values:
                needle = trigram.trigrams(np.frombuffer(value.encode("utf-8"), dtype=np.uint8))
                keep |= trigram.may_contain(filters, bits, np.unique(needle))
            return keep
        return everything

    def _overlong(self, masks: dict[str, np.ndarray], column: str) -> np.ndarray:
        mask = masks.get(column)
        return mask if mask is not None else np.zeros(self.row_groups, dtype=bool)


def build_index(
    table: pa.Table, row_group_rows: list[int], options: NamespaceOptions, checksum: str
) -> SegmentIndex:
    """Index `table` (the segment's rows, in file order) cut into row groups of these sizes."""
    sizes = np.asarray(row_group_rows, dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    group_of_row = np.repeat(np.arange(len(sizes)), sizes)
    index = SegmentIndex(checksum=checksum, row_group_rows=sizes, time_column=options.time_column)
    if options.time_column is not None:
        column = table.column(options.time_column)
        index.time_unit = column.type.unit
        index.time_min, index.time_max = _time_bounds(column, bounds)
    indexable = [f.name for f in table.schema if is_key_type(f.type)]
    longest = {name: _longest_value(table.column(name)) for name in table.schema.names}
    distinct = {
        name: pc.count_distinct(table.column(name), mode="all").as_py() for name in indexable
    }
    count_columns = options.count_columns
    if count_columns is None:
        count_columns = [n for n in indexable if distinct[n] <= COUNT_MAX_VALUES]
    # Value counts must hold every value exactly (they answer GROUP BY): none with a long one.
    count_columns = [n for n in count_columns if longest[n] <= KEY_MAX_VALUE_BYTES]
    key_columns = options.key_columns
    if key_columns is None:
        limit = min(POSTINGS_MAX_VALUES, max(1, table.num_rows // 4))
        key_columns = [
            n
            for n in indexable
            if n not in count_columns
            and distinct[n] <= limit
            and _mean_bytes(table.column(n)) <= POSTINGS_MAX_MEAN_BYTES
        ]
    bloom_columns = options.bloom_columns
    if bloom_columns is None:
        bloom_columns = [
            f.name
            for f in table.schema
            if pa.types.is_string(f.type)
            and f.name not in count_columns
            and f.name not in key_columns
            and _mean_bytes(table.column(f.name)) >= BLOOM_MIN_MEAN_BYTES
        ]
    for name in count_columns:
        index.counts[name] = _value_counts(table.column(name), group_of_row, len(sizes))
    for name in key_columns:
        column, overlong = _without_long(table.column(name), KEY_MAX_VALUE_BYTES, bounds)
        index.postings[name] = _postings(column, group_of_row, len(sizes))
        if overlong is not None:
            index.postings_overlong[name] = overlong
    for name in bloom_columns:
        column, overlong = _without_long(table.column(name), BLOOM_MAX_VALUE_BYTES, bounds)
        index.blooms[name] = _blooms(column, bounds)
        if overlong is not None:
            index.blooms_overlong[name] = overlong
    return index


def save_index(path: Path, index: SegmentIndex) -> None:
    """Write the sidecar (temporary file, fsync, rename)."""
    blob = bytearray()
    blooms = {}
    for name, (bits, filters) in index.blooms.items():
        blooms[name] = {"bits": bits, "offset": len(blob), "length": filters.nbytes}
        blob += filters.tobytes()
    header = {
        "checksum": index.checksum,
        "row_group_rows": index.row_group_rows.tolist(),
        "time": None
        if index.time_min is None
        else {
            "column": index.time_column,
            "unit": index.time_unit,
            "min": index.time_min.tolist(),
            "max": index.time_max.tolist(),
        },
        "blooms": blooms,
        "postings": {
            name: [[value, groups.tolist()] for value, groups in postings.items()]
            for name, postings in index.postings.items()
        },
        "counts": {
            name: {"values": values, "counts": counts.tolist()}
            for name, (values, counts) in index.counts.items()
        },
        "overlong": {
            "postings": {n: np.flatnonzero(m).tolist() for n, m in index.postings_overlong.items()},
            "blooms": {n: np.flatnonzero(m).tolist() for n, m in index.blooms_overlong.items()},
        },
    }
    header_bytes = orjson.dumps(header)
    body = MAGIC + _LENGTH.pack(len(header_bytes)) + header_bytes + bytes(blob)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(body + _DIGEST.pack(xxhash.xxh3_64_intdigest(body)))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    paths.fsync_directory(path.parent)


def load_index(path: Path, checksum: str) -> SegmentIndex | None:
    """The sidecar at `path` if it is whole and indexes the segment with `checksum`, else None."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start + _DIGEST.size or not data.startswith(MAGIC):
        return None
    body = memoryview(data)[: -_DIGEST.size]
    if _DIGEST.unpack_from(data, len(data) - _DIGEST.size)[0] != xxhash.xxh3_64_intdigest(body):
        return None
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    header = orjson.loads(data[start : start + length])
    if header["checksum"] != checksum:
        return None
    if "overlong" not in header:
        return None  # from before time bounds kept their column's unit (ns overflowed): rebuild
    blob = np.frombuffer(
        data, dtype=np.uint8, offset=start + length, count=len(body) - start - length
    )
    sizes = np.asarray(header["row_group_rows"], dtype=np.int64)
    index = SegmentIndex(checksum=checksum, row_group_rows=sizes)
    if header["time"] is not None:
        index.time_column = header["time"]["column"]
        index.time_unit = header["time"]["unit"]
        index.time_min = np.asarray(header["time"]["min"], dtype=np.int64)
        index.time_max = np.asarray(header["time"]["max"], dtype=np.int64)
    for name, spec in header["blooms"].items():
        filters = blob[spec["offset"] : spec["offset"] + spec["length"]]
        index.blooms[name] = (spec["bits"], filters.reshape(len(sizes), spec["bits"] // 8))
    for name, pairs in header["postings"].items():
        index.postings[name] = {
            value: np.asarray(groups, dtype=np.int64) for value, groups in pairs
        }
    for name, spec in header["counts"].items():
        index.counts[name] = (spec["values"], np.asarray(spec["counts"], dtype=np.int64))
    for kind, masks in (
        ("postings", index.postings_overlong),
        ("blooms", index.blooms_overlong),
    ):
        for name, groups in header["overlong"][kind].items():
            masks[name] = np.zeros(len(sizes), dtype=bool)
            masks[name][np.asarray(groups, dtype=np.int64)] = True
    return index


def is_key_type(kind: pa.DataType) -> bool:
    """Strings, integers and booleans: the types with postings and value counts."""
    return pa.types.is_string(kind) or pa.types.is_integer(kind) or pa.types.is_boolean(kind)


def _mean_bytes(column: pa.ChunkedArray) -> float:
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return 0.0
    valid = len(column) - column.null_count
    return trigram.utf8_bytes(column.combine_chunks()).size / valid if valid else 0.0


def _longest_value(column: pa.ChunkedArray) -> int:
    """Bytes of the column's longest string or binary value (0 for other types)."""
    kind = column.type
    if not (pa.types.is_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_string(kind)):
        return 0
    return pc.max(pc.binary_length(column)).as_py() or 0


def _without_long(
    column: pa.ChunkedArray, max_bytes: int, bounds: np.ndarray
) -> tuple[pa.ChunkedArray, np.ndarray | None]:
    """The column with values over `max_bytes` nulled, and which row groups held one (bool
    [row groups]; None when none did)."""
    if _longest_value(column) <= max_bytes:
        return column, None
    long = pc.fill_null(pc.greater(pc.binary_length(column), max_bytes), False)
    rows = np.asarray(long.combine_chunks() if isinstance(long, pa.ChunkedArray) else long)
    overlong = np.logical_or.reduceat(rows, bounds[:-1]) if rows.size else rows
    return pc.if_else(long, pa.scalar(None, column.type), column), overlong.astype(bool)


def _time_bounds(column: pa.ChunkedArray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row group [min, max] of a time column, in its own unit (int64 [row groups] each)."""
    values = column.combine_chunks().cast(pa.int64())
    numbers = values.to_numpy(zero_copy_only=False)
    valid = ~np.asarray(values.is_null())
    low = np.full(len(bounds) - 1, np.iinfo(np.int64).max, dtype=np.int64)
    high = np.full(len(bounds) - 1, np.iinfo(np.int64).min, dtype=np.int64)
    for group, (start, stop) in enumerate(itertools.pairwise(bounds)):
        present = numbers[start:stop][valid[start:stop]]
        if present.size:
            low[group] = present.min()
            high[group] = present.max()
    return low, high


def _encode(column: pa.ChunkedArray, null_encoding: str) -> tuple[list[Any], np.ndarray]:
    encoded = pc.dictionary_encode(column.combine_chunks(), null_encoding=null_encoding)
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    return encoded.dictionary.to_pylist(), codes


def _value_counts(
    column: pa.ChunkedArray, group_of_row: np.ndarray, groups: int
) -> tuple[list[Any], np.ndarray]:
    values, codes = _encode(column, "encode")
    counts = np.zeros((len(values), groups), dtype=np.int64)
    np.add.at(counts, (codes.astype(np.int64), group_of_row), 1)
    return values, counts


def _postings(
    column: pa.ChunkedArray, group_of_row: np.ndarray, groups: int
) -> dict[Any, np.ndarray]:
    encoded = pc.dictionary_encode(column.combine_chunks(), null_encoding="mask")
    values = encoded.dictionary.to_pylist()
    codes = encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    valid = codes >= 0
    pairs = np.unique(codes[valid] * groups + group_of_row[valid])
    value_ids, group_ids = np.divmod(pairs, groups)
    splits = np.flatnonzero(np.diff(value_ids)) + 1
    return {
        values[ids[0]]: members
        for ids, members in zip(
            np.split(value_ids, splits), np.split(group_ids, splits), strict=True
        )
        if ids.size
    }


def _blooms(column: pa.ChunkedArray, bounds: np.ndarray) -> tuple[int, np.ndarray]:
    values = column.combine_chunks()
    scratch = np.zeros(1 << 24, dtype=bool)
    distinct = [
        trigram.distinct_trigrams(values.slice(start, stop - start), scratch)
        for start, stop in itertools.pairwise(bounds)
    ]
    bits = trigram.filter_bits([d.size for d in distinct])
    return bits, np.stack([trigram.build_filter(d, bits) for d in distinct])
