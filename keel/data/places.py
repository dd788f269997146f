"""Tables of documents chosen by place, written once per input shard for the tasks that use them.

A stage that picks documents in one pass and acts on them in the next (dedup's removals, fuzzy
dedup's candidates) names them by place (inputs.POSITION_COLUMN: the input shard in the high
bits, the row within it in the low ones). Handed to a map function as an array, the whole set
went into every task's pickled message: 4.8 MB for each of 8 tasks at 2M documents, and at 1 TB
billions of places, gigabytes a task, every task. A PlaceTable is written once, one Arrow file per
input shard in a directory beside the stage's output (so every worker of a cluster can read it);
a task reads only the file of the shard its batch comes from, once per process, and looks its
batch's places up there.

    with PlaceTable.write(staging, removed) as table:  # POSITION_COLUMN ascending
        ...  # a flow run whose map function, in each task, calls:
        rows, found = table.rows_at(batch.column(POSITION_COLUMN).to_numpy())
    # the block's end removes the table's directory, before the staging one is committed
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from keel.core import paths
from keel.data.inputs import POSITION_COLUMN, find_places
from keel.flow.keys import ROW_BITS

_SCHEMA_FILE = "schema.arrow"


@dataclass(frozen=True)
class PlaceTable:
    """Rows keyed by place, split by input shard into `directory` (see the module doc)."""

    directory: str

    def __enter__(self) -> PlaceTable:
        return self

    def __exit__(self, *exc: object) -> None:
        """The table's directory removed (a stage's scratch, not part of its output)."""
        paths.remove_tree(self.directory)

    @classmethod
    def write(cls, parent: str, table: pa.Table) -> PlaceTable:
        """Write `table` (a uint64 POSITION_COLUMN, ascending, and any other columns) as one
        Arrow file per input shard it has rows of, plus its schema, into a new directory under
        `parent` (a name of its own: workers cache what they read by directory)."""
        directory = paths.join(parent, f"_places-{uuid.uuid4().hex[:12]}")
        paths.make_dirs(directory)
        _write_file(paths.join(directory, _SCHEMA_FILE), table.schema.empty_table())
        places = table.column(POSITION_COLUMN).to_numpy()
        shards = _shards(places)
        bounds = np.flatnonzero(shards[1:] != shards[:-1]) + 1
        for start, end in zip(np.append(0, bounds), np.append(bounds, len(places)), strict=True):
            if end > start:
                path = paths.join(directory, _shard_file(int(shards[start])))
                _write_file(path, table.slice(int(start), int(end - start)))
        return cls(directory)

    @classmethod
    def of_places(cls, parent: str, places: np.ndarray) -> PlaceTable:
        """A table of places alone (uint64, ascending)."""
        return cls.write(parent, pa.table({POSITION_COLUMN: pa.array(places, pa.uint64())}))

    def rows_at(self, places: np.ndarray) -> tuple[pa.Table, np.ndarray]:
        """The table's rows at `places` (a batch's, uint64), in their order, and which of
        `places` have one: (a table of the found rows, bool [len(places)])."""
        found = np.zeros(len(places), dtype=bool)
        parts = []
        for mine, table, at, hit in self._lookups(places):
            found[mine[hit]] = True
            parts.append((mine[hit], table.take(at[hit])))
        if not parts:
            return _shard_table(self.directory, None)[0], found
        if len(parts) == 1:
            return parts[0][1], found
        order = np.argsort(np.concatenate([index for index, _ in parts]), kind="stable")
        return pa.concat_tables([rows for _, rows in parts]).take(order), found

    def has(self, places: np.ndarray) -> np.ndarray:
        """Which of `places` the table has a row for: bool [len(places)]."""
        found = np.zeros(len(places), dtype=bool)
        for mine, _, _, hit in self._lookups(places):
            found[mine[hit]] = True
        return found

    def _lookups(
        self, places: np.ndarray
    ) -> Iterator[tuple[np.ndarray, pa.Table, np.ndarray, np.ndarray]]:
        """Per input shard among `places`: (the indices of its places, its table, where each
        is in the table, whether it is there)."""
        shards = _shards(places)
        for shard in np.unique(shards):  # one for a batch straight from a source task
            mine = np.flatnonzero(shards == shard)
            table, known = _shard_table(self.directory, int(shard))
            at, hit = find_places(known, places[mine])
            yield mine, table, at, hit


def _shards(places: np.ndarray) -> np.ndarray:
    """The input shard of each place (its high bits: keel.flow.keys.order_values), uint64."""
    return places >> np.uint64(ROW_BITS)


def _shard_file(shard: int) -> str:
    return f"shard-{shard:06d}.arrow"


def _write_file(path: str, table: pa.Table) -> None:
    with paths.open_file(path, "wb") as handle, pa.ipc.new_file(handle, table.schema) as writer:
        writer.write_table(table)


@functools.lru_cache(maxsize=4)
def _shard_table(directory: str, shard: int | None) -> tuple[pa.Table, np.ndarray]:
    """One shard's rows and their places, uint64 (an empty table of the schema when it has
    none; `shard` None: the schema's), read once per process: a worker's tasks of one shard
    share them."""
    path = paths.join(directory, _SCHEMA_FILE if shard is None else _shard_file(shard))
    if shard is not None and not paths.exists(path):
        return _shard_table(directory, None)
    if paths.is_local(path):
        table = pa.ipc.open_file(pa.memory_map(str(paths.local_path(path)))).read_all()
    else:
        with paths.open_file(path, "rb") as handle:
            table = pa.ipc.open_file(handle).read_all()
    return table, table.column(POSITION_COLUMN).to_numpy().astype(np.uint64)
