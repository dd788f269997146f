"""The operations of a flow pipeline, and how a fused chain of narrow ones runs on one chunk.

Narrow operations (map, flat_map, filter, map_batches, select) work chunk by chunk and are fused
into one stage. Wide operations (group_by, group_batches, deduplicate, repartition) move rows
between shards, so
the planner cuts a stage at each. `sort` (orders the rows of each shard) and `mark_later_copies`
work on a whole shard at once, after the stage's fused chain.

Rows are dicts; a chunk is a pyarrow RecordBatch. A fused chain converts a chunk to rows only when
a row function needs them, and back to a RecordBatch only when a batch operation or the stage's
output needs one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keel.core.errors import KeelError

Row = dict[str, Any]
KeyFunction = Callable[[Row], Any]
Key = str | KeyFunction
"""A shuffle key: a column name, or a function of the row."""

Reducer = Callable[[Any, list[Row]], Iterable[Row] | Row | None]
"""group_by's reducer: (key, rows of that key in input order) -> output rows (or one row)."""

BatchReducer = Callable[[pa.Table, np.ndarray | None], pa.Table | None]
"""group_batches' reducer: (rows sorted so that each key's rows are adjacent and in input order,
the index of each key's first row [keys]; or, with sort_by_key=False, the rows in input order and
None) -> output rows, or None for none."""


@dataclass(frozen=True)
class Map:
    fn: Callable[[Row], Row]


@dataclass(frozen=True)
class FlatMap:
    fn: Callable[[Row], Iterable[Row]]


@dataclass(frozen=True)
class Filter:
    predicate: Callable[[Row], bool] | pc.Expression


@dataclass(frozen=True)
class MapBatches:
    fn: Callable[[pa.RecordBatch], pa.RecordBatch | pa.Table]


@dataclass(frozen=True)
class Select:
    columns: tuple[str, ...]


NarrowOp = Map | FlatMap | Filter | MapBatches | Select


@dataclass(frozen=True)
class GroupBy:
    key: Key
    reducer: Reducer
    num_shards: int
    combiner: Reducer | None = None


@dataclass(frozen=True)
class GroupBatches:
    key: str
    reducer: BatchReducer
    num_shards: int
    sort_by_key: bool = True


@dataclass(frozen=True)
class Deduplicate:
    key: Key
    num_shards: int


@dataclass(frozen=True)
class Repartition:
    num_shards: int


@dataclass(frozen=True)
class Sort:
    """Sort keys as pyarrow takes them: ((column, "ascending" | "descending"), ...)."""

    keys: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MarkLaterCopies:
    """Give each row whose `key` an earlier row holds the `carry` value of the key's first row,
    in a new column `into` (keel.flow.later_copies)."""

    key: str
    carry: str
    into: str


ShardOp = Sort | MarkLaterCopies
"""An operation on a whole shard at once: it ends its stage's fused chain."""

WideOp = GroupBy | GroupBatches | Deduplicate | Repartition


class StageError(KeelError):
    """A user function or schema problem inside a stage, named by stage and operation."""


def run_narrow(ops: Sequence[NarrowOp], batch: pa.RecordBatch) -> pa.RecordBatch | None:
    """Apply a fused chain to one chunk; None when no row survives."""
    rows: list[Row] | None = None
    for op in ops:
        if isinstance(op, MapBatches):
            batch = _call_batches(op, rows_to_batch(rows) if rows is not None else batch)
            rows = None
        elif isinstance(op, Select):
            if rows is not None:
                rows = [{column: row.get(column) for column in op.columns} for row in rows]
            else:
                batch = _select(batch, op.columns)
        elif isinstance(op, Filter) and isinstance(op.predicate, pc.Expression) and rows is None:
            batch = batch.filter(op.predicate)
        else:
            rows = batch.to_pylist() if rows is None else rows
            rows = _apply_rows(op, rows)
        if (rows is None and batch.num_rows == 0) or rows == []:
            return None
    return rows_to_batch(rows) if rows is not None else batch


def rows_to_batch(rows: list[Row]) -> pa.RecordBatch | None:
    """Rows -> a RecordBatch with an inferred schema; None for no rows."""
    if not rows:
        return None
    try:
        return pa.RecordBatch.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise StageError(f"rows cannot form a table (mixed types in a column?): {error}") from error


def _apply_rows(op: Map | FlatMap | Filter, rows: list[Row]) -> list[Row]:
    if isinstance(op, Map):
        return [_check_row(op.fn(row), op) for row in rows]
    if isinstance(op, FlatMap):
        return [_check_row(out, op) for row in rows for out in op.fn(row)]
    predicate = op.predicate
    if isinstance(predicate, pc.Expression):
        table = pa.Table.from_pylist(rows).filter(predicate)
        return table.to_pylist()
    return [row for row in rows if predicate(row)]


def _check_row(row: Any, op: Map | FlatMap) -> Row:
    if not isinstance(row, dict):
        name = getattr(op.fn, "__qualname__", repr(op.fn))
        raise StageError(
            f"{type(op).__name__.lower()} function {name} returned a "
            f"{type(row).__name__}, expected a dict (a row)"
        )
    return row


def _call_batches(op: MapBatches, batch: pa.RecordBatch) -> pa.RecordBatch:
    result = op.fn(batch)
    if isinstance(result, pa.Table):
        result = result.combine_chunks().to_batches()
        return result[0] if result else batch.slice(0, 0)
    if not isinstance(result, pa.RecordBatch):
        name = getattr(op.fn, "__qualname__", repr(op.fn))
        raise StageError(
            f"map_batches function {name} returned a {type(result).__name__}, "
            "expected a pyarrow RecordBatch or Table"
        )
    return result


def _select(batch: pa.RecordBatch, columns: tuple[str, ...]) -> pa.RecordBatch:
    missing = [column for column in columns if column not in batch.schema.names]
    if missing:
        raise StageError(
            f"select: no column {missing[0]!r} (columns: {', '.join(batch.schema.names)})"
        )
    return batch.select(list(columns))
