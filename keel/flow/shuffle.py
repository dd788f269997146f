"""Shuffles: rows hash-routed to partitions on the map side, pulled and merged on the reduce side.

Map side (`PartitionWriter`): each chunk gets its stable input order and its key hash as hidden
columns, is split by partition (hash % partitions; round robin by order for repartition), and is
appended to one zstd-compressed Arrow IPC stream per partition in the task's attempt directory.
A chunk whose schema differs from the open stream's starts a new segment file, so a partition may
have several; the reducer unifies them.

Reduce side (`read_partition`, `partition_tables`): the reducer pulls its partition's segments in
map-task order. A partition larger than the memory budget is split first into sub-buckets by
ranges of the key hash (streamed to disk, one chunk in memory at a time), then each sub-bucket is
reduced in memory. Because sub-buckets are hash ranges and every reduction orders rows by
(hash, key, input order), the output is the same whatever the budget, worker count or backend.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keel.core import paths
from keel.flow.keys import HASH_COLUMN, ORDER_COLUMN, column_hashes, key_column, order_values
from keel.flow.ops import Key

IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")

SUB_BUCKETS_PER_BUDGET = 4
"""A reducer holds up to about three copies of the rows it reduces at once (the table, its sorted
copy, and the rows as Python objects for a reducer function), so a sub-bucket is sized at a
quarter of the memory budget."""


@dataclass(frozen=True)
class Segment:
    """One spill file: its path, rows, and uncompressed bytes (Arrow buffers)."""

    path: str
    rows: int
    bytes: int


@dataclass
class _Stream:
    path: str
    handle: IO[bytes]
    writer: pa.ipc.RecordBatchStreamWriter
    schema: pa.Schema
    rows: int = 0
    bytes: int = 0


class SpillStreams:
    """One zstd Arrow IPC stream per bucket under `directory`; a batch with another schema than its
    bucket's open stream starts a new segment file."""

    def __init__(self, directory: str, prefix: str) -> None:
        self.directory = directory
        self.prefix = prefix
        self.segments: dict[int, list[Segment]] = {}
        self._open: dict[int, _Stream] = {}

    def append(self, bucket: int, batch: pa.RecordBatch) -> None:
        stream = self._open.get(bucket)
        if stream is not None and stream.schema != batch.schema:
            self._finish(bucket)
            stream = None
        if stream is None:
            number = len(self.segments.get(bucket, []))
            path = paths.join(self.directory, f"{self.prefix}{bucket:05d}-s{number:03d}.arrow")
            handle = paths.open_file(path, "wb")
            writer = pa.ipc.new_stream(handle, batch.schema, options=IPC_OPTIONS)
            stream = self._open[bucket] = _Stream(path, handle, writer, batch.schema)
        stream.writer.write_batch(batch)
        stream.rows += batch.num_rows
        stream.bytes += batch.nbytes

    def close(self) -> dict[int, list[Segment]]:
        """Finish every open stream; all segments written, by bucket."""
        for bucket in list(self._open):
            self._finish(bucket)
        return self.segments

    def _finish(self, bucket: int) -> None:
        stream = self._open.pop(bucket)
        stream.writer.close()
        stream.handle.close()
        segment = Segment(stream.path, stream.rows, stream.bytes)
        self.segments.setdefault(bucket, []).append(segment)


class PartitionWriter:
    """Routes the chunks of map task `task_index` to `num_partitions` spill streams."""

    def __init__(self, directory: str, num_partitions: int, key: Key | None, task_index: int):
        self.num_partitions = num_partitions
        self.key = key
        self.task_index = task_index
        self.rows_written = 0
        self.streams = SpillStreams(directory, "p")

    def write(self, batch: pa.RecordBatch) -> None:
        order = order_values(self.task_index, self.rows_written, batch.num_rows)
        self.rows_written += batch.num_rows
        if self.key is None:  # repartition: spread rows evenly, deterministically
            partition = (order * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)
        else:
            batch, name = key_column(batch, self.key)
            partition = column_hashes(batch.column(name))
            batch = batch.append_column(HASH_COLUMN, pa.array(partition))
        batch = batch.append_column(ORDER_COLUMN, pa.array(order))
        _split(batch, partition % np.uint64(self.num_partitions), self.num_partitions, self.streams)

    def close(self) -> dict[int, list[Segment]]:
        return self.streams.close()


def _split(batch: pa.RecordBatch, bucket: np.ndarray, buckets: int, streams: SpillStreams) -> None:
    """Append the rows of each bucket (in their order) to that bucket's stream."""
    by_bucket = np.argsort(bucket, kind="stable")
    bounds = np.searchsorted(bucket[by_bucket], np.arange(buckets + 1))
    ordered = batch.take(pa.array(by_bucket))
    for index in np.flatnonzero(np.diff(bounds)):
        start, end = int(bounds[index]), int(bounds[index + 1])
        streams.append(int(index), ordered.slice(start, end - start))


