"""mark_later_copies in one pass: shards in input order, each telling the later ones its keys.

`Dataset.mark_later_copies(key, carry, into)` gives every row whose key an earlier row holds
(earlier in input order: shard, then row) the `carry` value of that key's first row, in a new
column `into`; the first row of each key gets null. The key is a 16-byte digest column
(pa.binary(16), such as the xxh3-128 of a text).

Why not a shuffle: finding each key's first row with one moves the keys between workers and
needs a second read of the rows to act on what it found (keel.data.dedup's first design: two
reads). Here each task reads its shard once:

1. it holds the whole shard (one shard must fit in memory, as for `sort`), finds each key's
   first row within it, and publishes the shard's distinct keys, sorted, with their first rows'
   `carry` values (`{keys_dir}/keys-NNNNN.arrow`, written whole then renamed);
2. it waits for every earlier shard's key file, in shard order, and looks its own keys up in
   each: a key an earlier shard holds takes that shard's `carry` value;
3. it emits its rows with `into` filled.

A task publishes before it waits, so it waits only for earlier shards to be read and hashed,
not written. Both backends start tasks in index order and give a freed worker the next one (a
failed task is tried again first), so an earlier task always holds a worker or has finished:
the waits end. On a Ray cluster shared with other work a started task could still wait for an
earlier one Ray has not placed; a wait past WAIT_SECONDS fails the attempt, which is retried.

Each task reads every earlier shard's keys, so the work grows with shards x keys: the op is for
inputs of a few shards (keel.data.dedup uses it up to ORDERED_MAX_SHARDS input shards and a
shuffle beyond).
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pyarrow as pa

from keel.core import paths
from keel.flow.ops import MarkLaterCopies, StageError

WAIT_SECONDS = 600.0
"""How long a task waits for an earlier shard's key file before its attempt fails."""
KEY_BYTES = 16
HIGH, LOW, CARRY = "high", "low", "carry"
"""The columns of a key file: a key's two 64-bit words (sorted by high, then low) and the carry
value of its first row."""


class EarlierShardTimeout(RuntimeError):
    """An earlier shard's keys did not appear within WAIT_SECONDS (retried like any error)."""


def keys_file(keys_dir: str, shard: int) -> str:
    return paths.join(keys_dir, f"keys-{shard:05d}.arrow")


def mark(table: pa.Table, op: MarkLaterCopies, shard: int, keys_dir: str) -> pa.Table:
    """The shard's rows (all of them, in order) with column `op.into` appended; publishes this
    shard's keys for the later shards before it looks at theirs."""
    high, low = key_words(table, op.key)
    order, sorted_high, sorted_low = _sorted_keys(high, low)
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = (sorted_high[1:] != sorted_high[:-1]) | (sorted_low[1:] != sorted_low[:-1])
    firsts = order[starts]  # [keys]: the row of each distinct key's first copy, by key
    distinct_high, distinct_low = sorted_high[starts], sorted_low[starts]
    carry = table.column(op.carry).combine_chunks()
    if carry.null_count:
        raise StageError(
            f"mark_later_copies needs {op.carry!r} without nulls: a null would read as a first row"
        )
    _publish(
        keys_file(keys_dir, shard),
        pa.table({HIGH: distinct_high, LOW: distinct_low, CARRY: carry.take(firsts)}),
    )
    found, earlier = _earlier_copies(keys_dir, shard, distinct_high, distinct_low, carry.type)
    key_of = np.empty(len(order), dtype=np.int64)  # [rows]: each row's distinct key
    key_of[order] = np.cumsum(starts) - 1
    earliest = found[key_of]
    # from `carry` + `earlier`: the earlier shard's copy, else this shard's first copy, and
    # null for a first copy that no earlier shard holds
    source = np.where(earliest >= 0, len(table) + earliest, firsts[key_of])
    first_here = source == np.arange(len(table))
    values = pa.concat_arrays([carry, earlier])
    return table.append_column(op.into, values.take(pa.array(source, mask=first_here)))


