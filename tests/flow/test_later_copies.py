"""mark_later_copies: every row whose key an earlier row holds names that key's first row, shards
in input order telling the later ones their keys; with 1 and 2 workers, a killed worker, shards
without rows, on Ray, and keys whose first 64 bits collide."""

import os
import random
import signal
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from keel.core.errors import UsageError
from keel.flow import LocalBackend, TaskFailedError, from_items, later_copies
from keel.flow.ops import MarkLaterCopies

TEXTS = [f"text {random.Random(n).randint(0, 150)}" for n in range(600)]
ROWS = [{"id": f"r{n}", "text": text} for n, text in enumerate(TEXTS)]


def _keyed(batch: pa.RecordBatch) -> pa.RecordBatch:
    digests = [xxhash.xxh3_128_digest(text.encode()) for text in batch.column("text").to_pylist()]
    return batch.append_column("key", pa.array(digests, pa.binary(16)))


def _expected(rows: list[dict]) -> list[str | None]:
    """What mark_later_copies must give each row, from a plain dict over input order."""
    first: dict[str, str] = {}
    marks = []
    for row in rows:
        marks.append(first.get(row["text"]))
        first.setdefault(row["text"], row["id"])
    return marks


def _marks(dataset, **options) -> list[str | None]:
    marked = dataset.map_batches(_keyed).mark_later_copies("key", carry="id", into="first")
    return marked.to_table(**options).column("first").to_pylist()


@pytest.mark.parametrize("shards", [1, 3, 8])
@pytest.mark.parametrize("workers", [1, 2])
def test_each_later_copy_names_the_first_in_input_order(shards, workers):
    marks = _marks(from_items(ROWS, shards), workers=workers, progress=False)
    assert marks == _expected(ROWS)
    assert marks.count(None) == len(set(TEXTS))  # one first copy per text


def test_shards_with_no_rows_tell_the_later_shards_so():
    kept = [row for n, row in enumerate(ROWS) if n < 150 or n >= 450]
    emptied = from_items(ROWS, 4).filter(lambda row: not 150 <= int(row["id"][1:]) < 450)
    assert _marks(emptied, workers=2, progress=False) == _expected(kept)  # shards 1, 2: no rows
    nothing = from_items(ROWS, 4).filter(lambda row: False).map_batches(_keyed)
    assert nothing.mark_later_copies("key", "id", "first").count(workers=2, progress=False) == 0


def test_a_killed_worker_is_retried_and_the_marks_are_unchanged(tmp_path):
    marker = tmp_path / "killed"

    def die_once(row):
        if row["id"] == "r320" and not marker.exists():  # mid-way through shard 2 of 4
            marker.write_text("killed once")
            os.kill(os.getpid(), signal.SIGKILL)
        return row

    with LocalBackend(workers=2) as backend:
        dataset = from_items(ROWS, 4).map(die_once).map_batches(_keyed)
        marked = dataset.mark_later_copies("key", carry="id", into="first")
        result = marked.to_table(backend=backend, progress=False)
    assert marker.exists()
    assert result.column("first").to_pylist() == _expected(ROWS)


def test_a_rerun_with_a_checkpoint_runs_every_shard_again(tmp_path):
    """A checkpointed task returns what it recorded without running: a shard of
    mark_later_copies must run, or the later shards would wait for keys it never publishes."""

    def fail_in_shard_2(row):
        if row["id"] == "r320" and not (tmp_path / "failed").exists():
            (tmp_path / "failed").write_text("once")
            raise UsageError("a fact about the data: not retried")
        return row

    marked = (
        from_items(ROWS, 4)
        .map(fail_in_shard_2)
        .map_batches(_keyed)
        .mark_later_copies("key", carry="id", into="first")
    )
    checkpoint = str(tmp_path / "checkpoint")
    with LocalBackend(workers=2) as backend, pytest.raises(TaskFailedError, match="not retried"):
        marked.write_parquet(tmp_path / "out", backend=backend, checkpoint=checkpoint)
    with LocalBackend(workers=2) as backend:
        marked.write_parquet(tmp_path / "out", backend=backend, checkpoint=checkpoint)
    written = pq.read_table(tmp_path / "out").column("first").to_pylist()
    assert written == _expected(ROWS)


def test_a_key_that_is_not_16_bytes_or_a_carry_with_nulls_is_refused_naming_the_column():
    dataset = from_items(ROWS, 2).mark_later_copies("text", carry="id", into="first")
    with pytest.raises(TaskFailedError, match=r"needs 'text' to hold 16-byte keys"):
        dataset.count(workers=1, progress=False)
    unnamed = [dict(row, id=None) if n == 7 else row for n, row in enumerate(ROWS)]
    keyed = from_items(unnamed, 2).map_batches(_keyed)
    with pytest.raises(TaskFailedError, match=r"needs 'id' without nulls"):
        keyed.mark_later_copies("key", carry="id", into="first").count(workers=1, progress=False)


def test_the_plan_names_the_operation_and_what_runs_after_it():
    plan = (
        from_items(ROWS, 2)
        .map_batches(_keyed)
        .mark_later_copies("key", carry="id", into="first")
        .select("id", "first")
        .explain()
    )
    assert "| mark_later_copies('key', carry 'id' into 'first') per shard" in plan
    assert "after mark_later_copies: select(id, first)" in plan


def test_keys_sharing_their_first_64_bits_are_told_apart(tmp_path):
    """Shard 0's key file, sorted by (high, low), holds a run of three keys with one high word:
    each query in shard 1 finds its own row, and one with that high word but another low word
    finds none."""

    def key(high: int, low: int) -> bytes:
        return np.array([high, low], dtype=np.uint64).tobytes()

    earlier = [key(3, 3), key(5, 9), key(7, 1), key(7, 4), key(7, 8), key(9, 2)]  # shard 0
    rows = [{"id": f"e{n}", "key": k} for n, k in enumerate(earlier)]
    queries = [key(7, 8), key(7, 4), key(7, 5), key(7, 1), key(9, 2), key(8, 8)]
    rows += [{"id": f"q{n}", "key": k} for n, k in enumerate(queries)]
    typed = from_items(rows, 2).map_batches(
        lambda b: b.set_column(1, "key", b.column("key").cast(pa.binary(16)))
    )
    marked = typed.mark_later_copies("key", carry="id", into="first")
    marks = marked.to_table(workers=1, progress=False).column("first").to_pylist()
    assert marks[len(earlier) :] == ["e4", "e3", None, "e2", "e5", None]


def test_a_task_waiting_past_the_bound_fails_naming_the_missing_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(later_copies, "WAIT_SECONDS", 0.2)
    table = _keyed(pa.RecordBatch.from_pylist(ROWS[:10]))
    op = MarkLaterCopies("key", "id", "first")
    with pytest.raises(later_copies.EarlierShardTimeout, match=r"keys-00000\.arrow"):
        later_copies.mark(pa.Table.from_batches([table]), op, 1, str(tmp_path))
    assert Path(later_copies.keys_file(str(tmp_path), 1)).exists()  # published before waiting


@pytest.mark.ray
def test_the_marks_are_the_same_on_ray():
    pytest.importorskip("ray")
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)  # Ray's workers cannot import this file
    try:
        marks = _marks(from_items(ROWS, 4), backend="ray", workers=2, progress=False)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    assert marks == _expected(ROWS)
