"""The telemetry store as a user relies on it: durable writes, clear rejections, pruning that
never changes a result, compaction and retention."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
from datetime import datetime, timedelta

import numpy as np
import pyarrow as pa
import pytest

from keel.telemetry import (
    NamespaceOptions,
    StoreBusyError,
    StoreOptions,
    TelemetryInputError,
    TelemetryQueryError,
    TelemetryStore,
)
from keel.telemetry.shared import SharedStore
from keel.telemetry.wal import generation_path, generations

START = datetime(2026, 11, 1)


def log_table(rows: int, *, first: int = 0, needle_at: tuple[int, ...] = ()) -> pa.Table:
    index = np.arange(first, first + rows)
    rng = np.random.default_rng(first)
    messages = [
        f"request {i} served in {rng.integers(1, 900)} ms by pool-{i % 7}"
        + (" needle-4e1f" if i in needle_at else "")
        for i in index
    ]
    return pa.table(
        {
            "ts": pa.array(
                [START + timedelta(milliseconds=int(i)) for i in index], pa.timestamp("us")
            ),
            "job_id": [f"job-{i % 97:03d}" for i in rng.permutation(index)],
            "level": [("INFO", "DEBUG", "WARN", "ERROR")[i % 4] for i in index],
            "msg": messages,
        }
    )


@pytest.fixture
def small() -> StoreOptions:
    return StoreOptions(flush_rows=4_000, row_group_rows=500, background=False)


def test_pruned_queries_read_few_row_groups_and_answer_as_a_scan(tmp_path, small):
    tables = [
        log_table(2_000, first=first, needle_at=(12_345,)) for first in range(0, 20_000, 2_000)
    ]
    raw = pa.concat_tables(tables)
    with TelemetryStore(tmp_path, small) as store:
        for table in tables:
            store.write("app.logs", table)
        store.flush()
        total = sum(report.row_groups for report in store.explain('SELECT * FROM "app.logs"'))
        assert total == 40

        needle = "SELECT ts, msg FROM \"app.logs\" WHERE msg LIKE '%needle-4e1f%'"
        assert store.query(needle).column("ts").to_pylist() == [
            START + timedelta(milliseconds=12_345)
        ]
        assert store.explain(needle)[0].row_groups_read <= 2

        job = "SELECT count(*) AS n FROM \"app.logs\" WHERE job_id = 'job-007'"
        assert store.query(job).column("n").to_pylist() == [
            raw.column("job_id").to_pylist().count("job-007")
        ]
        assert store.explain(job)[0].row_groups_read <= 10  # the job's run in each of 5 segments

        window = (
            'SELECT count(*) AS n FROM "app.logs" '
            "WHERE ts >= TIMESTAMP '2026-11-01 00:00:04' AND ts < TIMESTAMP '2026-11-01 00:00:06'"
        )
        assert store.query(window).column("n").to_pylist() == [2_000]
        assert store.explain(window)[0].row_groups_read == 8  # one segment of five

        levels = 'SELECT level, count(*) AS n FROM "app.logs" GROUP BY level ORDER BY level'
        assert store.explain(levels)[0].from_value_counts
        assert store.query(levels).to_pylist() == [
            {"level": level, "n": 5_000} for level in ("DEBUG", "ERROR", "INFO", "WARN")
        ]


def test_a_reader_in_another_process_sees_rows_still_in_the_write_ahead_log(tmp_path):
    with TelemetryStore(tmp_path, StoreOptions(background=False)) as store:
        store.write("app.logs", log_table(300))
        assert generations(tmp_path / "app.logs" / "wal")  # nothing flushed yet
        reader = TelemetryStore(tmp_path)
        assert reader.query('SELECT count(*) AS n FROM "app.logs"').column("n").to_pylist() == [300]
        # A writer killed mid-append leaves a torn record: readers skip it.
        path = generation_path(
            tmp_path / "app.logs" / "wal", generations(tmp_path / "app.logs" / "wal")[-1]
        )
        with open(path, "ab") as handle:
            handle.write(b"KWL1\x00\x10\x00\x00\x00\x00\x00\x00partial")
        assert reader.query('SELECT count(*) AS n FROM "app.logs"').column("n").to_pylist() == [300]


WRITER = textwrap.dedent(
    """
    import sys
    import pyarrow as pa
    from keel.telemetry import StoreOptions, TelemetryStore

    store = TelemetryStore(sys.argv[1], StoreOptions(flush_rows=3_000, row_group_rows=1_000))
    batch = 0
    while True:
        table = pa.table({"batch": pa.array([batch] * 500, pa.int64()), "row": list(range(500))})
        store.write("load.rows", table)
        print(batch, flush=True)
        batch += 1
    """
)


def test_every_acknowledged_row_survives_sigkill_of_the_writer(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    acknowledged = -1
    while acknowledged < 40:
        acknowledged = int(process.stdout.readline())
    os.kill(process.pid, signal.SIGKILL)
    process.wait()

    reader = TelemetryStore(tmp_path)  # before recovery: from the files as the writer left them
    before = reader.query('SELECT batch, count(*) AS n FROM "load.rows" GROUP BY batch')
    with TelemetryStore(tmp_path, StoreOptions(background=False)) as store:  # recovers the WAL
        after = store.query('SELECT batch, count(*) AS n FROM "load.rows" GROUP BY batch')
        store.flush()
        assert not generations(tmp_path / "load.rows" / "wal")
    for result in (before, after):
        counts = dict(
            zip(result.column("batch").to_pylist(), result.column("n").to_pylist(), strict=True)
        )
        assert all(batch in counts for batch in range(acknowledged + 1))
        assert set(counts.values()) == {500}  # no batch half-visible
    reopened = TelemetryStore(tmp_path)
    distinct = reopened.query('SELECT count(DISTINCT batch) AS n FROM "load.rows"')
    assert distinct.column("n").to_pylist()[0] >= acknowledged + 1


def test_bad_input_is_refused_and_nothing_is_stored(tmp_path, small):
    with TelemetryStore(tmp_path, small) as store:
        store.write("app.logs", log_table(10))
        with pytest.raises(TelemetryInputError, match="invalid namespace"):
            store.write("../x", log_table(10))
        with pytest.raises(TelemetryInputError, match="'colour'"):
            store.write("app.logs", [{"ts": "2026-11-01T00:00:00", "colour": "red"}])
        with pytest.raises(TelemetryInputError, match="'ts'"):
            store.write("app.logs", [{"ts": "yesterday", "msg": "x"}])
        with pytest.raises(TelemetryInputError, match="'level'"):
            store.write("app.logs", pa.table({"level": pa.array([1, 2])}))
        with pytest.raises(TelemetryQueryError, match="only SELECT"):
            store.query('DROP TABLE "app.logs"')
        with pytest.raises(TelemetryQueryError, match="query failed"):
            store.query('SELECT nope FROM "app.logs"')
        with pytest.raises(TelemetryQueryError):
            store.query("SELECT * FROM read_csv('/etc/passwd')")
        assert store.query('SELECT count(*) AS n FROM "app.logs"').column("n").to_pylist() == [10]
        assert not (tmp_path / ".." / "x").exists()
        assert list(store.namespaces()) == ["app.logs"]
        # JSON rows: timestamps as ISO strings; missing nullable columns are null.
        store.write("app.logs", [{"ts": "2026-11-02T00:00:00", "msg": "json row"}])
        row = store.query("SELECT * FROM \"app.logs\" WHERE msg = 'json row'").to_pylist()
        assert row == [
            {"ts": datetime(2026, 11, 2), "job_id": None, "level": None, "msg": "json row"}
        ]


def test_one_writer_at_a_time(tmp_path):
    with TelemetryStore(tmp_path) as store:
        store.write("app.logs", log_table(10))
        with pytest.raises(StoreBusyError, match="open for writing by another process"):
            TelemetryStore(tmp_path).write("app.logs", log_table(10))
    with TelemetryStore(tmp_path) as store:  # released on close
        assert store.write("app.logs", log_table(10)) == 10


def test_compaction_merges_segments_and_retention_drops_old_ones(tmp_path, small):
    options = NamespaceOptions(retention_days=7)
    with TelemetryStore(tmp_path, small) as store:
        store.create("app.logs", log_table(1).schema, options)
        for first in range(0, 16_000, 4_000):
            store.write("app.logs", log_table(4_000, first=first, needle_at=(9_999,)))
        store.flush()
        query = "SELECT count(*) AS n, max(ts) AS last FROM \"app.logs\" WHERE msg LIKE '%needle%'"
        before = store.query(query)
        report = store.compact(now=START.timestamp() + 3600)
        assert len(report.merged["app.logs"]) == 4 and len(report.written["app.logs"]) == 1
        assert store.query(query).equals(before)
        assert store.explain(query)[0].segments == 1
        report = store.compact(now=START.timestamp() + 8 * 86_400)
        assert report.rows_dropped == 16_000
        assert store.query('SELECT count(*) AS n FROM "app.logs"').column("n").to_pylist() == [0]


def test_handles_opened_and_closed_from_many_threads_share_one_writer(tmp_path):
    def report(worker: int) -> None:
        for step in range(100):
            with SharedStore(tmp_path) as handle:
                handle.write("flow.stage", [{"worker": worker, "step": step}])

    threads = [threading.Thread(target=report, args=(worker,)) for worker in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    count = TelemetryStore(tmp_path).query('SELECT count(*) AS n FROM "flow.stage"')
    assert count.column("n").to_pylist() == [200]
