"""Segment layout: each row group keeps the rows key and time clustering gave it, grouped inside by
the lowest-cardinality column, so `level = 'ERROR'` is one run of rows per row group; results
still equal a full scan, before and after compaction."""

import itertools
from datetime import datetime, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from keel.telemetry import NamespaceOptions, StoreOptions, TelemetryStore
from keel.telemetry.segment import group_order_column, row_group_order, segment_path

START = datetime(2026, 11, 1)
LEVELS = ("INFO", "DEBUG", "WARN", "ERROR")
ROW_GROUP_ROWS = 500


def log_table(rows: int, first: int = 0) -> pa.Table:
    index = np.arange(first, first + rows)
    rng = np.random.default_rng(first)
    return pa.table(
        {
            "ts": pa.array(
                [START + timedelta(milliseconds=int(i)) for i in index], pa.timestamp("us")
            ),
            "job_id": [f"job-{j:03d}" for j in rng.integers(0, 97, rows)],
            "level": [LEVELS[j] for j in rng.integers(0, 4, rows)],
            "worker": [f"w-{j:02d}" for j in rng.integers(0, 30, rows)],
            "msg": [f"request {i} took {rng.integers(1, 900)} ms" for i in index],
        }
    )


def level_runs(segment) -> list[tuple[int, int]]:
    """(runs of equal levels, distinct levels) of each row group of a segment file."""
    parquet = pq.ParquetFile(segment)
    runs = []
    for group in range(parquet.num_row_groups):
        levels = parquet.read_row_group(group, columns=["level"]).column("level").to_pylist()
        changes = sum(a != b for a, b in itertools.pairwise(levels))
        runs.append((changes + 1, len(set(levels))))
    return runs


def test_row_groups_hold_one_run_per_level_and_answers_equal_a_scan(tmp_path):
    tables = [log_table(2_000, first) for first in range(0, 16_000, 2_000)]
    raw = pa.concat_tables(tables)
    options = StoreOptions(flush_rows=8_000, row_group_rows=ROW_GROUP_ROWS, background=False)
    window = (
        "ts >= TIMESTAMP '2026-11-01 00:00:05' AND ts < TIMESTAMP '2026-11-01 00:00:06'"
        " AND level = 'ERROR'"
    )
    expected = [
        row
        for row in raw.to_pylist()
        if START + timedelta(seconds=5) <= row["ts"] < START + timedelta(seconds=6)
        and row["level"] == "ERROR"
    ]
    with TelemetryStore(tmp_path, options) as store:
        for table in tables:
            store.write("app.logs", table)
        store.flush()
        segments = sorted((tmp_path / "app.logs" / "segments").glob("*.parquet"))
        assert len(segments) == 2
        for segment in segments:
            for runs, distinct in level_runs(segment):
                assert runs == distinct
        query = f'SELECT * FROM "app.logs" WHERE {window} ORDER BY ts'
        assert store.query(query).to_pylist() == expected
        job = "SELECT count(*) AS n FROM \"app.logs\" WHERE job_id = 'job-042'"
        assert store.query(job).column("n").to_pylist() == [
            raw.column("job_id").to_pylist().count("job-042")
        ]
        assert store.explain(job)[0].row_groups_read <= 4  # one or two row groups per segment

        report = store.compact()
        [merged] = report.written["app.logs"]
        for runs, distinct in level_runs(segment_path(segments[0].parent, merged)):
            assert runs == distinct
        assert store.query(query).to_pylist() == expected
        assert store.query('SELECT count(*) AS n FROM "app.logs"').column("n")[0].as_py() == 16_000


def test_the_order_column_is_the_one_with_fewest_values():
    table = log_table(3_000)
    options = NamespaceOptions()
    assert group_order_column(table, options, exclude=["job_id", "ts"]) == "level"
    assert group_order_column(table, options, exclude=["level"]) == "worker"
    declared = NamespaceOptions(count_columns=("worker",))
    assert group_order_column(table, declared, exclude=["job_id", "ts"]) == "worker"
    unique = pa.table({"id": [f"r{i}" for i in range(1_000)], "one": ["x"] * 1_000})
    assert group_order_column(unique, options, exclude=[]) is None


def test_rows_stay_in_their_row_group_and_in_order_within_a_value():
    codes = np.array([2, 0, 2, 1, 0, 1, 1, 2, 0, 0])
    order = row_group_order(codes, 4)
    assert order.tolist() == [1, 3, 0, 2, 4, 5, 6, 7, 8, 9]
