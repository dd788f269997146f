"""Result caps on a query: rows, bytes and seconds, each refused with one line naming the cap."""

import time

import pyarrow as pa
import pytest

from keel.telemetry import (
    QueryLimitError,
    QueryLimits,
    StoreOptions,
    TelemetryInputError,
    TelemetryStore,
)


@pytest.fixture
def store(tmp_path):
    with TelemetryStore(tmp_path, StoreOptions(background=False, row_group_rows=1_000)) as store:
        store.write(
            "app.events",
            pa.table({"n": pa.array(range(20_000), pa.int64()), "text": ["x" * 50] * 20_000}),
        )
        store.flush()
        yield store


def test_a_result_over_max_rows_is_refused_naming_the_cap(store):
    query = 'SELECT n FROM "app.events"'
    assert store.query(query, QueryLimits(max_rows=20_000)).num_rows == 20_000
    with pytest.raises(QueryLimitError) as refused:
        store.query(query, QueryLimits(max_rows=19_999))
    assert "max_rows" in str(refused.value) and "\n" not in str(refused.value)
    assert "LIMIT" in str(refused.value)


def test_a_result_over_max_bytes_is_refused_naming_the_cap(store):
    query = 'SELECT text FROM "app.events"'
    with pytest.raises(QueryLimitError) as refused:
        store.query(query, QueryLimits(max_bytes=100_000))
    assert "max_bytes" in str(refused.value) and "\n" not in str(refused.value)
    assert store.query(query + " LIMIT 10", QueryLimits(max_bytes=100_000)).num_rows == 10


def test_a_query_past_its_timeout_is_interrupted(store):
    slow = 'SELECT count(*) FROM "app.events" a, "app.events" b WHERE a.n * b.n % 7 = 3'
    started = time.monotonic()
    with pytest.raises(QueryLimitError) as refused:
        store.query(slow, QueryLimits(timeout_seconds=0.3))
    assert time.monotonic() - started < 10
    assert "timeout_seconds" in str(refused.value) and "\n" not in str(refused.value)
    assert store.query('SELECT count(*) AS c FROM "app.events"').column("c")[0].as_py() == 20_000


def test_limits_must_be_positive():
    with pytest.raises(TelemetryInputError):
        QueryLimits(timeout_seconds=0)
