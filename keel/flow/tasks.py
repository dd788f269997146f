"""A task: one shard of one stage. It reads its input, runs the stage's fused operations one chunk
at a time, and writes its output; a backend runs it in a worker process and may run it again.

Each attempt writes under its own directory, `{work}/stage-NNN/task-NNNNN-aN/`, so a killed or
failed attempt cannot corrupt the output of the attempt that succeeds; the coordinator uses only
the files named in the successful attempt's result.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keel.core import paths
from keel.core.process import peak_resident_bytes
from keel.flow import later_copies
from keel.flow.keys import HIDDEN_COLUMNS, KEY_COLUMN
from keel.flow.ops import (
    Deduplicate,
    GroupBatches,
    Key,
    MarkLaterCopies,
    NarrowOp,
    Reducer,
    Repartition,
    Row,
    ShardOp,
    StageError,
    WideOp,
    rows_to_batch,
    run_narrow,
)
from keel.flow.readers import SkipLog
from keel.flow.shuffle import (
    PartitionWriter,
    Segment,
    SpillStreams,
    concat_batches,
    partition_tables,
    read_segments,
    sort_into_runs,
)
from keel.flow.sinks import FileSink
from keel.flow.sources import Source

MiB = 1024 * 1024


@dataclass(frozen=True)
class Settings:
    """How tasks use memory: chunks of at most `chunk_rows` rows and `chunk_bytes` bytes, and a
    reducer budget `memory_budget` (bytes of Arrow data held at once before sub-bucketing)."""

    chunk_rows: int = 65_536
    chunk_bytes: int = 64 * MiB
    memory_budget: int = 512 * MiB


@dataclass(frozen=True)
class SourceInput:
    source: Source
    shard: int


@dataclass(frozen=True)
class ShuffleInput:
    """Partition `partition` of the previous stage: its segments in map-task order."""

    segments: tuple[Segment, ...]
    reduce: WideOp
    partition: int


@dataclass(frozen=True)
class ShuffleOutput:
    key: Key | None
    num_partitions: int
    combiner: Reducer | None = None


@dataclass(frozen=True)
class FileOutput:
    """Files of `format` ("parquet" or "jsonl") of about `target_bytes` each, committed to
    `destination` when the run ends (see runner.execute)."""

    format: str
    target_bytes: int
    destination: str
    commit: bool = True
    """False: the files are placed in `destination`, a staging directory the caller commits
    (keel.core.commit.staged_output), with no _SUCCESS and no commit of their own."""
    aside: tuple[str, ...] = ()
    """Columns of side rows: a row whose first aside column is not null is not written to the
    files but set aside (only these columns) and returned as FlowResult.aside, in input order;
    the files get the other rows without these columns. For a small record of what a pass did
    (a stage's drops by reason) kept beside the rows it writes, in the same pass."""
    checkpoint: str | None = None
    """A directory where each finished task of a one-stage plan (narrow operations on the
    source) keeps its files and a done marker, `task-NNNNN/done.json`; a task whose marker is
    there returns what it recorded instead of running, so a rerun of a failed run redoes only
    the unfinished shards (a task of mark_later_copies runs again, since the later shards need
    the keys it publishes). The caller names the directory for the run's identity (its input
    files, operations and settings) and removes it once the output is committed."""


@dataclass(frozen=True)
class CollectOutput:
    """Rows kept in one Arrow file per task, read back by the coordinator (take, to_table)."""

    limit: int | None = None


@dataclass(frozen=True)
class CountOutput:
    pass


Output = ShuffleOutput | FileOutput | CollectOutput | CountOutput


@dataclass
class TaskResult:
    """What an attempt produced: spill segments by partition, or output files; and counters."""

    partitions: dict[int, list[Segment]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    rows_in: int = 0
    rows_out: int = 0
    bytes_spilled: int = 0
    peak_rss: int = 0
    """Peak resident memory of the worker process so far, in bytes (Linux; 0 elsewhere)."""
    skipped: SkipLog = field(default_factory=lambda: SkipLog({}, []))
    aside: list[str] = field(default_factory=list)
    """Arrow stream files of the rows set aside (FileOutput.aside)."""


def stage_dir(work_dir: str, stage: int) -> str:
    """Where the attempts of one stage's tasks write: `{work_dir}/stage-NNN`."""
    return paths.join(work_dir, f"stage-{stage:03d}")


@dataclass(frozen=True)
class Task:
    stage: int
    index: int
    stage_name: str
    input: SourceInput | ShuffleInput
    ops: tuple[NarrowOp, ...]
    shard_op: ShardOp | None
    after: tuple[NarrowOp, ...]
    output: Output
    settings: Settings
    work_dir: str

    def describe(self) -> str:
        """Names the task in errors: its stage, shard and input."""
        if isinstance(self.input, SourceInput):
            where = self.input.source.describe(self.input.shard)
        else:
            where = f"shuffle partition {self.input.partition}"
        return f"stage {self.stage} ({self.stage_name}) task {self.index} ({where})"

    def attempt_dir(self, attempt: int) -> str:
        return paths.join(stage_dir(self.work_dir, self.stage), f"task-{self.index:05d}-a{attempt}")

    def run(self, attempt: int) -> TaskResult:
        checkpoint = self.output.checkpoint if isinstance(self.output, FileOutput) else None
        # a mark_later_copies task runs again: the later shards wait for the keys it publishes
        marking = isinstance(self.shard_op, MarkLaterCopies)
        if checkpoint is None or marking or not isinstance(self.input, SourceInput):
            return self._run(attempt)
        kept = paths.join(checkpoint, f"task-{self.index:05d}")
        marker = paths.join(kept, DONE_MARKER)
        if paths.exists(marker):
            recorded = _recorded_result(paths.read_text(marker))
            if all(paths.exists(path) for path in [*recorded.files, *recorded.aside]):
                return recorded
        result = self._run(attempt)
        result.files = [_keep(path, kept) for path in result.files]
        result.aside = [_keep(path, kept) for path in result.aside]
        paths.write_text(marker, _result_record(result))
        return result

    def _run(self, attempt: int) -> TaskResult:
        directory = self.attempt_dir(attempt)
        paths.make_dirs(directory)
        result = TaskResult()
        chunks = (
            out
            for batch in self._input(directory, result)
            if (out := run_narrow(self.ops, batch)) is not None
        )
        if self.shard_op is not None:
            chunks = self._whole_shard(chunks)
        writer = self._writer(directory)
        limit = self.output.limit if isinstance(self.output, CollectOutput) else None
        aside = self.output.aside if isinstance(self.output, FileOutput) else ()
        set_aside = SpillStreams(directory, "aside-") if aside else None
        for batch in chunks:
            if set_aside is not None:
                batch = _set_aside(batch, aside, set_aside)
                if batch.num_rows == 0:
                    continue
            result.rows_out += batch.num_rows
            if writer is not None:
                writer.write(batch)
            if limit is not None and result.rows_out >= limit:
                break
        if isinstance(writer, PartitionWriter):
            result.partitions = writer.close()
            result.bytes_spilled = sum(
                paths.file_size(s.path) for segments in result.partitions.values() for s in segments
            )
        elif isinstance(writer, FileSink):
            result.files = writer.close()
        elif isinstance(writer, SpillStreams):
            result.files = [s.path for s in writer.close().get(0, [])]
        if set_aside is not None:
            result.aside = [s.path for s in set_aside.close().get(0, [])]
        result.peak_rss = peak_resident_bytes()
        return result

    def _input(self, directory: str, result: TaskResult) -> Iterator[pa.RecordBatch]:
        settings = self.settings
        if isinstance(self.input, SourceInput):
            batches = self.input.source.read(self.input.shard, settings.chunk_rows, result.skipped)
        else:
            result.rows_in = sum(segment.rows for segment in self.input.segments)
            batches = self._reduce(self.input, directory)
        for batch in batches:
            if isinstance(self.input, SourceInput):
                result.rows_in += batch.num_rows
            yield from _limit_bytes(batch, settings.chunk_bytes)

    def _reduce(self, shuffle: ShuffleInput, directory: str) -> Iterator[pa.RecordBatch]:
        reduce = shuffle.reduce
        if isinstance(reduce, Repartition):
            for batch in read_segments(shuffle.segments):
                yield _visible(batch)
            return
        key_name = reduce.key if isinstance(reduce.key, str) else KEY_COLUMN
        spill = paths.join(directory, "reduce-spill")
        for table in partition_tables(shuffle.segments, self.settings.memory_budget, spill):
            if table.num_rows == 0:
                continue
            if isinstance(reduce, GroupBatches) and not reduce.sort_by_key:
                starts = None  # the reducer takes the rows as they came, in input order
            else:
                table, starts = sort_into_runs(table, key_name)
            if isinstance(reduce, Deduplicate):
                yield from _visible_table(table.take(pa.array(starts))).to_batches(
                    self.settings.chunk_rows
                )
            elif isinstance(reduce, GroupBatches):
                out = reduce.reducer(_visible_table(table), starts)
                if out is not None and out.num_rows:
                    yield from out.to_batches(self.settings.chunk_rows)
            else:
                keys = table.column(key_name).take(pa.array(starts)).to_pylist()
                rows = _visible_table(table).to_pylist()
                del table  # the rows are all the reducer needs: hold one copy, not two
                yield from _grouped(keys, rows, starts, reduce.reducer, self.settings.chunk_rows)

    def _whole_shard(self, chunks: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """The shard's rows through `shard_op` (sort, mark_later_copies) and then `after`."""
        batches = list(chunks)
        if isinstance(self.shard_op, MarkLaterCopies):
            keys_dir = paths.join(stage_dir(self.work_dir, self.stage), "keys")
            if not batches:  # the later shards wait for this one's keys, even when it has none
                later_copies.publish_none(self.index, keys_dir)
                return
            table = later_copies.mark(concat_batches(batches), self.shard_op, self.index, keys_dir)
        elif batches:
            table = concat_batches(batches).sort_by(list(self.shard_op.keys))
        else:
            return
        for batch in table.to_batches(self.settings.chunk_rows):
            out = run_narrow(self.after, batch)
            if out is not None:
                yield out

    def _writer(self, directory: str) -> PartitionWriter | FileSink | SpillStreams | None:
        output = self.output
        if isinstance(output, ShuffleOutput):
            if output.combiner is not None:
                return _CombiningWriter(directory, output, self.index)
            return PartitionWriter(directory, output.num_partitions, output.key, self.index)
        if isinstance(output, FileOutput):
            return FileSink(directory, output.format, output.target_bytes, self.settings.chunk_rows)
        if isinstance(output, CollectOutput):
            return _CollectWriter(directory)
        return None


DONE_MARKER = "done.json"


def _keep(path: str, directory: str) -> str:
    target = paths.join(directory, path.rsplit("/", 1)[-1])
    paths.move_file(path, target)
    return target


def _result_record(result: TaskResult) -> str:
    """A finished task's result as JSON (FileOutput.checkpoint's done marker)."""
    return json.dumps(
        {
            "files": result.files,
            "aside": result.aside,
            "rows_in": result.rows_in,
            "rows_out": result.rows_out,
            "skipped": {"counts": result.skipped.counts, "sample": result.skipped.sample},
        }
    )


def _recorded_result(text: str) -> TaskResult:
    record = json.loads(text)
    skipped = SkipLog(record["skipped"]["counts"], [tuple(s) for s in record["skipped"]["sample"]])
    return TaskResult(
        files=record["files"],
        aside=record["aside"],
        rows_in=record["rows_in"],
        rows_out=record["rows_out"],
        skipped=skipped,
    )


def _set_aside(
    batch: pa.RecordBatch, columns: tuple[str, ...], streams: SpillStreams
) -> pa.RecordBatch:
    """Append the batch's side rows (columns[0] not null; only `columns`) to `streams`; return
    its other rows without `columns`."""
    marked = pc.is_valid(batch.column(columns[0])).to_numpy(zero_copy_only=False)
    first = int(np.argmax(marked)) if marked.any() else batch.num_rows
    if marked[first:].all():  # none, or a tail: slices, no copy of the other rows
        side, rest = batch.slice(first).select(list(columns)), batch.slice(0, first)
    else:
        side = batch.filter(pa.array(marked)).select(list(columns))
        rest = batch.filter(pa.array(~marked))
    if side.num_rows:
        streams.append(0, side)
    return rest.drop_columns(list(columns))


def _visible(batch: pa.RecordBatch) -> pa.RecordBatch:
    keep = [name for name in batch.schema.names if name not in HIDDEN_COLUMNS]
    return batch.select(keep)


def _visible_table(table: pa.Table) -> pa.Table:
    return table.drop_columns([name for name in table.column_names if name in HIDDEN_COLUMNS])


def _grouped(
    keys: list, rows: list[Row], starts, reducer: Reducer, chunk_rows: int
) -> Iterator[pa.RecordBatch]:
    """Call `reducer(key, rows)` for each run of equal keys (run i starts at row starts[i]); yield
    the reducer's rows in chunks."""
    ends = [*starts[1:], len(rows)]
    out: list[Row] = []
    for key, start, end in zip(keys, starts, ends, strict=True):
        out.extend(_as_rows(reducer(key, rows[int(start) : int(end)]), reducer))
        if len(out) >= chunk_rows:
            yield rows_to_batch(out)
            out = []
    if out:
        yield rows_to_batch(out)


def _as_rows(result, reducer: Reducer) -> list[Row]:
    if result is None:
        return []
    if isinstance(result, dict):
        return [result]
    rows = list(result)
    if not all(isinstance(row, dict) for row in rows):
        name = getattr(reducer, "__qualname__", repr(reducer))
        raise StageError(f"reducer {name} must return a dict, an iterable of dicts, or None")
    return rows


def _limit_bytes(batch: pa.RecordBatch, chunk_bytes: int) -> Iterator[pa.RecordBatch]:
    """Split a batch whose Arrow buffers exceed `chunk_bytes` into row slices that fit."""
    if batch.nbytes <= chunk_bytes or batch.num_rows <= 1:
        yield batch
        return
    pieces = -(-batch.nbytes // chunk_bytes)
    size = -(-batch.num_rows // pieces)
    for start in range(0, batch.num_rows, size):
        yield batch.slice(start, size)


class _CombiningWriter(PartitionWriter):
    """A PartitionWriter that first combines each chunk's rows by key (group_by's combiner)."""

    def __init__(self, directory: str, output: ShuffleOutput, task_index: int) -> None:
        super().__init__(directory, output.num_partitions, output.key, task_index)
        self.combiner = output.combiner

    def write(self, batch: pa.RecordBatch) -> None:
        groups: dict = {}
        for row in batch.to_pylist():
            value = row[self.key] if isinstance(self.key, str) else self.key(row)
            groups.setdefault(_hashable(value), (value, []))[1].append(row)
        combined = [
            row
            for value, rows in groups.values()
            for row in _as_rows(self.combiner(value, rows), self.combiner)
        ]
        out = rows_to_batch(combined)
        if out is not None:
            super().write(out)


def _hashable(value):
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


class _CollectWriter(SpillStreams):
    def __init__(self, directory: str) -> None:
        super().__init__(directory, "collect-")

    def write(self, batch: pa.RecordBatch) -> None:
        self.append(0, batch)
