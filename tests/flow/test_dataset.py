"""The Dataset API on the local backend: each operation's meaning, the plan, the outputs."""

import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from keel.core.errors import UsageError
from keel.flow import TaskFailedError, from_items, read_jsonl, read_parquet

ROWS = [{"id": i % 7, "n": i, "text": f"row {i}"} for i in range(100)]


def _stages(plan: str) -> int:
    return sum(line.startswith("stage ") for line in plan.splitlines())


def test_narrow_operations_fuse_into_one_stage_and_compute_the_right_rows(pool):
    ds = (
        from_items(ROWS, num_shards=3)
        .map(lambda r: {**r, "double": r["n"] * 2})
        .flat_map(lambda r: [r, {**r, "n": -r["n"]}] if r["n"] < 5 else [r])
        .filter(lambda r: r["n"] % 2 == 0)
        .filter(pc.field("double") >= 4)
        .map_batches(lambda b: b.append_column("tag", pa.array(["x"] * b.num_rows)))
        .select("n", "double", "tag")
    )
    plan = ds.explain()
    assert _stages(plan) == 1 and "map(" in plan and "select(n, double, tag)" in plan
    rows = ds.to_table(backend=pool).to_pylist()
    expected = [{"n": n, "double": 2 * abs(n), "tag": "x"} for n in [-2, -4, 2, 4]]
    expected += [{"n": n, "double": 2 * n, "tag": "x"} for n in range(6, 100, 2)]
    assert sorted(rows, key=lambda r: (r["double"], r["n"])) == sorted(
        expected, key=lambda r: (r["double"], r["n"])
    )


def test_wide_operations_cut_stages(pool):
    ds = from_items(ROWS, 2).map(lambda r: r).deduplicate("id", 3).map(lambda r: r).repartition(2)
    plan = ds.explain()
    assert _stages(plan) == 3
    assert "shuffle by deduplicate('id', 3 shards)" in plan and "repartition(2)" in plan


def test_deduplicate_keeps_the_first_row_of_each_key_in_input_order(pool):
    rows = from_items(ROWS, num_shards=4).deduplicate("id", num_shards=3).to_table(backend=pool)
    kept = sorted(rows.to_pylist(), key=lambda r: r["id"])
    assert kept == [{"id": i, "n": i, "text": f"row {i}"} for i in range(7)]


