"""The Dataset API: a lazy pipeline over rows, run by keel/flow's planner and backends.

    from keel.flow import read_jsonl

    docs = read_jsonl("raw/*.jsonl.gz").filter(lambda d: len(d["text"]) > 100)
    unique = docs.deduplicate("id", num_shards=8)
    result = unique.write_parquet("clean/")          # FlowResult: files, counters, skipped
    print(unique.explain())

Nothing runs until an action: write_parquet, write_jsonl, take, count or to_table. Every action
takes `options=RunOptions(...)` (backend, workers, retries, memory settings) or keyword overrides
of it (`workers=4`, `backend="ray"`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from keel.core.errors import UsageError
from keel.flow.ops import (
    BatchReducer,
    Deduplicate,
    Filter,
    FlatMap,
    GroupBatches,
    GroupBy,
    Key,
    Map,
    MapBatches,
    MarkLaterCopies,
    Reducer,
    Repartition,
    Row,
    Select,
    Sort,
)
from keel.flow.plan import Op, build_plan, explain
from keel.flow.runner import AsideHandler, FlowResult, RunOptions, execute
from keel.flow.sources import Source, file_source, items_source
from keel.flow.tasks import CollectOutput, CountOutput, FileOutput, Output, Settings

MiB = 1024 * 1024
DEFAULT_TARGET_FILE_BYTES = 256 * MiB


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A source and the operations applied to it, in order. Immutable: each method returns a new
    Dataset."""

    source: Source
    ops: tuple[Op, ...] = ()

    # -- narrow operations: fused into one stage ------------------------------------------------
    def map(self, fn: Callable[[Row], Row]) -> Dataset:
        """One row in, one row (a dict) out."""
        return self._then(Map(fn))

    def flat_map(self, fn: Callable[[Row], Iterable[Row]]) -> Dataset:
        """One row in, any number of rows out."""
        return self._then(FlatMap(fn))

    def filter(self, predicate: Callable[[Row], bool] | pc.Expression) -> Dataset:
        """Keep rows where `predicate(row)` is true; an Arrow expression
        (`pc.field("lang") == "en"`) runs vectorised, and on Parquet input is pushed down."""
        return self._then(Filter(predicate))

    def map_batches(self, fn: Callable[[pa.RecordBatch], pa.RecordBatch | pa.Table]) -> Dataset:
        """A pyarrow RecordBatch (one chunk) in, a RecordBatch or Table out."""
        return self._then(MapBatches(fn))

    def select(self, *columns: str) -> Dataset:
        """Keep only these columns, in this order."""
        return self._then(Select(tuple(columns)))

    # -- wide operations: each ends a stage with a shuffle --------------------------------------
    def group_by(
        self,
        key: Key,
        reducer: Reducer,
        num_shards: int | None = None,
        combiner: Reducer | None = None,
    ) -> Dataset:
        """`reducer(key, rows)` once per key, with that key's rows in input order; it returns a row,
        rows, or None. `combiner` (same signature) pre-aggregates each chunk on the map side; its
        rows must keep the key. The output has `num_shards` shards (default: the input's)."""
        return self._then(GroupBy(key, reducer, self._shards(num_shards), combiner))

    def group_batches(
        self,
        key: str,
        reducer: BatchReducer,
        num_shards: int | None = None,
        sort_by_key: bool = True,
    ) -> Dataset:
        """group_by for a reducer written over Arrow: `reducer(table, starts)` once per shuffle
        partition (or per memory-budget part of one; a key's rows are never split), the table's
        rows sorted so that each value of the `key` column is one run, its rows in input order,
        and `starts` the index of each run's first row ([runs], int64). It returns a table (or
        None): one call per partition, not one per key, so no Python runs per row.

        sort_by_key=False: the rows come in input order, not sorted, and `starts` is None, for a
        reducer that needs only each key's rows in one call (it saves a sort and a copy of every
        column)."""
        return self._then(GroupBatches(key, reducer, self._shards(num_shards), sort_by_key))

    def deduplicate(self, key: Key, num_shards: int | None = None) -> Dataset:
        """One row per key: the first in input order (source shard, then row)."""
        return self._then(Deduplicate(key, self._shards(num_shards)))

    def repartition(self, num_shards: int) -> Dataset:
        """Spread rows evenly over `num_shards` shards."""
        return self._then(Repartition(self._shards(num_shards)))

    def sort(self, *columns: str | tuple[str, str], descending: bool = False) -> Dataset:
        """Order the rows within each shard (each shard must fit in memory). A column is a name,
        ordered by `descending`, or a pair (name, "ascending" | "descending"):
        `ds.sort(("count", "descending"), "word")`. The sort is stable."""
        if not columns:
            raise UsageError("sort needs at least one column")
        default = "descending" if descending else "ascending"
        keys = tuple((c, default) if isinstance(c, str) else tuple(c) for c in columns)
        bad = [order for _, order in keys if order not in ("ascending", "descending")]
        if bad:
            raise UsageError(f"sort order must be 'ascending' or 'descending', got {bad[0]!r}")
        return self._then(Sort(keys))

    def mark_later_copies(self, key: str, carry: str, into: str) -> Dataset:
        """Mark each row whose `key` an earlier row holds (input order: shard, then row): a new
        column `into` gets the `carry` value of that key's first row, null for the first row
        itself. The key is a column of 16-byte digests (pa.binary(16)); each shard must fit in
        memory. One read, no shuffle: meant for a few shards, since each task reads the keys of
        every earlier one (keel.flow.later_copies).

            docs.mark_later_copies("text_hash", carry="id", into="duplicate_of")
        """
        return self._then(MarkLaterCopies(key, carry, into))

    # -- actions ----------------------------------------------------------------------------
    def write_parquet(
        self,
        directory: str | os.PathLike[str],
        target_file_bytes: int = DEFAULT_TARGET_FILE_BYTES,
        options: RunOptions | None = None,
        commit: bool = True,
        aside: Sequence[str] = (),
        checkpoint: str | None = None,
        on_aside: AsideHandler | None = None,
        **overrides: Any,
    ) -> FlowResult:
        """Write zstd Parquet files `part-NNNNN-of-NNNNN.parquet` to `directory`, atomically.

        `directory` must be new, empty, or a previous output (it has _SUCCESS), and must not hold
        an input: anything else is refused before the run starts (keel.core.commit). With
        `commit=False` the files go into `directory` as they are, for a caller that writes more
        files beside them and commits the whole (keel.core.commit.staged_output's staging).
        `aside`: rows whose first such column is not null are returned in FlowResult.aside
        (those columns only) instead of being written; the files lack these columns. With
        `on_aside`, each task's set-aside rows go to it instead, on this process, in input order
        and as soon as the tasks before it are done: a caller writes them while the run goes on.
        `checkpoint`: a directory where finished tasks of a one-stage plan are kept, so that a
        rerun after a failure redoes only the others (tasks.FileOutput.checkpoint)."""
        output = FileOutput(
            "parquet", target_file_bytes, os.fspath(directory), commit, tuple(aside), checkpoint
        )
        return self.run(output, options, on_aside, **overrides)

    def write_jsonl(
        self,
        directory: str | os.PathLike[str],
        target_file_bytes: int = DEFAULT_TARGET_FILE_BYTES,
        options: RunOptions | None = None,
        commit: bool = True,
        **overrides: Any,
    ) -> FlowResult:
        """Write JSON Lines files `part-NNNNN-of-NNNNN.jsonl` to `directory`, atomically (see
        write_parquet for what `directory` may be, and `commit`)."""
        output = FileOutput("jsonl", target_file_bytes, os.fspath(directory), commit)
        return self.run(output, options, **overrides)

    def take(self, n: int, options: RunOptions | None = None, **overrides: Any) -> list[Row]:
        """The first `n` rows (in output order)."""
        table = self.to_table(options, limit=n, **overrides)
        return table.to_pylist()

    def count(self, options: RunOptions | None = None, **overrides: Any) -> int:
        return self.run(CountOutput(), options, **overrides).rows

    def to_table(
        self, options: RunOptions | None = None, limit: int | None = None, **overrides: Any
    ) -> pa.Table:
        """All rows (or the first `limit`) as one Arrow table: for results that fit in memory."""
        table = self.run(CollectOutput(limit), options, **overrides).table
        return table if table is not None else pa.table({})

    def run(
        self,
        output: Output,
        options: RunOptions | None = None,
        on_aside: AsideHandler | None = None,
        **overrides: Any,
    ) -> FlowResult:
        """Run the pipeline into `output` (the building block of the actions above)."""
        plan = build_plan(self.ops)
        return execute(self.source, plan, output, _options(options, overrides), on_aside)

    def explain(self) -> str:
        """The plan: stages, fused operations, shuffles."""
        return explain(self.source, build_plan(self.ops))

    # -- helpers ------------------------------------------------------------------------------
    def _then(self, op: Op) -> Dataset:
        return dataclasses.replace(self, ops=(*self.ops, op))

    def _shards(self, num_shards: int | None) -> int:
        shards = max(1, self.source.num_shards) if num_shards is None else num_shards
        if shards < 1:
            raise UsageError(f"num_shards must be at least 1, got {shards}")
        return shards


