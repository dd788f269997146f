"""The store answers every query exactly as DuckDB does over the raw rows, in every state.

The rows come from benchmarks/telemetry_data.py (the benchmark's generator, loaded by path): 50k
log rows with a clustered needle, a spread needle and ~1% null workers. The reference is DuckDB
over the same rows as one in-memory table named like the namespace. Results are compared as
sorted lists of rows with their column names (and in order when the query orders them totally).
The states: rows only in the WAL; some in small segments and the rest in the WAL; all flushed into
several segments of several row groups; compacted; with half the sidecar indexes deleted and the
other half corrupted (after which the writer rebuilds them). A second store opened on the same
root, which only queries, must give the same answers.
"""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from keel.telemetry.manifest import load_manifest
from keel.telemetry.segment import index_path, segment_path
from keel.telemetry.sidecar import load_index
from keel.telemetry.store import StoreOptions, TelemetryStore

REPO = Path(__file__).resolve().parents[2]


def _load_generator():
    path = REPO / "benchmarks" / "telemetry_data.py"
    spec = importlib.util.spec_from_file_location("telemetry_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


telemetry_data = _load_generator()

NAMESPACE = "app.logs"
TABLE = f'"{NAMESPACE}"'
ROWS = 50_000
SEED = 11
START = datetime.datetime(2024, 5, 1, 12, 0, 0)
RARE = "needle-7f3a9c"  # clustered: one job, one ~2 s window
RARE_RATE = 2e-4  # 10 rows
SPREAD = "needle-5be21d"  # spread evenly over all rows
SPREAD_RATE = 1e-4  # 5 rows
BATCH_ROWS = 5_000

WAL_ONLY = StoreOptions(flush_rows=10**9, flush_bytes=1 << 40, flush_seconds=3600.0)
SMALL_SEGMENTS = StoreOptions(flush_rows=12_000, flush_seconds=3600.0, row_group_rows=2_000)


def at(seconds: float) -> str:
    """A TIMESTAMP literal `seconds` after the first row's time (row i is at ~i ms)."""
    return f"TIMESTAMP '{(START + datetime.timedelta(seconds=seconds)).isoformat(sep=' ')}'"


def _far_from_rare() -> str:
    """A 10 s time condition that selects none of the clustered needle's rows."""
    positions, _ = telemetry_data.needle_rows(ROWS, RARE, SEED, clustered=True, rate=RARE_RATE)
    return f"ts < {at(10)}" if positions[0] > 25_000 else f"ts > {at(40)}"


T = TABLE
QUERIES = (
    # LIKE with a rare, a spread, common and absent needles
    f"SELECT * FROM {T} WHERE msg LIKE '%{RARE}%'",
    f"SELECT ts, job_id FROM {T} WHERE msg LIKE '%{SPREAD}%'",
    f"SELECT count(*) AS n FROM {T} WHERE msg LIKE '%grad_norm=%'",
    f"SELECT job_id, worker, msg FROM {T} WHERE msg LIKE '%CUDA error%'",
    f"SELECT * FROM {T} WHERE msg LIKE '%needle-000000%'",
    f"SELECT count(*) AS n FROM {T} WHERE msg LIKE '%ab%'",
    # LIKE with _, prefixes, negation, other spellings
    f"SELECT * FROM {T} WHERE msg LIKE '%needle-7f3a_c%'",
    f"SELECT count(*) AS n FROM {T} WHERE msg LIKE 'worker lost: node-1__ exit%'",
    f"SELECT ts, msg FROM {T} WHERE msg LIKE 'CUDA error%'",
    f"SELECT count(*) AS n FROM {T} WHERE job_id LIKE 'job-0001%'",
    f"SELECT count(*) AS n FROM {T} WHERE msg NOT LIKE '%step%'",
    f"SELECT count(*) AS n FROM {T} WHERE msg ILIKE '%NEEDLE-7F3A9C%'",
    f"SELECT count(*) AS n FROM {T} WHERE msg LIKE '%=100\\%%' ESCAPE '\\'",
    f"SELECT count(*) AS n FROM {T} WHERE contains(msg, 'grad_norm=1.')",
    f"SELECT count(*) AS n FROM {T} WHERE starts_with(msg, 'worker heartbeat seq=1')",
    # equality and IN on job_id, level, worker
    f"SELECT * FROM {T} WHERE job_id = 'job-000123'",
    f"SELECT * FROM {T} WHERE 'job-000321' = job_id",
    f"SELECT * FROM {T} WHERE job_id = 'job-999999'",
    f"SELECT count(*) AS n FROM {T} WHERE level = 'CRITICAL'",
    f"SELECT count(*) AS n FROM {T} WHERE lower(level) = 'error'",
    f"SELECT ts, msg FROM {T} WHERE worker = 'w-017'",
    f"SELECT * FROM {T} WHERE job_id IN ('job-000001', 'job-000500', 'job-999999')",
    f"SELECT count(*) AS n FROM {T} WHERE level IN ('TRACE', 'CRITICAL')",
    f"SELECT ts, worker FROM {T} WHERE worker IN ('w-000', 'w-199')",
    f"SELECT count(*) AS n FROM {T} WHERE worker IS NULL",
    # GROUP BY with count(*) and ordering, plain counts
    f"SELECT level, count(*) AS n FROM {T} GROUP BY level ORDER BY level",
    f"SELECT count(*) AS n, level FROM {T} GROUP BY level ORDER BY n DESC",
    f"SELECT worker, count(*) AS n FROM {T} GROUP BY worker ORDER BY n DESC, worker LIMIT 10",
    f"SELECT worker, count(*) AS n FROM {T} GROUP BY worker ORDER BY worker NULLS FIRST",
    f"SELECT worker, count(*) AS n FROM {T} GROUP BY worker HAVING count(*) > 265",
    f"SELECT count(*) AS n FROM {T} GROUP BY level",
    f"SELECT level, count(*) AS n FROM {T} WHERE job_id = 'job-000042' GROUP BY level",
    f"SELECT count(*) AS n FROM {T}",
    f"SELECT count(*) + 1 AS n FROM {T}",
    f"SELECT count(*) AS n, count(worker) AS workers, count(DISTINCT job_id) AS jobs, "
    f"min(ts) AS first, max(ts) AS last FROM {T}",
    # time ranges
    f"SELECT count(*) AS n FROM {T} WHERE ts > {at(41.5)}",
    f"SELECT * FROM {T} WHERE ts >= {at(10)} AND ts < {at(10.5)}",
    f"SELECT count(*) AS n FROM {T} WHERE ts < {at(0.25)}",
    f"SELECT ts, level FROM {T} WHERE ts BETWEEN {at(20)} AND {at(20.2)}",
    f"SELECT count(*) AS n FROM {T} WHERE {at(30)} < ts",
    f"SELECT count(*) AS n FROM {T} WHERE ts > {at(3600)}",
    f"SELECT count(*) AS n FROM {T} WHERE ts > '2024-05-01 12:00:33.5'",
    f"SELECT count(*) AS n FROM {T} WHERE ts >= epoch_ms(1714564825000)",
    f"SELECT count(*) AS n FROM {T} WHERE ts >= TIMESTAMPTZ '2024-05-01 12:00:45+00'",
    # combinations with AND, an OR
    f"SELECT * FROM {T} WHERE level = 'ERROR' AND job_id = 'job-000042'",
    f"SELECT count(*) AS n FROM {T} WHERE ts BETWEEN {at(5)} AND {at(25)} "
    f"AND level IN ('ERROR', 'CRITICAL') AND msg LIKE '%rank%'",
    f"SELECT * FROM {T} WHERE worker = 'w-017' AND msg LIKE '%checkpoint%'",
    f"SELECT * FROM {T} WHERE job_id = 'job-000007' OR msg LIKE '%{SPREAD}%'",
    f"SELECT count(*) AS n FROM {T} WHERE level = 'CRITICAL' OR ts < {at(1)}",
    # subqueries, a CTE, a self-join: each reference to the table has its own filter
    f"SELECT * FROM {T} WHERE job_id IN (SELECT job_id FROM {T} WHERE msg LIKE '%{RARE}%') "
    f"AND {_far_from_rare()}",
    f"SELECT count(*) AS n FROM (SELECT DISTINCT worker FROM {T} WHERE level = 'CRITICAL')",
    f"WITH e AS (SELECT * FROM {T} WHERE level = 'ERROR') "
    f"SELECT worker, count(*) AS n FROM e GROUP BY worker ORDER BY n DESC, worker LIMIT 5",
    f"SELECT a.ts, b.job_id FROM {T} a JOIN {T} b ON a.job_id = b.job_id "
    f"WHERE a.msg LIKE '%{RARE}%' AND b.msg LIKE '%{SPREAD}%'",
    f"SELECT ts FROM {T} WHERE msg LIKE '%{RARE}%' UNION ALL "
    f"SELECT ts FROM {T} WHERE job_id = 'job-000500' AND ts < {at(5)}",
    # no WHERE
    f"SELECT * FROM {T}",
    f"SELECT level, worker FROM {T} ORDER BY ts DESC LIMIT 7",
)


@pytest.fixture(scope="module")
def data() -> pa.Table:
    rows = telemetry_data.log_rows(ROWS, SEED, start=START, needle=RARE, needle_rate=RARE_RATE)
    rows = telemetry_data.insert_needle(rows, SPREAD, SEED, clustered=False, rate=SPREAD_RATE)
    missing = pa.array(np.random.default_rng(SEED).random(ROWS) < 0.01)
    worker = pc.if_else(missing, pa.scalar(None, pa.string()), rows["worker"].combine_chunks())
    return rows.set_column(rows.schema.get_field_index("worker"), "worker", worker)


@pytest.fixture(scope="module")
def expected(data: pa.Table) -> dict[str, pa.Table]:
    """DuckDB's result of each query over the rows as one table named like the namespace."""
    connection = duckdb.connect()
    connection.execute("SET TimeZone = 'UTC'")  # as the store's: naive timestamps are UTC
    connection.register("raw_rows", data)
    connection.execute(f"CREATE TABLE {TABLE} AS SELECT * FROM raw_rows")
    connection.unregister("raw_rows")
    results = {sql: connection.sql(sql).to_arrow_table() for sql in QUERIES}
    connection.close()
    return results


def test_the_data_has_what_the_queries_look_for(data: pa.Table) -> None:
    def matching(token: str) -> int:
        return pc.sum(pc.match_substring(data["msg"], token)).as_py()

    assert data.num_rows == ROWS
    assert matching(RARE) == 10 and matching(SPREAD) == 5 and matching("needle-0") == 0
    rare_rows = data.filter(pc.match_substring(data["msg"], RARE))
    assert pc.count_distinct(rare_rows["job_id"]).as_py() == 1
    assert 0 < data["worker"].null_count < ROWS // 50
    assert pc.count_distinct(data["level"]).as_py() == 6


def test_rows_only_in_the_wal(tmp_path: Path, data: pa.Table, expected) -> None:
    with TelemetryStore(tmp_path, WAL_ONLY) as store:
        write_all(store, data)
        assert not list(tmp_path.rglob("*.parquet")), "nothing should be flushed yet"
        assert_equivalent(store, expected, "rows only in the WAL")
        with TelemetryStore(tmp_path) as reader:
            assert_equivalent(reader, expected, "a reader, rows only in the WAL")
        assert not list(tmp_path.rglob("*.parquet"))


def test_rows_in_segments_and_the_wal(tmp_path: Path, data: pa.Table, expected) -> None:
    with TelemetryStore(tmp_path, SMALL_SEGMENTS) as store:
        write_all(store, data)
        store.wait_idle()
        in_segments = sum(entry.rows for entry in live_segments(tmp_path))
        assert 0 < in_segments < ROWS, "expected some rows flushed and the rest in the WAL"
        assert_equivalent(store, expected, "rows in segments and in the WAL")
        with TelemetryStore(tmp_path) as reader:
            assert_equivalent(reader, expected, "a reader, rows in segments and in the WAL")


def test_rows_flushed_into_segments(tmp_path: Path, data: pa.Table, expected) -> None:
    with TelemetryStore(tmp_path, SMALL_SEGMENTS) as store:
        flushed_segments(store, tmp_path, data)
        assert_equivalent(store, expected, "flushed into segments")


def test_after_compaction(tmp_path: Path, data: pa.Table, expected) -> None:
    with TelemetryStore(tmp_path, SMALL_SEGMENTS) as store:
        before = flushed_segments(store, tmp_path, data)
        store.compact()
        store.wait_idle()
        after = live_segments(tmp_path)
        assert len(after) < len(before)
        assert sum(entry.rows for entry in after) == ROWS
        assert_equivalent(store, expected, "after compaction")
        with TelemetryStore(tmp_path) as reader:  # the replaced segments' files are still there
            assert_equivalent(reader, expected, "a reader, after compaction")


def test_deleted_and_corrupted_indexes(tmp_path: Path, data: pa.Table, expected) -> None:
    """Half the sidecars deleted, the other half corrupted: queries read those segments whole
    and still give DuckDB's answers; the writer then rebuilds every sidecar."""
    with TelemetryStore(tmp_path, SMALL_SEGMENTS) as store:
        segments = flushed_segments(store, tmp_path, data)
    directory = tmp_path / NAMESPACE / "segments"
    for number, entry in enumerate(segments):
        path = index_path(directory, entry.name)
        assert load_index(path, entry.checksum) is not None
        if number % 2:
            corrupt(path)
            assert path.exists() and load_index(path, entry.checksum) is None
        else:
            path.unlink()

    with TelemetryStore(tmp_path) as reader:  # not the writer: it scans, never repairs
        assert_equivalent(reader, expected, "a reader, indexes deleted and corrupted")
    with TelemetryStore(tmp_path, SMALL_SEGMENTS) as store:
        store.flush()  # take the writer's role (a server does on its first write): it repairs
        store.query(f"SELECT count(*) AS n FROM {TABLE} WHERE msg LIKE '%{RARE}%'")
        store.wait_idle()
        for entry in segments:
            path = index_path(directory, entry.name)
            assert path.exists(), f"{path.name} was not rebuilt"
            assert load_index(path, entry.checksum) is not None, f"{path.name} is not valid"
        assert_equivalent(store, expected, "indexes rebuilt")


# -- helpers ---------------------------------------------------------------------------------


def write_all(store: TelemetryStore, data: pa.Table) -> None:
    for offset in range(0, data.num_rows, BATCH_ROWS):
        assert store.write(NAMESPACE, data.slice(offset, BATCH_ROWS)) == BATCH_ROWS


def flushed_segments(store: TelemetryStore, root: Path, data: pa.Table) -> list:
    """Write `data`, flush it all; the live segments (several, of several row groups each)."""
    write_all(store, data)
    store.flush()
    store.wait_idle()
    segments = live_segments(root)
    assert len(segments) >= 3 and max(entry.row_groups for entry in segments) >= 3
    directory = root / NAMESPACE / "segments"
    assert all(
        pq.ParquetFile(segment_path(directory, e.name)).metadata.num_rows == e.rows
        for e in segments
    )
    return segments


def live_segments(root: Path) -> list:
    manifest = load_manifest(root / NAMESPACE)
    return list(manifest.segments) if manifest is not None else []


def corrupt(path: Path) -> None:
    """Flip 64 bytes in the middle of the file (same size, so only a checksum can tell)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for position in range(middle, min(middle + 64, len(data))):
        data[position] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_equivalent(store: TelemetryStore, expected: dict[str, pa.Table], state: str) -> None:
    """Every query's result equals DuckDB's; the failure lists each query that differs."""
    failures = []
    for sql in QUERIES:
        try:
            got = store.query(sql)
        except Exception as error:  # recorded with the query; the test fails below
            failures.append(f"{sql}\n    raised {type(error).__name__}: {error}")
            continue
        ordered = "ORDER BY" in sql.split("FROM")[-1]
        problem = difference(got, expected[sql], ordered=ordered)
        if problem:
            failures.append(f"{sql}\n    {problem}")
    assert not failures, (
        f"{state}: {len(failures)} of {len(QUERIES)} queries differ from DuckDB:\n"
        + "\n".join(failures)
    )


def difference(got: pa.Table, expected: pa.Table, *, ordered: bool) -> str | None:
    """How `got` differs from `expected` (None if it does not): columns, then rows."""
    if got.column_names != expected.column_names:
        return f"columns {got.column_names}, expected {expected.column_names}"
    unique_names = len(set(got.column_names)) == got.num_columns
    if got.num_rows == expected.num_rows and got.schema.equals(expected.schema) and unique_names:
        if not ordered:  # sorted by every column; null last in both
            keys = [(name, "ascending") for name in got.column_names]
            got, expected = got.sort_by(keys), expected.sort_by(keys)
        if got.equals(expected):
            return None
    got_rows, expected_rows = rows_of(got), rows_of(expected)
    if not ordered:
        got_rows, expected_rows = sorted(got_rows, key=_key), sorted(expected_rows, key=_key)
    if got_rows == expected_rows:
        return None
    if len(got_rows) != len(expected_rows):
        return f"{len(got_rows)} rows, expected {len(expected_rows)}"
    pairs = zip(got_rows, expected_rows, strict=True)
    first = next(i for i, (mine, theirs) in enumerate(pairs) if mine != theirs)
    return f"row {first} is {got_rows[first]}, expected {expected_rows[first]}"


def rows_of(table: pa.Table) -> list[tuple]:
    return list(zip(*(column.to_pylist() for column in table.columns), strict=True))


def _key(row: tuple) -> tuple:
    return tuple((value is None, value) for value in row)