def test_deduplicate_by_a_function_key(pool):
    ds = from_items(ROWS, 3).deduplicate(lambda r: r["n"] // 10, num_shards=2)
    assert sorted(r["n"] for r in ds.to_table(backend=pool).to_pylist()) == list(range(0, 100, 10))


def test_group_by_calls_the_reducer_once_per_key_with_rows_in_input_order(pool):
    def summarize(key, rows):
        return {"id": key, "count": len(rows), "ns": [r["n"] for r in rows]}

    table = from_items(ROWS, 4).group_by("id", summarize, num_shards=3).to_table(backend=pool)
    groups = {row["id"]: row for row in table.to_pylist()}
    assert sorted(groups) == list(range(7))
    for key, row in groups.items():
        assert row["ns"] == [n for n in range(100) if n % 7 == key]
        assert row["count"] == len(row["ns"])


def test_group_by_with_a_combiner_gives_the_same_totals(pool):
    def total(key, rows):
        return {"id": key, "sum": sum(r["sum"] if "sum" in r else r["n"] for r in rows)}

    plain = from_items(ROWS, 4).group_by("id", total, 2).to_table(backend=pool)
    combined = from_items(ROWS, 4).group_by("id", total, 2, combiner=total).to_table(backend=pool)
    assert sorted(plain.to_pylist(), key=str) == sorted(combined.to_pylist(), key=str)


def test_reducer_may_return_many_rows_or_none(pool):
    def explode(key, rows):
        return None if key == 0 else [{"id": key, "i": i} for i in range(key)]

    rows = from_items(ROWS, 2).group_by("id", explode, 2).to_table(backend=pool).to_pylist()
    assert len(rows) == sum(range(7))


def _first_and_count(rows: pa.Table, starts: np.ndarray) -> pa.Table:
    """group_batches reducer: per key, its first row's n, its rows' count and all its ns."""
    ends = np.append(starts[1:], rows.num_rows)
    ns = rows.column("n").to_pylist()
    return pa.table(
        {
            "id": rows.column("id").take(starts),
            "first": rows.column("n").take(starts),
            "count": pa.array(ends - starts),
            "ns": [ns[start:end] for start, end in zip(starts, ends, strict=True)],
        }
    )


def test_group_batches_gives_each_key_one_run_in_input_order(pool):
    table = from_items(ROWS, 4).group_batches("id", _first_and_count, 3).to_table(backend=pool)
    groups = {row["id"]: row for row in table.to_pylist()}
    assert sorted(groups) == list(range(7))  # one run per key: never split over calls
    for key, row in groups.items():
        assert row["ns"] == [n for n in range(100) if n % 7 == key]  # input order
        assert (row["first"], row["count"]) == (key, len(row["ns"]))


def _partition_keys(rows: pa.Table, starts: None) -> pa.Table:
    """unsorted group_batches reducer: one row per call, its rows' ids and ns as they came."""
    assert starts is None
    return pa.table({"ids": [rows.column("id").to_pylist()], "ns": [rows.column("n").to_pylist()]})


def test_unsorted_group_batches_gives_each_key_to_one_call_in_input_order(pool):
    unsorted = from_items(ROWS, 4).group_batches("id", _partition_keys, 3, sort_by_key=False)
    assert "unsorted" in unsorted.explain()
    calls = unsorted.to_table(backend=pool).to_pylist()
    assert sorted(n for call in calls for n in call["ns"]) == list(range(100))
    for call in calls:
        assert call["ns"] == sorted(call["ns"])  # input order, not grouped by key
        others = [n for other in calls if other is not call for n in other["ns"]]
        assert not set(call["ids"]) & {n % 7 for n in others}  # a key's rows: all in one call
    assert any(call["ids"] != sorted(call["ids"]) for call in calls)  # really not sorted


def test_positions_place_each_row_the_same_on_every_read(pool, tmp_path):
    for name, rows in (("a", 3), ("b", 2)):
        pq.write_table(pa.table({"n": list(range(rows))}), tmp_path / f"{name}.parquet")
    read = read_parquet(str(tmp_path / "*.parquet"), position_column="at", filter=pc.field("n") > 0)
    first, again = (read.to_table(backend=pool).column("at").to_pylist() for _ in range(2))
    # (file << 40) | row within the file; the filter runs in the reader, before the count
    assert first == again == [0, 1, 1 << 40]
    items = from_items(ROWS[:4], 2, position_column="at").to_table(backend=pool)
    assert items.column("at").to_pylist() == [0, 1, 1 << 40, (1 << 40) + 1]


def test_repartition_keeps_every_row_and_spreads_them(pool, tmp_path):
    result = from_items(ROWS, 1).repartition(4).write_parquet(tmp_path / "out", backend=pool)
    sizes = [pq.read_metadata(f).num_rows for f in result.files]
    assert sum(sizes) == 100 and len(sizes) == 4 and min(sizes) > 10
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["_SUCCESS"] + [f"part-0000{i}-of-00004.parquet" for i in range(4)]


def test_sort_orders_rows_within_each_shard(pool):
    rows = from_items(ROWS, 1).sort("n", descending=True).to_table(backend=pool).to_pylist()
    assert [r["n"] for r in rows] == list(range(99, -1, -1))
    with pytest.raises(UsageError, match="one sort or mark_later_copies per stage"):
        from_items(ROWS).sort("n").sort("id").explain()


def test_take_and_count(pool):
    ds = from_items(ROWS, 2).filter(lambda r: r["n"] >= 50)
    assert ds.count(backend=pool) == 50
    assert [r["n"] for r in ds.take(3, backend=pool)] == [50, 51, 52]
    assert from_items(ROWS, 2).filter(lambda r: False).take(3, backend=pool) == []  # not 3 {}


def test_write_jsonl_then_read_it_back(pool, tmp_path):
    from_items(ROWS, 2).write_jsonl(tmp_path / "j", backend=pool)
    back = read_jsonl(str(tmp_path / "j" / "*.jsonl")).to_table(backend=pool).to_pylist()
    assert back == ROWS
    first = (tmp_path / "j" / "part-00000-of-00002.jsonl").read_text().splitlines()[0]
    assert json.loads(first) == ROWS[0]


def test_target_file_size_splits_output_files(pool, tmp_path):
    random = np.random.default_rng(0)
    big = [{"n": i, "text": random.bytes(500).hex()} for i in range(2000)]
    result = from_items(big, 1).write_parquet(
        tmp_path / "p", target_file_bytes=200_000, backend=pool, chunk_rows=200
    )
    assert len(result.files) > 1
    assert sum(pq.read_metadata(f).num_rows for f in result.files) == 2000


def test_read_parquet_pushes_down_columns_and_filter(pool, tmp_path):
    from_items(ROWS, 2).write_parquet(tmp_path / "p", backend=pool)
    ds = read_parquet(str(tmp_path / "p" / "*.parquet"), columns=["n"], filter=pc.field("n") < 10)
    assert "columns ['n']" in ds.explain()
    assert ds.to_table(backend=pool).to_pylist() == [{"n": i} for i in range(10)]


def test_counters_report_rows_and_spill(pool, tmp_path):
    result = from_items(ROWS, 2).deduplicate("id", 2).write_parquet(tmp_path / "o", backend=pool)
    first, second = result.stages
    assert (first.rows_in, first.rows_out, second.rows_in, second.rows_out) == (100, 100, 100, 7)
    assert first.bytes_spilled > 0 and result.retries == 0 and result.rows == 7


def test_output_to_an_fsspec_url(pool):
    import fsspec

    fsspec.filesystem("memory").store.clear()
    result = from_items(ROWS, 2).write_parquet("memory://bucket/out", backend=pool)
    assert result.files == [
        "memory://bucket/out/part-00000-of-00002.parquet",
        "memory://bucket/out/part-00001-of-00002.parquet",
    ]
    with fsspec.open(result.files[1], "rb") as handle:
        assert pq.read_table(handle).num_rows == 50


def test_a_user_function_error_names_stage_task_and_shard(pool):
    def broken(row):
        if row["n"] < 50:  # only shard 0 of 2
            raise ValueError(f"cannot handle row {row['n']}")
        return row

    with pytest.raises(TaskFailedError) as caught:
        from_items(ROWS, 2).map(broken).count(backend=pool, retries=1)
    message = str(caught.value)
    assert "stage 0" in message and "task 0 (items shard 0 of 2)" in message
    assert "after 2 attempts" in message and "ValueError: cannot handle row 0" in message


def test_a_map_that_returns_no_dict_fails_at_once(pool):
    with pytest.raises(TaskFailedError, match=r"after 1 attempt: map function .* returned a int"):
        from_items(ROWS, 1).map(lambda r: 1).count(backend=pool)


def test_unknown_run_option_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown run option"):
        from_items(ROWS).count(wrkers=2)


def test_a_run_that_keeps_nothing_reads_back_as_an_empty_dataset(pool, tmp_path):
    result = from_items(ROWS, 2).filter(lambda r: False).write_parquet(tmp_path / "o", backend=pool)
    assert result.files == [] and (tmp_path / "o" / "_SUCCESS").exists()
    empty = read_parquet(str(tmp_path / "o" / "part-*.parquet"))
    assert empty.count(backend=pool) == 0
    assert empty.deduplicate("id").count(backend=pool) == 0
    with pytest.raises(UsageError, match="no input files match"):
        read_parquet(str(tmp_path / "missing" / "part-*.parquet"))


def test_file_column_names_each_rows_file(pool, tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text('{"n": 1}\n{"n": 2}\n')
    rows = read_jsonl(str(tmp_path / "*.jsonl"), file_column="path").to_table(backend=pool)
    assert (
        rows.column("path").to_pylist()
        == [str(tmp_path / "a.jsonl")] * 2 + [str(tmp_path / "b.jsonl")] * 2
    )


def test_write_parquet_sets_marked_rows_aside_in_the_same_pass(pool, tmp_path):
    def mark(batch: pa.RecordBatch) -> pa.RecordBatch:
        odd = pc.equal(pc.bit_wise_and(batch.column("n"), 1), 1)
        reason = pc.if_else(odd, "odd", pa.scalar(None, pa.string()))
        odd_n = pc.if_else(odd, batch.column("n"), pa.scalar(None, pa.int64()))
        return batch.append_column("why", reason).append_column("odd_n", odd_n)

    ds = from_items(ROWS, num_shards=3).map_batches(mark)
    aside = ["why", "odd_n"]
    result = ds.write_parquet(tmp_path / "even", options=None, backend=pool, aside=aside)
    written = pq.read_table(tmp_path / "even")
    assert written.column_names == ["id", "n", "text"]  # the aside columns are not written
    assert written.column("n").to_pylist() == list(range(0, 100, 2))
    assert result.rows == 50
    assert result.aside.column_names == aside
    assert result.aside.column("odd_n").to_pylist() == list(range(1, 100, 2))  # input order
    assert set(result.aside.column("why").to_pylist()) == {"odd"}

    def slow_first(row):  # shard 0 finishes last, so the handler must wait for it
        if row["n"] == 0:
            time.sleep(0.5)
        return row

    handed: list[list[int]] = []
    result = (
        from_items(ROWS, num_shards=4)
        .map(slow_first)
        .map_batches(mark)
        .write_parquet(
            tmp_path / "handed",
            backend=pool,
            aside=aside,
            on_aside=lambda table: handed.append(table.column("odd_n").to_pylist()),
        )
    )
    assert result.aside is None and pq.read_table(tmp_path / "handed").equals(written)
    assert handed == [[n for n in range(start, start + 25) if n % 2] for start in (0, 25, 50, 75)]
