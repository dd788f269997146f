"""Time columns: far-future placeholders answered exactly, epoch numbers read only in a declared
unit, times no reader could show refused at write with one line naming the column and value."""

from __future__ import annotations

import datetime
import time

import duckdb
import pyarrow as pa
import pytest

from keel.telemetry import NamespaceOptions, StoreOptions, TelemetryInputError, TelemetryStore

NAMESPACE = "app.events"
T = f'"{NAMESPACE}"'
START = datetime.datetime(2024, 5, 1)
PLACEHOLDER = datetime.datetime(9999, 12, 31)
SMALL = StoreOptions(background=False, row_group_rows=100, flush_rows=10**9)


def rows_with_a_placeholder(kind: pa.DataType) -> pa.Table:
    """1,000 rows a second apart from START, and row 500's time set to 9999-12-31."""
    stamps = [START + datetime.timedelta(seconds=i) for i in range(1_000)]
    stamps[500] = PLACEHOLDER
    return pa.table({"ts": pa.array(stamps, kind), "n": pa.array(range(1_000), pa.int64())})


def at(seconds: float) -> str:
    return f"TIMESTAMP '{(START + datetime.timedelta(seconds=seconds)).isoformat(sep=' ')}'"


FAR = "TIMESTAMP '9999-12-31'"
TIME_QUERIES = [
    f"SELECT n FROM {T} WHERE ts > {at(900)}",
    f"SELECT n FROM {T} WHERE ts >= {at(900)}",
    f"SELECT n FROM {T} WHERE ts < {at(100)}",
    f"SELECT n FROM {T} WHERE ts <= {at(100)}",
    f"SELECT n FROM {T} WHERE ts BETWEEN {at(450)} AND {FAR}",
    f"SELECT n FROM {T} WHERE ts BETWEEN {at(450)} AND {at(550)}",
    f"SELECT n FROM {T} WHERE {at(900)} < ts",
    f"SELECT n FROM {T} WHERE {at(900)} <= ts",
    f"SELECT n FROM {T} WHERE {at(100)} > ts",
    f"SELECT n FROM {T} WHERE {at(100)} >= ts",
    f"SELECT n FROM {T} WHERE ts = {FAR}",
    f"SELECT n FROM {T} WHERE ts >= {FAR}",
    f"SELECT n FROM {T} WHERE ts > TIMESTAMP '3000-01-01'",
    f"SELECT n FROM {T} WHERE ts < TIMESTAMP '3000-01-01' AND ts > {at(990)}",
]


@pytest.mark.parametrize("unit", ["s", "ms", "us"])
def test_a_9999_12_31_row_is_found_by_every_time_range(tmp_path, unit):
    data = rows_with_a_placeholder(pa.timestamp(unit))
    reference = duckdb.connect()
    reference.execute("SET TimeZone = 'UTC'")
    reference.register("raw", data)
    reference.execute(f"CREATE TABLE {T} AS SELECT * FROM raw")
    with TelemetryStore(tmp_path, SMALL) as store:
        store.write(NAMESPACE, data)
        store.flush()
        for sql in TIME_QUERIES:
            got = sorted(store.query(sql).column("n").to_pylist())
            expected = sorted(reference.sql(sql).to_arrow_table().column("n").to_pylist())
            assert got == expected, f"{sql}: {len(got)} rows, a full scan gives {len(expected)}"
        full = store.query(f"SELECT max(ts) AS m FROM {T}").column("m")[0].as_py()
        assert full == PLACEHOLDER


def test_times_past_year_9999_are_refused_at_write_naming_the_column(tmp_path):
    done_at = pa.array([0, 10**18], pa.int64()).cast(pa.timestamp("us"))  # 1970, year 33658
    data = pa.table({"ts": pa.array([START, START], pa.timestamp("us")), "done_at": done_at})
    with TelemetryStore(tmp_path, SMALL) as store:
        with pytest.raises(TelemetryInputError) as refused:
            store.write(NAMESPACE, data)
        message = str(refused.value)
        assert "done_at" in message and "33658" in message and "\n" not in message
        assert NAMESPACE not in store.namespaces()


def test_json_epoch_numbers_are_refused_without_a_time_unit(tmp_path):
    with TelemetryStore(tmp_path, SMALL) as store:
        for number in (time.time_ns(), int(time.time() * 1000), int(time.time()), time.time()):
            with pytest.raises(TelemetryInputError) as refused:
                store.write(NAMESPACE, [{"ts": number, "n": 1}])
            assert "ts" in str(refused.value) and "time_unit" in str(refused.value)
        assert NAMESPACE not in store.namespaces()
        store.write(NAMESPACE, [{"ts": "2024-05-01T00:00:01", "n": 1}])
        with pytest.raises(TelemetryInputError, match="time_unit"):
            store.write(NAMESPACE, [{"ts": 1714521601, "n": 2}])
        assert store.query(f"SELECT count(*) AS c FROM {T}").column("c")[0].as_py() == 1


@pytest.mark.parametrize(("unit", "scale"), [("s", 1), ("ms", 10**3), ("us", 10**6), ("ns", 10**9)])
def test_json_epoch_numbers_are_read_in_the_declared_time_unit(tmp_path, unit, scale):
    epoch = 1714521601  # 2024-05-01T00:00:01Z
    schema = pa.schema([("ts", pa.timestamp("us")), ("n", pa.int64())])
    with TelemetryStore(tmp_path, SMALL) as store:
        store.create(NAMESPACE, schema, NamespaceOptions(time_unit=unit))
        store.write(NAMESPACE, [{"ts": epoch * scale, "n": 1}, {"ts": "2024-05-01", "n": 2}])
        with pytest.raises(TelemetryInputError) as refused:  # past 9999 in every unit
            store.write(NAMESPACE, [{"ts": time.time_ns() * 10**9, "n": 3}])
        assert "ts" in str(refused.value) and "\n" not in str(refused.value)
        got = store.query(f"SELECT ts FROM {T} ORDER BY n").column("ts").to_pylist()
        assert got == [datetime.datetime(2024, 5, 1, 0, 0, 1), datetime.datetime(2024, 5, 1)]


def test_a_time_unit_must_be_one_of_the_four():
    with pytest.raises(TelemetryInputError, match="time_unit"):
        NamespaceOptions(time_unit="minutes")