def _earlier_copies(
    keys_dir: str, shard: int, high: np.ndarray, low: np.ndarray, carry_type: pa.DataType
) -> tuple[np.ndarray, pa.Array]:
    """Where each of this shard's distinct keys (high, low: uint64 [keys]) first appears in an
    earlier shard, waiting for each earlier shard's key file in turn: the place of its carry
    value in the returned array (int64 [keys], -1 where no earlier shard holds it), and those
    carry values."""
    found = np.full(len(high), -1, dtype=np.int64)
    values: list[pa.Array] = []
    held = 0
    for other in range(shard):
        keys = _wait_for(keys_file(keys_dir, other))
        missing = np.flatnonzero(found < 0)
        rows = _lookup(keys, high[missing], low[missing])
        hit = rows >= 0
        found[missing[hit]] = held + np.arange(int(hit.sum()))
        values.append(keys.column(CARRY).take(rows[hit]).combine_chunks().cast(carry_type))
        held += int(hit.sum())
    return found, pa.concat_arrays(values) if values else pa.array([], carry_type)


def publish_none(shard: int, keys_dir: str) -> None:
    """Publish an empty key file for a shard with no rows."""
    empty = pa.table({HIGH: pa.array([], pa.uint64()), LOW: pa.array([], pa.uint64())})
    _publish(keys_file(keys_dir, shard), empty.append_column(CARRY, pa.array([], pa.null())))


def key_words(table: pa.Table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """The two 64-bit words of each row's 16-byte key, uint64 [rows] each."""
    keys = table.column(column).combine_chunks()
    if len(keys) == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    if keys.type != pa.binary(KEY_BYTES) or keys.null_count:
        raise StageError(
            f"mark_later_copies needs {column!r} to hold 16-byte keys without nulls "
            f"(pa.binary(16)); it is {keys.type}"
        )
    words = np.frombuffer(
        keys.buffers()[1], dtype=np.uint64, count=2 * len(keys), offset=keys.offset * KEY_BYTES
    ).reshape(-1, 2)
    return words[:, 0].copy(), words[:, 1].copy()


def _sorted_keys(high: np.ndarray, low: np.ndarray) -> tuple[np.ndarray, ...]:
    """The rows in key order (high word, then low), a key's rows in row order: (order, high,
    low), each [rows]. A stable sort of the high words alone (half the time of sorting both) is
    that order unless two keys share a high word, checked, where both words are sorted."""
    order = np.argsort(high, kind="stable")
    sorted_high, sorted_low = high[order], low[order]
    shared = (sorted_high[1:] == sorted_high[:-1]) & (sorted_low[1:] != sorted_low[:-1])
    if shared.any():
        order = np.lexsort((low, high))
        sorted_high, sorted_low = high[order], low[order]
    return order, sorted_high, sorted_low


def _lookup(keys: pa.Table, high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """The row of each (high, low) key in a key file (sorted by high, then low), or -1; int64
    [queries]."""
    rows = np.full(len(high), -1, dtype=np.int64)
    if keys.num_rows == 0 or len(high) == 0:
        return rows
    held_high = keys.column(HIGH).to_numpy()
    held_low = keys.column(LOW).to_numpy()
    at = np.searchsorted(held_high, high)
    inside = at < len(held_high)
    at_ = np.minimum(at, len(held_high) - 1)
    same_high = inside & (held_high[at_] == high)
    exact = same_high & (held_low[at_] == low)
    rows[exact] = at_[exact]
    # a high word shared by several keys (a 64-bit collision: rare): search its run by low word
    for query in np.flatnonzero(same_high & ~exact):
        end = int(np.searchsorted(held_high, high[query], side="right"))
        place = int(at[query] + np.searchsorted(held_low[at[query] : end], low[query]))
        if place < end and held_low[place] == low[query]:
            rows[query] = place
    return rows


def _publish(path: str, table: pa.Table) -> None:
    """Write a key file whole under a temporary name, then move it into place: a reader never
    sees part of one."""
    temporary = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
    with paths.open_file(temporary, "wb") as handle, pa.ipc.new_file(handle, table.schema) as out:
        out.write_table(table)
    paths.move_file(temporary, path)


def _wait_for(path: str) -> pa.Table:
    """The key file at `path` once it exists (polled, at most WAIT_SECONDS)."""
    deadline = time.monotonic() + WAIT_SECONDS
    pause = 0.001
    while not paths.exists(path):
        if time.monotonic() > deadline:
            raise EarlierShardTimeout(
                f"waited {WAIT_SECONDS:.0f} s for an earlier shard's keys ({path}): is every "
                "earlier task running?"
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    if paths.is_local(path):  # mapped: only the pages a lookup touches are read
        return pa.ipc.open_file(pa.memory_map(str(paths.local_path(path)))).read_all()
    with paths.open_file(path, "rb") as handle:
        return pa.ipc.open_file(handle).read_all()
