"""Immutable Parquet segments: rows clustered by the namespace's key, zstd, fixed row groups.

Rows are kept in arrival order across spans of 262,144 rows and grouped by a key column (a job id)
then time inside each span: one key's rows of a span land in one or two row groups (16,384 rows by
default), which lets postings skip the rest. Time ranges skip whole spans, not single row groups:
every row group of a span covers the span's stretch of time. Inside each row group rows are then
ordered by the namespace's lowest-cardinality column (a log level), keeping the key and time
order within each of its values, and data pages are small (64 KiB): a filter on that column
(`level = 'ERROR'`) then selects one run of rows per row group, and DuckDB's scan skips the other
pages of every column instead of decompressing whole row groups. Columns are encoded as
keel/telemetry/encoding.py chooses (dictionaries only where values repeat). A segment is written
under a temporary name, fsynced and renamed; it becomes visible only when the manifest names it.
Its checksum (xxh3-64 of the file) ties it to its sidecar index."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from keel.core import paths
from keel.telemetry import times
from keel.telemetry.encoding import choose_encodings
from keel.telemetry.manifest import SegmentEntry
from keel.telemetry.schema import NamespaceOptions
from keel.telemetry.sidecar import SegmentIndex, build_index, is_key_type, save_index

COMPRESSION = "zstd"
CLUSTER_SPAN_ROWS = 262_144  # keys are grouped within spans of this many arrivals
DATA_PAGE_BYTES = 64 * 1024  # Parquet data page size (pyarrow's default: 1 MiB)
GROUP_ORDER_MAX_VALUES = 256  # a row-group order column has 2..this many distinct values
GROUP_ORDER_SAMPLE_ROWS = 16_384  # columns with more distinct values in this many rows: skipped


def segment_path(directory: Path, name: str) -> Path:
    return directory / f"{name}.parquet"


def index_path(directory: Path, name: str) -> Path:
    return directory / f"{name}.idx"


def cluster_column(table: pa.Table, options: NamespaceOptions) -> str | None:
    """The column to cluster by when the options leave it open: the declared or most selective
    key-typed string column with many values (a job or run id), else None."""
    if options.cluster_by is not None:
        return options.cluster_by[0] if options.cluster_by else None
    candidates = options.key_columns
    if candidates is None:
        candidates = [f.name for f in table.schema if pa.types.is_string(f.type)]
    best, best_distinct = None, 0
    for name in candidates:
        distinct = pc.count_distinct(table.column(name)).as_py()
        if 16 < distinct <= max(16, table.num_rows // 8) and distinct > best_distinct:
            best, best_distinct = name, distinct
    return best


def cluster_order(table: pa.Table, keys: list[str], span_rows: int) -> np.ndarray:
    """Row order that keeps arrival order across spans of `span_rows` rows and, inside each
    span, groups equal values of keys[0], then keys[1]... (int64 [rows]).

    The spans keep each row group's time range to a span's (rows arrive in time order), the
    grouping puts one key's rows of a span into one or two row groups.

    Strings are grouped by their dictionary codes (order of first appearance), not sorted
    alphabetically: clustering needs equal keys together, and integer sorts are several times
    faster than string sorts on a million rows."""
    columns = []
    for key in reversed(keys):
        column = table.column(key).combine_chunks()
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            column = pc.dictionary_encode(column).indices
        elif pa.types.is_timestamp(column.type):
            column = column.cast(pa.int64())
        columns.append(column.fill_null(-1).to_numpy(zero_copy_only=False))
    columns.append(np.arange(table.num_rows) // max(1, span_rows))
    return np.lexsort(columns)


def group_order_column(
    table: pa.Table, options: NamespaceOptions, exclude: list[str]
) -> str | None:
    """The column rows are ordered by inside each row group: among the declared count columns
    (or else the string, integer and boolean columns) other than `exclude`, the one with the
    fewest distinct values, null counted as one (2..GROUP_ORDER_MAX_VALUES); None if none has."""
    candidates = options.count_columns
    if candidates is None:
        candidates = [f.name for f in table.schema if is_key_type(f.type)]
    sample = table.slice(0, GROUP_ORDER_SAMPLE_ROWS)
    best, best_distinct = None, GROUP_ORDER_MAX_VALUES + 1
    for name in candidates:
        if name in exclude or not is_key_type(table.schema.field(name).type):
            continue
        if pc.count_distinct(sample.column(name), mode="all").as_py() >= best_distinct:
            continue  # cheap check first: a message column is never counted whole
        distinct = pc.count_distinct(table.column(name), mode="all").as_py()
        if 2 <= distinct < best_distinct:
            best, best_distinct = name, distinct
    return best


def row_group_order(codes: np.ndarray, row_group_rows: int) -> np.ndarray:
    """Row order that keeps every row in its row group (consecutive runs of `row_group_rows`
    rows) and, inside each, groups rows by `codes` (int64 [rows], e.g. a level's dictionary
    codes), keeping their previous order within each code (int64 [rows])."""
    positions = np.arange(len(codes))
    return np.lexsort([positions, codes, positions // max(1, row_group_rows)])


def category_codes(column: pa.ChunkedArray) -> np.ndarray:
    """Equal values of `column` as equal integers (order of first appearance; null: -1)."""
    indices = pc.dictionary_encode(column.combine_chunks()).indices
    return indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)


def write_segment(
    directory: Path,
    table: pa.Table,
    options: NamespaceOptions,
    row_group_rows: int,
    *,
    name: str,
    sort: bool = True,
) -> tuple[SegmentEntry, SegmentIndex]:
    """Write and index `table` as segment `name` (sorted by cluster key and time first, unless
    `sort` is False); return its manifest entry and index."""
    order = layout_order(table, options, row_group_rows, sort=sort) if table.num_rows > 1 else None
    if order is not None:
        table = table.take(order)
    final = segment_path(directory, name)
    temporary = directory / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
    encodings = choose_encodings(table, row_group_rows)
    pq.write_table(
        table,
        temporary,
        compression=COMPRESSION,
        row_group_size=row_group_rows,
        data_page_size=DATA_PAGE_BYTES,
        write_statistics=True,
        use_dictionary=encodings.dictionary,
        column_encoding=encodings.column_encoding or None,
    )
    with open(temporary, "rb+") as handle:
        checksum = f"{xxhash.xxh3_64_intdigest(handle.read()):016x}"
        os.fsync(handle.fileno())
    group_rows = [
        pq.ParquetFile(temporary).metadata.row_group(i).num_rows
        for i in range(pq.ParquetFile(temporary).metadata.num_row_groups)
    ]
    index = build_index(table, group_rows, options, checksum)
    save_index(index_path(directory, name), index)
    os.replace(temporary, final)
    paths.fsync_directory(directory)
    entry = SegmentEntry(
        name=name,
        rows=table.num_rows,
        bytes=final.stat().st_size,
        checksum=checksum,
        row_groups=len(group_rows),
        min_time=_time_or_none(index.time_min, index.time_unit, min),
        max_time=_time_or_none(index.time_max, index.time_unit, max),
    )
    return entry, index


def layout_order(
    table: pa.Table, options: NamespaceOptions, row_group_rows: int, *, sort: bool
) -> np.ndarray | None:
    """The order a segment's rows are written in (int64 [rows]; None: as they are): clustered
    by key and time within spans (unless `sort` is False: rows already clustered, as in merged
    segments), then grouped by the row-group order column inside each row group."""
    keys = [options.time_column] if options.time_column else []
    order = None
    if sort:
        cluster = cluster_column(table, options)
        if cluster is not None:
            keys = [cluster, *(k for k in keys if k != cluster)]
        if keys:
            order = cluster_order(table, keys, CLUSTER_SPAN_ROWS)
    column = group_order_column(table, options, exclude=keys)
    if column is None:
        return order
    codes = category_codes(table.column(column))
    if order is None:
        return row_group_order(codes, row_group_rows)
    return order[row_group_order(codes[order], row_group_rows)]


def rebuild_index(
    directory: Path, entry: SegmentEntry, options: NamespaceOptions, schema: pa.Schema
) -> SegmentIndex:
    """Index an existing segment again (its sidecar was missing or did not match)."""
    path = segment_path(directory, entry.name)
    parquet = pq.ParquetFile(path)
    group_rows = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
    table = parquet.read().cast(schema)  # Parquet keeps timestamp[s] as [ms]: back to the schema
    index = build_index(table, group_rows, options, entry.checksum)
    save_index(index_path(directory, entry.name), index)
    return index


def new_segment_name(first_generation: int, last_generation: int) -> str:
    return f"{first_generation:012d}-{last_generation:012d}-{uuid.uuid4().hex[:8]}"


def _time_or_none(values: np.ndarray | None, unit: str | None, pick) -> int | None:
    """The segment's earliest or latest time in epoch nanoseconds (clamped to int64)."""
    if values is None or unit is None:
        return None
    present = [int(v) for v in values if v not in (2**63 - 1, -(2**63))]
    return times.to_nanoseconds(pick(present), unit) if present else None
