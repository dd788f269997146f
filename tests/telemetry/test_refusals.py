"""Writes and queries the store refuses (one line, nothing stored), and values it indexes only in
part: duplicate column names, very deep SQL expressions, multi-megabyte indexed values."""

from __future__ import annotations

import pyarrow as pa
import pytest

from keel.telemetry import (
    NamespaceOptions,
    StoreOptions,
    TelemetryInputError,
    TelemetryQueryError,
    TelemetryStore,
)
from keel.telemetry.segment import index_path

NAMESPACE = "app.events"
T = f'"{NAMESPACE}"'
SMALL = StoreOptions(background=False, row_group_rows=100, flush_rows=10**9)


def test_duplicate_column_names_are_refused_before_anything_is_created(tmp_path):
    data = pa.Table.from_arrays(
        [pa.array([1, 2]), pa.array(["a", "b"]), pa.array([3, 4])], names=["n", "s", "n"]
    )
    with TelemetryStore(tmp_path, SMALL) as store:
        with pytest.raises(TelemetryInputError) as refused:
            store.write(NAMESPACE, data)
        assert "'n'" in str(refused.value) and "\n" not in str(refused.value)
        assert NAMESPACE not in store.namespaces()
        assert not (tmp_path / NAMESPACE).exists()
        store.write("app.other", pa.table({"n": [1]}))
        with pytest.raises(TelemetryInputError):
            store.write("app.other", data.select([0, 2]))


def test_deep_expressions_are_answered_as_a_scan_or_refused_in_one_line(tmp_path):
    with TelemetryStore(tmp_path, SMALL) as store:
        store.write(NAMESPACE, pa.table({"n": pa.array(range(1_000), pa.int64())}))
        store.flush()
        deep = " + ".join(["n"] * 600)  # nests 600 deep: DuckDB's limit is 1,000
        many = " OR ".join(f"n = {i}" for i in range(0, 2_000, 2))
        for sql, reference in (
            (f"SELECT count(*) AS c FROM {T} WHERE {deep} > 5000", 991),
            (f"SELECT count(*) AS c FROM {T} WHERE {many}", 500),
            (f"SELECT count(*) AS c FROM {T} WHERE n < 500 AND ({many})", 250),
            (f"SELECT count(*) AS c FROM {T} WHERE n < 500 AND {deep} > 5000", 491),
            (f"SELECT count(*) AS c FROM {T} WHERE {' + '.join(['n'] * 1_000)} > 5000", 995),
        ):
            try:
                got = store.query(sql).column("c")[0].as_py()
            except TelemetryQueryError as error:
                assert "\n" not in str(error)
                continue
            assert got == reference, sql[:80]


def test_a_multi_megabyte_value_is_found_and_leaves_the_index_small(tmp_path):
    big = "x" * (4 << 20)
    levels = ["INFO", "WARN"] * 500
    levels[321] = big
    jobs = [f"job-{i % 50:02d}" for i in range(1_000)]
    jobs[777] = big[:-1] + "y"
    data = pa.table({"level": levels, "job": jobs, "n": pa.array(range(1_000), pa.int64())})
    options = NamespaceOptions(key_columns=("job",), bloom_columns=("job",))
    with TelemetryStore(tmp_path, SMALL) as store:
        store.create(NAMESPACE, data.schema, options)
        store.write(NAMESPACE, data)
        store.flush()
        sidecars = list((tmp_path / NAMESPACE / "segments").glob("*.idx"))
        assert sidecars and all(
            index_path(p.parent, p.stem).stat().st_size < 256 << 10 for p in sidecars
        ), f"index of {[p.stat().st_size for p in sidecars]} bytes"
        assert store.query(f"SELECT n FROM {T} WHERE level = '{big}'").column("n").to_pylist() == [
            321
        ]
        assert store.query(f"SELECT n FROM {T} WHERE job = '{jobs[777]}'").column(
            "n"
        ).to_pylist() == [777]
        assert store.query(f"SELECT n FROM {T} WHERE job LIKE '%xy'").column("n").to_pylist() == [
            777
        ]
        counts = store.query(f"SELECT length(level) AS l, count(*) AS c FROM {T} GROUP BY 1")
        assert sorted(counts.to_pylist(), key=lambda r: r["l"]) == [
            {"l": 4, "c": 999},
            {"l": 4 << 20, "c": 1},
        ]
        by_level = store.query(f"SELECT level, count(*) AS c FROM {T} GROUP BY level")
        assert sorted(by_level.column("c").to_pylist()) == [1, 499, 500]
        assert store.query(f"SELECT count(*) AS c FROM {T} WHERE job = 'job-07'").column(
            "c"
        ).to_pylist() == [20]