def _options(options: RunOptions | None, overrides: dict[str, Any]) -> RunOptions:
    base = options or RunOptions()
    settings_fields = {f.name for f in dataclasses.fields(Settings)}
    settings = {k: v for k, v in overrides.items() if k in settings_fields}
    rest = {k: v for k, v in overrides.items() if k not in settings_fields}
    unknown = set(rest) - {f.name for f in dataclasses.fields(RunOptions)}
    if unknown:
        raise UsageError(f"unknown run option(s): {', '.join(sorted(unknown))}")
    if settings:
        rest["settings"] = dataclasses.replace(base.settings, **settings)
    return dataclasses.replace(base, **rest)


def from_items(
    items: Sequence[Row], num_shards: int = 1, position_column: str | None = None
) -> Dataset:
    """A dataset of in-memory rows (dicts), cut into `num_shards` contiguous shards;
    `position_column` as for read_parquet."""
    return Dataset(items_source(items, num_shards, position_column))


def from_files(
    pattern: str | Sequence[str],
    format: str | None = None,
    lenient: bool = False,
    file_column: str | None = None,
) -> Dataset:
    """Files by glob (any fsspec URL), one shard per file; format from the suffix unless given.
    `file_column`: add a column of that name holding each row's file path."""
    return Dataset(file_source(pattern, format, lenient=lenient, file_column=file_column))


