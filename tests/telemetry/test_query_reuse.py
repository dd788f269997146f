"""What the store keeps between queries (cursors with their views, plans, one watchdog thread)
never changes an answer: a repeated query sees every write, flush and compaction, in the writing
process and in a reading one, from many threads at once, and timeouts stay enforced."""

import threading
import time

import pyarrow as pa
import pytest

from keel.telemetry import (
    QueryLimitError,
    QueryLimits,
    StoreOptions,
    TelemetryQueryError,
    TelemetryStore,
)
from keel.telemetry.watchdog import Watchdog

OPTIONS = StoreOptions(flush_rows=2_000, row_group_rows=250, background=False)
COUNT = "SELECT count(*) AS n, sum(n) AS total FROM \"app.events\" WHERE kind = 'b'"
GROUPED = 'SELECT kind, count(*) AS c FROM "app.events" GROUP BY kind ORDER BY kind'


def rows(first: int, count: int) -> pa.Table:
    numbers = list(range(first, first + count))
    return pa.table(
        {"n": pa.array(numbers, pa.int64()), "kind": [("a", "b", "c")[i % 3] for i in numbers]}
    )


def expected(upto: int) -> tuple[int, int]:
    """(count, sum) of the rows 0..upto-1 of kind 'b'."""
    picked = [i for i in range(upto) if i % 3 == 1]
    return len(picked), sum(picked)


def answer(store: TelemetryStore, sql: str = COUNT) -> tuple[int, int]:
    result = store.query(sql)
    return result.column("n")[0].as_py(), result.column("total")[0].as_py() or 0


def test_a_repeated_query_sees_every_write_flush_and_compaction(tmp_path):
    options = StoreOptions(
        flush_rows=2_000, row_group_rows=250, background=False, retire_grace_seconds=0
    )
    with TelemetryStore(tmp_path, options) as store:
        store.write("app.events", rows(0, 1_500))
        assert answer(store) == expected(1_500)  # all in the WAL
        store.write("app.events", rows(1_500, 1_500))  # the first 2,000 become a segment
        assert answer(store) == expected(3_000)
        store.write("other.events", rows(0, 10))
        assert store.query(GROUPED).column("c").to_pylist() == [1_000, 1_000, 1_000]
        assert store.query('SELECT count(*) AS c FROM "other.events"').column("c")[0].as_py() == 10
        assert answer(store) == expected(3_000)
        store.flush()
        assert answer(store) == expected(3_000)
        for first in range(3_000, 9_000, 2_000):
            store.write("app.events", rows(first, 2_000))
        assert answer(store) == expected(9_000)
        segments = store.explain(COUNT)[0].segments
        store.compact()  # merges the segments and deletes the replaced files at once
        assert store.explain(COUNT)[0].segments < segments
        assert answer(store) == expected(9_000)
        assert store.query(GROUPED).column("c").to_pylist() == [3_000, 3_000, 3_000]


def test_a_reading_process_repeating_a_query_follows_the_writer(tmp_path):
    options = StoreOptions(
        flush_rows=2_000, row_group_rows=250, background=False, retire_grace_seconds=0
    )
    with TelemetryStore(tmp_path, options) as writer:
        writer.write("app.events", rows(0, 1_000))
        reader = TelemetryStore(tmp_path)  # never writes: reads the files for every query
        try:
            assert answer(reader) == expected(1_000)
            writer.write("app.events", rows(1_000, 3_000))
            assert answer(reader) == expected(4_000)
            writer.flush()
            assert answer(reader) == expected(4_000)
            writer.compact()  # the files the reader's last view named are deleted now
            assert answer(reader) == expected(4_000)
            writer.write("app.events", rows(4_000, 500))
            assert answer(reader) == expected(4_500)
        finally:
            reader.close()


def test_a_namespace_created_after_a_query_failed_is_found_by_the_same_query(tmp_path):
    with TelemetryStore(tmp_path, OPTIONS) as store:
        store.write("app.events", rows(0, 10))
        sql = 'SELECT count(*) AS c FROM "late.events"'
        with pytest.raises(TelemetryQueryError):
            store.query(sql)
        store.write("late.events", rows(0, 7))
        assert store.query(sql).column("c")[0].as_py() == 7


def test_queries_from_many_threads_at_once_each_get_their_own_answer(tmp_path):
    with TelemetryStore(tmp_path, OPTIONS) as store:
        store.write("app.events", rows(0, 6_000))
        store.write("other.events", rows(0, 300))
        queries = {
            COUNT: answer(store),
            GROUPED: tuple(store.query(GROUPED).column("c").to_pylist()),
            "SELECT count(*) AS n, sum(n) AS total FROM \"other.events\" WHERE kind = 'b'": (
                expected(300)
            ),
        }
        failures: list[str] = []

        def run(offset: int) -> None:
            for turn in range(15):
                sql = list(queries)[(offset + turn) % len(queries)]
                got = (
                    tuple(store.query(sql).column("c").to_pylist())
                    if sql == GROUPED
                    else answer(store, sql)
                )
                if got != queries[sql]:
                    failures.append(f"{sql}: {got} != {queries[sql]}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures


def test_timeouts_stay_enforced_on_reused_cursors(tmp_path):
    slow = 'SELECT count(*) FROM "app.events" a, "app.events" b WHERE a.n * b.n % 7 = 3'
    with TelemetryStore(tmp_path, OPTIONS) as store:
        store.write("app.events", rows(0, 20_000))
        store.flush()
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(QueryLimitError, match="timeout_seconds"):
                store.query(slow, QueryLimits(timeout_seconds=0.3))
            assert time.monotonic() - started < 10
            for _ in range(20):  # a deadline passed long ago never reaches a later query
                assert answer(store, COUNT) == expected(20_000)


def test_the_watchdog_interrupts_only_what_is_still_armed_in_deadline_order():
    watchdog = Watchdog()
    fired: list[str] = []
    try:
        late = watchdog.arm(time.monotonic() + 60, lambda: fired.append("late"))
        kept = watchdog.arm(time.monotonic() + 60, lambda: fired.append("kept"))
        soon = watchdog.arm(time.monotonic() + 0.05, lambda: fired.append("soon"))
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fired == ["soon"]
        assert watchdog.disarm(soon) is True
        assert watchdog.disarm(late) is False
        again = watchdog.arm(time.monotonic(), lambda: fired.append("now"))
        while len(fired) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fired == ["soon", "now"] and watchdog.disarm(again) is True
        assert watchdog.disarm(kept) is False
    finally:
        watchdog.stop()
    assert fired == ["soon", "now"]