def test_a_deep_expression_outside_where_and_a_deep_non_select(tmp_path):
    with TelemetryStore(tmp_path, SMALL) as store:
        store.write(NAMESPACE, pa.table({"n": pa.array(range(10), pa.int64())}))
        store.flush()
        deep = " + ".join(["n"] * 300)
        got = store.query(f"SELECT n, count(*) AS c FROM {T} GROUP BY n ORDER BY {deep} DESC")
        assert got.column("n").to_pylist() == list(range(9, -1, -1))
        with pytest.raises(TelemetryQueryError) as refused:
            store.query(f"DELETE FROM {T} WHERE {' + '.join(['n'] * 600)} > 1")
        assert "\n" not in str(refused.value)


def test_picked_row_groups_are_read_right_even_with_a_file_row_number_column(tmp_path):
    """Picked row groups are read by DuckDB with a file_row_number filter, or with pyarrow when
    the namespace has a column of that name; both answer as a full scan."""
    keys = [f"k{i // 100:02d}" for i in range(2_000)]
    for extra in ("file_row_number", "other"):
        data = pa.table({"key": keys, extra: pa.array(range(2_000), pa.int64())})
        with TelemetryStore(tmp_path / extra, SMALL) as store:
            store.create(NAMESPACE, data.schema, NamespaceOptions(key_columns=("key",)))
            store.write(NAMESPACE, data)
            store.flush()
            sql = f"SELECT {extra} FROM {T} WHERE key IN ('k03', 'k11')"
            assert store.explain(sql)[0].row_groups_read == 2
            got = sorted(store.query(sql).column(extra).to_pylist())
            assert got == [*range(300, 400), *range(1_100, 1_200)]


@pytest.mark.parametrize("value", [{}, [{}], {"a": {}}], ids=["object", "in-list", "nested"])
def test_an_empty_object_is_refused_at_write_and_later_flushes_work(tmp_path, value):
    with TelemetryStore(tmp_path, SMALL) as store:
        with pytest.raises(TelemetryInputError) as refused:
            store.write(NAMESPACE, [{"ts": "2026-11-01T00:00:00", "empty": value}])
        assert "'empty'" in str(refused.value) and "\n" not in str(refused.value)
        assert NAMESPACE not in store.namespaces()
        store.write(NAMESPACE, [{"ts": "2026-11-01T00:00:00", "kept": {"a": 1}}])
        store.flush()
        assert store.query(f"SELECT kept.a AS a FROM {T}").to_pylist() == [{"a": 1}]


def test_objects_lacking_each_others_keys_in_a_list_are_refused_in_one_line(tmp_path):
    """pyarrow builds [{"ts": null}, {}, {}] as a column it cannot cast (found by tests/fuzz: a
    500 from the server): refused in one line, and the namespace is not created."""
    with TelemetryStore(tmp_path, SMALL) as store:
        with pytest.raises(TelemetryInputError) as refused:
            store.write(NAMESPACE, [{"rows": [{"ts": None}, {}, {}]}])
        assert "\n" not in str(refused.value)
        assert NAMESPACE not in store.namespaces()
        assert store.write(NAMESPACE, [{"rows": [{"ts": "x"}, {}]}]) == 1