def read_jsonl(
    pattern: str | Sequence[str],
    lenient: bool = False,
    file_column: str | None = None,
    position_column: str | None = None,
) -> Dataset:
    """JSON Lines files (plain, .gz, .zst). `lenient`: skip and count malformed records;
    `file_column`: add a column of that name holding each row's file path; `position_column`
    as for read_parquet."""
    source = file_source(
        pattern, "jsonl", lenient=lenient, file_column=file_column, position_column=position_column
    )
    return Dataset(source)


def read_parquet(
    pattern: str | Sequence[str],
    columns: Sequence[str] | None = None,
    filter: pc.Expression | None = None,
    lenient: bool = False,
    file_column: str | None = None,
    position_column: str | None = None,
) -> Dataset:
    """Parquet files; `columns` and `filter` are pushed down into the reader (row groups whose
    statistics exclude the filter are not read); `file_column` as for read_jsonl;
    `position_column`: add a uint64 column of that name holding each row's place in the input,
    the same every time the input is read (keel.flow.sources.with_positions), so that a later
    pass over the same files can pick out rows an earlier one chose."""
    source = file_source(
        pattern,
        "parquet",
        columns=columns,
        filter=filter,
        lenient=lenient,
        file_column=file_column,
        position_column=position_column,
    )
    return Dataset(source)
