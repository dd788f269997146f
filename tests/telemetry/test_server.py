"""The telemetry server and its client over real HTTP on 127.0.0.1: bad requests are refused
cleanly without storing anything, data round-trips, and acknowledged writes survive a SIGKILL."""

import http.client
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta

import pyarrow as pa
import pytest

from keel.core.errors import UsageError
from keel.telemetry import StoreOptions, TelemetryInputError, TelemetryQueryError, TelemetryStore
from keel.telemetry.client import HttpTelemetry, TelemetryConnectionError, connect
from keel.telemetry.server import TelemetryServer

START = datetime(2026, 11, 1)
NS = "train.metrics"


def metrics(steps: range, run: str = "a") -> pa.Table:
    return pa.table(
        {
            "ts": pa.array([START + timedelta(seconds=s) for s in steps], pa.timestamp("us")),
            "run": [run] * len(steps),
            "step": pa.array(list(steps), pa.int64()),
            "loss": [10.0 / (s + 1) for s in steps],
        }
    )


@pytest.fixture
def store(tmp_path):
    with TelemetryStore(tmp_path / "store", StoreOptions(background=False)) as opened:
        yield opened


@pytest.fixture
def server(store):
    with TelemetryServer(store, max_request_bytes=64 << 10) as running:
        yield running


def call(server, method, path, body=None, headers=None):
    """One raw request on its own connection: (status, parsed JSON or bytes)."""
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request(method, path, body, headers or {})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    kind = response.getheader("Content-Type", "")
    return response.status, json.loads(data) if kind == "application/json" else data


def count(store, namespace=NS):
    if namespace not in store.namespaces():
        return 0
    return store.query(f'SELECT count(*) AS n FROM "{namespace}"').column("n")[0].as_py()


def assert_refused(answer, status, *fragments):
    got, payload = answer
    assert got == status, payload
    assert set(payload) >= {"error"} and "\n" not in payload["error"], payload
    for fragment in fragments:
        assert fragment in payload["error"], payload


def good_write(server, store, before):
    client = HttpTelemetry(server.url, token=server.token)
    assert client.write(NS, metrics(range(100, 103))) == 3
    assert count(store) == before + 3
    client.close()


def test_rows_that_do_not_fit_the_schema_are_refused_and_nothing_is_stored(server, store):
    client = HttpTelemetry(server.url)
    assert client.write(NS, metrics(range(5))) == 5
    rows = [{"ts": "2026-11-02T00:00:00", "step": 1}, {"ts": "2026-11-02T00:00:01", "step": "x"}]
    body = json.dumps(rows).encode()
    assert_refused(
        call(server, "POST", f"/v1/write/{NS}", body, {"Content-Type": "application/json"}),
        400,
        "step",
    )
    unknown = metrics(range(5, 7)).append_column("gpu", pa.array([1, 2]))
    with pytest.raises(TelemetryInputError, match="gpu"):
        client.write(NS, unknown)
    assert_refused(
        call(server, "POST", f"/v1/write/{NS}", b"not arrow", {"Content-Type": ARROW}), 400
    )
    csv = {"Content-Type": "text/csv"}
    assert_refused(call(server, "POST", f"/v1/write/{NS}", b"[]", csv), 415, "Content-Type")
    assert count(store) == 5
    good_write(server, store, 5)


ARROW = "application/vnd.apache.arrow.stream"


def test_an_empty_object_value_is_refused_at_write(tmp_path):
    store = TelemetryStore(tmp_path / "store", StoreOptions(background=False))
    try:
        with TelemetryServer(store) as server:
            body = json.dumps([{"ts": "2026-11-01T00:00:00", "empty": {}}]).encode()
            answer = call(
                server, "POST", f"/v1/write/{NS}", body, {"Content-Type": "application/json"}
            )
        store.flush()
        assert_refused(answer, 400)
        assert count(store) == 0
    finally:
        store.close(flush=False)


@pytest.mark.parametrize("path", ["../x", "%2e%2e%2fx", "..%2Fx", "x%00", "Train"])
def test_bad_namespaces_are_refused_before_touching_disk(server, store, tmp_path, path):
    body = json.dumps([{"ts": "2026-11-02T00:00:00", "step": 1}]).encode()
    answer = call(server, "POST", f"/v1/write/{path}", body, {"Content-Type": "application/json"})
    assert_refused(answer, 400, "invalid namespace")
    assert_refused(call(server, "GET", f"/v1/tail/{path}"), 400, "invalid namespace")
    assert list(tmp_path.rglob("*")) == []  # not even the store's root was created
    assert store.namespaces() == {}
    good_write(server, store, 0)