def read_segments(segments: Sequence[Segment]) -> Iterator[pa.RecordBatch]:
    """The batches of `segments`, in order, one at a time."""
    for segment in segments:
        with paths.open_file(segment.path, "rb") as handle:
            yield from pa.ipc.open_stream(handle)


def partition_tables(
    segments: Sequence[Segment], budget_bytes: int, spill_directory: str
) -> Iterator[pa.Table]:
    """The partition as tables that each fit `budget_bytes`: the whole partition when it fits,
    else one table per hash-range sub-bucket of about a quarter of the budget, streamed to
    `spill_directory` first."""
    total = sum(segment.bytes for segment in segments)
    if total <= budget_bytes:
        yield concat_batches(list(read_segments(segments)))
        return
    buckets = math.ceil(SUB_BUCKETS_PER_BUDGET * total / budget_bytes)
    streams = SpillStreams(spill_directory, "b")
    for batch in read_segments(segments):
        _split(batch, _hash_range(batch.column(HASH_COLUMN), buckets), buckets, streams)
    spilled = streams.close()
    for bucket in sorted(spilled):
        yield concat_batches(list(read_segments(spilled[bucket])))


def _hash_range(hashes: pa.Array, buckets: int) -> np.ndarray:
    """Bucket of each hash when the 64-bit hash space is cut into `buckets` equal ranges."""
    high = hashes.to_numpy(zero_copy_only=False) >> np.uint64(32)
    return (high * np.uint64(buckets)) >> np.uint64(32)


def concat_batches(batches: list[pa.RecordBatch]) -> pa.Table:
    """One table of `batches`, whose schemas may differ (types are promoted, missing columns
    filled with nulls)."""
    if not batches:
        return pa.table({})
    tables = [pa.Table.from_batches([batch]) for batch in batches]
    return pa.concat_tables(tables, promote_options="permissive")


def sort_into_runs(table: pa.Table, key_name: str) -> tuple[pa.Table, np.ndarray]:
    """Rows ordered by (hash, key, input order), so each key is one run with its first
    occurrence first, and the index where each run begins ([runs], int64).

    Sorted by (hash, input order) in numpy first, a stable sort of the hashes when the rows come
    in input order, as a partition does: where equal hashes mean equal keys (always, but for a
    2**-64 collision) that is the same order, and ~3x faster than Arrow's three-key sort (0.45
    -> 0.16 s for 700,000 rows). The keys of rows with equal hashes are compared once, for both
    the check and the runs; where they differ, Arrow sorts by all three."""
    if table.num_rows == 0:
        return table, np.zeros(0, dtype=np.int64)
    hashes = table.column(HASH_COLUMN).to_numpy()
    order = table.column(ORDER_COLUMN).to_numpy()
    if np.all(order[1:] > order[:-1]):
        by = np.argsort(hashes, kind="stable")
    else:
        by = np.lexsort((order, hashes))
    ordered, hashes = table.take(by), hashes[by]
    differ, tied = _hash_ties(ordered, key_name, hashes)
    if differ.any():  # a collision: equal hashes with keys apart, which Arrow's sort orders
        keys = [(HASH_COLUMN, "ascending"), (key_name, "ascending"), (ORDER_COLUMN, "ascending")]
        ordered = table.take(pc.sort_indices(table, sort_keys=keys))
        hashes = ordered.column(HASH_COLUMN).to_numpy()
        differ, tied = _hash_ties(ordered, key_name, hashes)
    changed = hashes[1:] != hashes[:-1]
    changed[tied] = differ
    return ordered, np.concatenate([[0], np.flatnonzero(changed) + 1])


def _hash_ties(table: pa.Table, key_name: str, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a table ordered by `hashes` (its hash column): whether each row i whose hash equals
    row i+1's has another key than row i+1 (a collision; two nulls are the same key), bool
    [ties], and those rows i, int64 [ties]."""
    tied = np.flatnonzero(hashes[1:] == hashes[:-1])
    if not len(tied):
        return np.zeros(0, dtype=bool), tied
    keys = table.column(key_name)
    left, right = keys.take(pa.array(tied)), keys.take(pa.array(tied + 1))
    differ = pc.fill_null(pc.not_equal(left, right), True)
    both_null = pc.and_(pc.is_null(left), pc.is_null(right))
    differ = pc.and_not(differ, both_null).to_numpy(zero_copy_only=False)
    return differ, tied


def run_lengths(starts: np.ndarray, num_rows: int) -> np.ndarray:
    """The length of each run of a group_batches reducer's table, from its `starts` and row
    count; [runs], int64."""
    return np.diff(np.append(starts, num_rows))
