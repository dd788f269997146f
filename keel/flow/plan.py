"""The planner: a pipeline (source + operations) -> stages.

Consecutive narrow operations fuse into one stage, which runs them chunk by chunk without writing
anything in between. Each wide operation (group_by, group_batches, deduplicate, repartition) ends
a stage with a shuffle, and the next stage starts by reducing that shuffle. An operation on a
whole shard (sort, mark_later_copies) runs at the end of its stage's fused chain; narrow
operations after it still run in that stage, on its rows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from keel.core.errors import UsageError
from keel.flow.ops import (
    Deduplicate,
    Filter,
    FlatMap,
    GroupBatches,
    GroupBy,
    Map,
    MapBatches,
    MarkLaterCopies,
    NarrowOp,
    Repartition,
    Select,
    ShardOp,
    Sort,
    WideOp,
)
from keel.flow.sources import FileSource, Source

Op = NarrowOp | WideOp | ShardOp


@dataclass(frozen=True)
class StagePlan:
    """One stage: where its rows come from, what it does to them, where they go.

    `reduce` is None for the first stage (it reads the source) and otherwise the wide operation
    whose shuffle this stage reduces; `shard_op` works on each shard's rows after `ops`, and
    `after` on its output; `shuffle` is the wide operation this stage's output feeds, or None for
    the last stage."""

    index: int
    reduce: WideOp | None
    ops: tuple[NarrowOp, ...]
    shard_op: ShardOp | None
    after: tuple[NarrowOp, ...]
    shuffle: WideOp | None

    @property
    def name(self) -> str:
        parts = [_name(self.reduce)] if self.reduce else ["read"]
        parts += [_name(op) for op in self.ops]
        if self.shard_op:
            parts.append(_name(self.shard_op))
        parts += [_name(op) for op in self.after]
        return " -> ".join(parts)


def build_plan(ops: Sequence[Op]) -> list[StagePlan]:
    stages: list[StagePlan] = []
    reduce: WideOp | None = None
    narrow: list[NarrowOp] = []
    after: list[NarrowOp] = []
    shard_op: ShardOp | None = None
    for op in ops:
        if isinstance(op, (GroupBy, GroupBatches, Deduplicate, Repartition)):
            stages.append(StagePlan(len(stages), reduce, tuple(narrow), shard_op, tuple(after), op))
            reduce, narrow, after, shard_op = op, [], [], None
        elif isinstance(op, (Sort, MarkLaterCopies)):
            if shard_op is not None:
                raise UsageError(
                    "one sort or mark_later_copies per stage: a second needs a repartition between"
                )
            shard_op = op
        elif shard_op is not None:
            after.append(op)
        else:
            narrow.append(op)
    stages.append(StagePlan(len(stages), reduce, tuple(narrow), shard_op, tuple(after), None))
    return stages


def explain(source: Source, stages: Sequence[StagePlan]) -> str:
    """A readable plan: one block per stage, with its tasks and where its output goes."""
    if isinstance(source, FileSource):
        origin = f"{source.format} files ({source.num_shards})"
        if source.columns:
            origin += f", columns {list(source.columns)}"
        if source.filter is not None:
            origin += f", filter {source.filter}"
    else:
        origin = f"items ({source.num_shards} shards)"
    lines = []
    for stage in stages:
        tasks = source.num_shards if stage.reduce is None else _shards(stage.reduce)
        lines.append(f"stage {stage.index}: {tasks} tasks")
        reads = origin if stage.reduce is None else f"shuffle of stage {stage.index - 1}"
        lines.append(f"  input: {reads}")
        if stage.ops or stage.shard_op:
            lines.append(
                f"  fused: {' -> '.join(_name(op) for op in stage.ops) or '-'}"
                + (f" | {_name(stage.shard_op)} per shard" if stage.shard_op else "")
            )
        if stage.after:
            after = _name(stage.shard_op).split("(")[0]
            lines.append(f"  after {after}: {' -> '.join(_name(op) for op in stage.after)}")
        out = f"shuffle by {_name(stage.shuffle)}" if stage.shuffle else "output"
        lines.append(f"  output: {out}")
    return "\n".join(lines)


_FUNCTION_OPS = {Map: "map", FlatMap: "flat_map", MapBatches: "map_batches"}


def _shards(op: WideOp) -> int:
    return op.num_shards


def _name(op: object) -> str:
    if isinstance(op, (Map, FlatMap, MapBatches)):
        return f"{_FUNCTION_OPS[type(op)]}({_fn(op.fn)})"
    if isinstance(op, Filter):
        return f"filter({_fn(op.predicate)})"
    if isinstance(op, Select):
        return f"select({', '.join(op.columns)})"
    if isinstance(op, GroupBy):
        return (
            f"group_by({_key(op.key)}, {op.num_shards} shards{', combiner' if op.combiner else ''})"
        )
    if isinstance(op, GroupBatches):
        unsorted = "" if op.sort_by_key else ", unsorted"
        return f"group_batches({_key(op.key)}, {_fn(op.reducer)}, {op.num_shards} shards{unsorted})"
    if isinstance(op, Deduplicate):
        return f"deduplicate({_key(op.key)}, {op.num_shards} shards)"
    if isinstance(op, Repartition):
        return f"repartition({op.num_shards})"
    if isinstance(op, MarkLaterCopies):
        return f"mark_later_copies({op.key!r}, carry {op.carry!r} into {op.into!r})"
    if isinstance(op, Sort):
        return "sort(" + ", ".join(f"{c}{' desc' * (o == 'descending')}" for c, o in op.keys) + ")"
    return type(op).__name__


def _fn(fn: object) -> str:
    """A function's name for plans and logs: partials by their function, never their arguments
    (which may be a whole model)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _key(key: object) -> str:
    return repr(key) if isinstance(key, str) else _fn(key)