def test_oversized_request_is_refused_unread_and_the_server_keeps_serving(server, store):
    big = metrics(range(5_000))  # well over the fixture's 64 KiB
    headers = {"Content-Type": ARROW}
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("POST", f"/v1/write/{NS}", _ipc(big), headers)
    response = connection.getresponse()
    payload = json.loads(response.read())
    assert response.status == 413 and "limit of 65536 bytes" in payload["error"]
    connection.request("GET", "/v1/health")  # the unread body was dropped: the connection works
    assert connection.getresponse().read() == b'{"ok":true}'
    connection.close()
    with pytest.raises(UsageError, match="over this server's limit"):
        HttpTelemetry(server.url).write(NS, big)
    assert count(store) == 0
    missing_length = http.client.HTTPConnection(host, int(port), timeout=10)
    missing_length.putrequest("POST", f"/v1/write/{NS}")
    missing_length.putheader("Content-Type", "application/json")
    missing_length.endheaders()
    assert missing_length.getresponse().status == 411
    missing_length.close()
    good_write(server, store, 0)


def test_wrong_or_missing_token_is_refused(store):
    with TelemetryServer(store, token="s3cret") as server:
        body = json.dumps([{"ts": "2026-11-02T00:00:00", "step": 1}]).encode()
        headers = {"Content-Type": "application/json"}
        assert_refused(call(server, "POST", f"/v1/write/{NS}", body, headers), 401, "missing")
        wrong = {**headers, "Authorization": "Bearer s3cre"}
        assert_refused(call(server, "POST", f"/v1/write/{NS}", body, wrong), 401, "wrong")
        assert_refused(call(server, "GET", "/v1/namespaces", None, wrong), 401)
        with pytest.raises(UsageError, match="token"):
            HttpTelemetry(server.url, token="nope").query("SELECT 1")
        assert store.namespaces() == {}
        good_write(server, store, 0)


def test_serving_beyond_loopback_needs_a_token(store):
    with pytest.raises(UsageError, match="without a token"):
        TelemetryServer(store, host="0.0.0.0")


def test_arrow_and_json_writes_round_trip_through_http_query(server, store):
    client = connect(server.url)
    sent = metrics(range(10))
    assert client.write(NS, sent) == 10
    rows = [{"ts": "2026-11-01T00:01:00", "run": "b", "step": 60, "loss": 0.5}]
    assert client.write(NS, rows) == 1
    ndjson = b'{"ts": "2026-11-01T00:02:00", "run": "c", "step": 120, "loss": 0.25}\n\n'
    status, payload = call(
        server, "POST", f"/v1/write/{NS}", ndjson, {"Content-Type": "application/x-ndjson"}
    )
    assert (status, payload) == (200, {"rows": 1})

    got = client.query(f"SELECT * FROM \"{NS}\" WHERE run = 'a' ORDER BY step")
    assert got.equals(sent)
    status, payload = call(
        server,
        "POST",
        "/v1/query",
        json.dumps({"sql": f'SELECT step, run, ts FROM "{NS}" WHERE step >= 60 ORDER BY step'}),
        {"Content-Type": "application/json"},
    )
    assert status == 200
    assert payload == {
        "columns": ["step", "run", "ts"],
        "rows": [[60, "b", "2026-11-01T00:01:00"], [120, "c", "2026-11-01T00:02:00"]],
    }
    assert client.namespaces() == {NS: sent.schema}
    assert call(server, "GET", "/v1/namespaces")[1]["namespaces"][NS]["columns"] == {
        "ts": "timestamp[us]",
        "run": "string",
        "step": "int64",
        "loss": "double",
    }
    with pytest.raises(TelemetryQueryError):
        client.query("SELEC nothing")
    with pytest.raises(TelemetryQueryError):
        client.query('SELECT * FROM "no.such"')
    assert_refused(call(server, "GET", "/v1/nothing"), 404)
    assert_refused(call(server, "GET", "/v1/tail/no.such"), 404, "no.such")
    assert call(server, "GET", "/v1/health") == (200, {"ok": True})


def test_tail_and_follow_yield_rows_written_after_they_started(server, store):
    client = HttpTelemetry(server.url)
    client.write(NS, metrics(range(10)))
    tail = client.tail(NS, limit=3)
    assert tail.column("step").to_pylist() == [7, 8, 9]
    later = client.tail(NS, limit=20, after=START + timedelta(seconds=7))
    assert later.column("step").to_pylist() == [8, 9]

    seen: list[dict] = []
    only_new: list[dict] = []
    followers = [
        threading.Thread(target=lambda: seen.extend(client.follow(NS, limit=2))),
        threading.Thread(target=lambda: only_new.extend(client.follow(NS, limit=0))),
    ]
    for follower in followers:
        follower.start()
    _until(lambda: len(seen) == 2)
    assert [row["step"] for row in seen] == [8, 9]
    time.sleep(0.6)  # both streams are polling now
    client.write(NS, metrics(range(10, 12)))
    _until(lambda: len(seen) == 4 and len(only_new) == 2)
    assert [row["step"] for row in seen] == [8, 9, 10, 11]
    assert [row["step"] for row in only_new] == [10, 11]
    assert seen[-1]["ts"] == "2026-11-01T00:00:11"
    started = time.monotonic()
    server.stop()  # ends the streams, and the idle keep-alive connection of `client`
    for follower in followers:
        follower.join(timeout=5)
        assert not follower.is_alive()
    assert time.monotonic() - started < 3


def test_a_client_without_a_server_gets_one_line(tmp_path):
    with TelemetryStore(tmp_path) as store:
        server = TelemetryServer(store)
        port = server.url.rsplit(":", 1)[1]
        server.stop()  # bound, then closed: nobody listens there
    client = HttpTelemetry(f"http://127.0.0.1:{port}")
    with pytest.raises(UsageError, match=r"no telemetry server at .*keel logs serve"):
        client.query("SELECT 1")


SERVE = """
import sys
from keel.core.log import setup_logging
from keel.cli.logs_commands import app
setup_logging()
app(["serve", "--root", sys.argv[1], "--port", "0"])
"""


def test_every_acknowledged_write_survives_a_sigkill_and_no_batch_is_partial(tmp_path):
    """`keel logs serve` in a subprocess (without the rest of the CLI's imports), SIGKILLed while
    a client streams batches; a new server on the same root answers for every acknowledged one."""
    root = tmp_path / "store"
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(root)],
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
        start_new_session=True,
    )
    try:
        url = _served_url(process)
        client = HttpTelemetry(url)
        acknowledged: list[int] = []
        failures: list[Exception] = []

        def stream() -> None:
            for batch in range(10_000):
                table = metrics(range(batch * 1000, (batch + 1) * 1000), run=f"b{batch}")
                try:
                    client.write(NS, table)
                except (TelemetryConnectionError, UsageError) as error:
                    failures.append(error)
                    return
                acknowledged.append(batch)

        writer = threading.Thread(target=stream)
        writer.start()
        _until(lambda: len(acknowledged) >= 20)
        os.kill(process.pid, signal.SIGKILL)
        writer.join(timeout=10)
        assert not writer.is_alive() and failures, "the writes should fail once it is killed"
    finally:
        process.kill()
        process.wait()
    with (
        TelemetryStore(root) as store,
        TelemetryServer(store) as server,
        HttpTelemetry(server.url) as reader,
    ):
        store.flush()  # recovery: the killed server's WAL into segments
        counts = reader.query(f'SELECT run, count(*) AS n FROM "{NS}" GROUP BY run').to_pylist()
    per_batch = {row["run"]: row["n"] for row in counts}
    assert set(per_batch.values()) == {1000}, per_batch  # all or nothing
    assert {f"b{batch}" for batch in acknowledged} <= set(per_batch)
    assert len(per_batch) <= len(acknowledged) + 1  # at most the one in flight, unacknowledged


def _served_url(process: subprocess.Popen) -> str:
    deadline = time.monotonic() + 30
    seen = b""
    while time.monotonic() < deadline:
        readable, _, _ = select.select([process.stderr], [], [], 0.5)
        if readable:
            chunk = os.read(process.stderr.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
            found = re.search(rb"http://127\.0\.0\.1:\d+", seen)
            if found:
                return found.group().decode()
    raise AssertionError(f"the server did not log its URL: {seen.decode(errors='replace')}")


def _until(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def test_epoch_numbers_over_http_need_a_time_unit(server, store):
    client = HttpTelemetry(server.url)
    rows = [{"ts": 1_700_000_000_000, "step": 1}]  # milliseconds since 1970
    with pytest.raises(TelemetryInputError, match="ts"):
        client.write("app.events", rows)
    assert client.write("app.events", rows, time_unit="ms") == 1
    [row] = client.query('SELECT ts FROM "app.events"').to_pylist()
    assert row["ts"] == datetime(2023, 11, 14, 22, 13, 20)
    answer = call(server, "POST", "/v1/write/app.events?time_unit=days", json.dumps(rows).encode(),
                  {"Content-Type": "application/json"})  # fmt: skip
    assert_refused(answer, 400, "time_unit")
