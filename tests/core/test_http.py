"""The HTTP request layer's policy, on the servers that use it (the controller's job API, the
telemetry server and the dashboard), over real sockets on 127.0.0.1: drive-by writes from web
pages (text/plain, cross-origin, DNS rebinding) are refused and nothing is queued or run; bad
lengths and bad input get a 4xx with one line; tokens need `Bearer`; connections and query
results are bounded."""

import http.client
import json
import socket
import sqlite3
import threading
import time

import pytest

from keel.cluster import state
from keel.cluster.api import ControllerServer
from keel.cluster.spec import JobSpec
from keel.dashboard.server import DashboardServer
from keel.dashboard.sources import Sources
from keel.telemetry import StoreOptions, TelemetryStore
from keel.telemetry.client import HttpTelemetry
from keel.telemetry.server import TelemetryServer

SPEC = json.loads(state.encode_spec(JobSpec(("sh", "-c", "touch pwned"), name="drive-by")))
"""A whole job spec as the controller API takes it (every key, as the client sends it)."""
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def controller(tmp_path):
    server = ControllerServer(tmp_path / "controller").start()
    yield server
    server.stop()


class CountingTelemetry:
    """A telemetry store that counts the queries the dashboard ran (its only write endpoint,
    POST /api/sql, runs one): what a drive-by request must never get to."""

    def __init__(self, store):
        self.store, self.root, self.queries = store, None, 0

    def query(self, sql):
        self.queries += 1
        return self.store.query(sql)

    def namespaces(self):
        return self.store.namespaces()

    def close(self):
        pass


class Writable:
    """A server with a JSON write endpoint: the controller (POST /v1/jobs, a job spec) or the
    dashboard (POST /api/sql, a SELECT). `taken()`: writes it acted on."""

    def __init__(self, kind, tmp_path, store, token=None):
        self.kind = kind
        if kind == "controller":
            self.server = ControllerServer(tmp_path / "controller", token=token).start()
            self.path, self.body = "/v1/jobs", json.dumps(SPEC).encode()
        else:
            self.telemetry = CountingTelemetry(store)
            sources = Sources(None, self.telemetry, "test")
            self.server = DashboardServer(sources, token=token).start()
            self.path, self.body = "/api/sql", json.dumps({"sql": "SELECT 1 AS one"}).encode()
        self.url = self.server.url

    def post(self, headers, host=None):
        length = {"Content-Length": str(len(self.body))}
        return raw(self.server, "POST", self.path, self.body, {**length, **headers}, host)

    def taken(self):
        return queued(self.server) if self.kind == "controller" else self.telemetry.queries

    def stop(self):
        self.server.stop()


@pytest.fixture(params=["controller", "dashboard"])
def writable(request, tmp_path, store):
    target = Writable(request.param, tmp_path, store)
    yield target
    target.stop()


@pytest.fixture
def store(tmp_path):
    with TelemetryStore(tmp_path / "store", StoreOptions(background=False)) as opened:
        yield opened


def queued(server) -> int:
    if not (server.root / "state.db").exists():
        return 0
    with sqlite3.connect(server.root / "state.db") as database:
        return database.execute("SELECT count(*) FROM jobs").fetchone()[0]


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host.strip("[]"), int(port)


def raw(server, method, path, body=b"", headers=None, host=None):
    """One request with exactly these headers (Host too, unless None: the server's own)."""
    connection = http.client.HTTPConnection(*address(server), timeout=5)
    try:
        connection.putrequest(method, path, skip_host=host is not None, skip_accept_encoding=True)
        if host is not None:
            connection.putheader("Host", host)
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        connection.endheaders(body or None)
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    try:
        payload = json.loads(data)
    except ValueError:
        payload = data.decode(errors="replace")
    return response.status, payload


def post_job(server, headers, host=None):
    body = json.dumps(SPEC).encode()
    return raw(
        server, "POST", "/v1/jobs", body, {"Content-Length": str(len(body)), **headers}, host
    )


def assert_refused(answer, status, *fragments):
    got, payload = answer
    assert got == status, answer
    assert isinstance(payload, dict) and "\n" not in payload["error"], answer
    for fragment in fragments:
        assert fragment in payload["error"], answer


# -- drive-by requests from a web page ----------------------------------------------------------


def test_a_text_plain_job_post_is_refused_and_nothing_is_queued(writable):
    """What a web page can send without a CORS preflight: a text/plain (or form) POST."""
    for kind in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
        assert_refused(writable.post({"Content-Type": kind}), 415, "Content-Type")
    assert_refused(writable.post({}), 415, "Content-Type")
    assert writable.taken() == 0
    assert writable.post(JSON)[0] == 200  # the same request with a JSON type is taken
    assert writable.taken() == 1


def test_a_cross_origin_job_post_is_refused_and_nothing_is_queued(writable):
    for origin in ("http://evil.example", "null", f"{writable.url}.evil.example"):
        assert_refused(writable.post({**JSON, "Origin": origin}), 403, "Origin")
    assert writable.taken() == 0
    assert writable.post({**JSON, "Origin": writable.url})[0] == 200
    assert writable.taken() == 1


@pytest.mark.parametrize("kind", ["controller", "telemetry", "dashboard"])
def test_a_foreign_host_is_refused_dns_rebinding(kind, controller, store):
    if kind == "dashboard":
        server = DashboardServer(Sources(None, CountingTelemetry(store), "test")).start()
    else:
        server = controller if kind == "controller" else TelemetryServer(store).start()
    try:
        port = address(server)[1]
        for host in (f"evil.example:{port}", "evil.example", f"localhost:{port + 1}", ""):
            assert_refused(post_job(server, JSON, host=host), 421, "Host")
            assert_refused(raw(server, "GET", "/v1/namespaces", host=host), 421, "Host")
            assert_refused(raw(server, "GET", "/api/runs", host=host), 421, "Host")
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            assert raw(server, "GET", "/v1/jobs/j-000001", host=host)[0] in (200, 404)
    finally:
        if server is not controller:
            server.stop()
    assert queued(controller) == 0


# -- bad input: 4xx with one line, never 500 ----------------------------------------------------


@pytest.mark.parametrize("length", ["-1", "abc", "1e3", "+5"])
def test_a_bad_content_length_is_a_400_and_nothing_is_read(controller, length):
    body = json.dumps(SPEC).encode()
    status, _ = raw(controller, "POST", "/v1/jobs", body, {**JSON, "Content-Length": length})
    assert status == 400
    assert queued(controller) == 0


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ({"name": "no command"}, "command"),
        ({**SPEC, "resources": {**SPEC["resources"], "cpus": "abc"}}, "cpus"),
        ({**SPEC, "replicas": "two"}, "replicas"),
        ([1, 2], ""),
        ("a string", ""),
    ],
)
def test_a_bad_job_spec_is_a_400_with_one_line(controller, spec, fragment):
    body = json.dumps(spec).encode()
    answer = raw(controller, "POST", "/v1/jobs", body, {**JSON, "Content-Length": str(len(body))})
    assert_refused(answer, 400, fragment)
    assert queued(controller) == 0


@pytest.mark.parametrize("kind", ["controller", "dashboard"])
def test_a_token_is_only_taken_as_bearer(kind, tmp_path, store):
    server = Writable(kind, tmp_path, store, token="s3cret")
    try:
        # Not "Bearer s3cret ": whitespace after a header value is not part of it (RFC 9110
        # 5.5), and the HTTP parser (httptools 0.9) drops it before keel sees the header.
        refused = ("s3cret", "Basic s3cret", "Bearer  s3cret", "Bearer s3cret x", "Bearers3cret")
        for given in refused:
            assert_refused(server.post({**JSON, "Authorization": given}), 401, "Bearer")
        assert server.taken() == 0
        assert server.post({**JSON, "Authorization": "Bearer s3cret"})[0] == 200
    finally:
        server.stop()


def test_an_unknown_job_is_a_404_on_every_job_endpoint(controller):
    for method, path in (
        ("GET", "/v1/jobs/j-999999"),
        ("POST", "/v1/jobs/j-999999/cancel"),
        ("GET", "/v1/jobs/j-999999/logs"),
    ):
        headers = {**JSON, "Content-Length": "0"} if method == "POST" else {}
        assert_refused(raw(controller, method, path, headers=headers), 404, "j-999999")


def test_logs_over_http_hide_the_jobs_secrets_as_keel_job_logs_does(
    controller, tmp_path, monkeypatch
):
    """A task printing its token: the API shows it as *** (the job's env names it secret), also
    when the output comes in chunks smaller than it (each chunk ends at a line's end)."""
    from keel.cluster import api, state

    database = state.connect(controller.root / "state.db")
    job_id = state.submit(database, JobSpec(("true",), env={"HF_TOKEN": "hf_s3cretvalue"}))
    output = tmp_path / "attempt"
    output.mkdir()
    lines = ["token is hf_s3cretvalue", "x" * 20 + "hf_s3cretvalue", "last hf_s3cretvalue"]
    (output / "stdout").write_text("\n".join(lines))  # the last line has no newline
    database.execute(
        "INSERT INTO attempts (job_id, replica, attempt, cluster, handle, state, started_at) "
        "VALUES (?, 0, 1, 'local', ?, 'succeeded', 0)",
        (job_id, str(output)),
    )
    database.execute("UPDATE jobs SET state = 'succeeded' WHERE id = ?", (job_id,))
    database.close()
    expected = "token is ***\n" + "x" * 20 + "***\nlast ***"
    status, chunk = raw(controller, "GET", f"/v1/jobs/{job_id}/logs")
    assert status == 200, chunk
    assert (chunk["text"], chunk["done"]) == (expected, True)
    monkeypatch.setattr(api, "LOG_CHUNK_BYTES", 40)  # each line fits, two do not
    text, offset, done = "", 0, False
    while not done:
        status, chunk = raw(controller, "GET", f"/v1/jobs/{job_id}/logs?offset={offset}")
        assert status == 200 and len(text) < 1000, chunk
        text, offset, done = text + chunk["text"], chunk["offset"], chunk["done"]
    assert text == expected


# -- bounded connections and results ------------------------------------------------------------


def test_connections_beyond_the_cap_get_503_and_the_server_recovers(store):
    server = TelemetryServer(store, max_connections=4).start()
    held = []
    try:
        for _ in range(4):
            connection = socket.create_connection(address(server), timeout=5)
            held.append(connection)
        time.sleep(0.2)
        assert raw(server, "GET", "/v1/health")[0] == 503
        for connection in held:
            connection.close()
        held.clear()
        deadline = time.monotonic() + 5
        while raw(server, "GET", "/v1/health")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for connection in held:
            connection.close()
        server.stop()


def test_a_query_over_the_result_caps_is_refused_with_one_line(store):
    from keel.telemetry import QueryLimits

    rows = [
        {"ts": f"2026-11-01T00:00:{s % 60:02d}", "step": s, "note": "x" * 99} for s in range(5000)
    ]
    store.write("train.metrics", rows)
    limits = QueryLimits(max_rows=1000, max_bytes=1 << 20, timeout_seconds=10)
    with TelemetryServer(store, query_limits=limits) as server:
        client = HttpTelemetry(server.url)
        assert client.query('SELECT * FROM "train.metrics" LIMIT 1000').num_rows == 1000
        body = json.dumps({"sql": 'SELECT * FROM "train.metrics"'}).encode()
        answer = raw(server, "POST", "/v1/query", body, {**JSON, "Content-Length": str(len(body))})
        assert_refused(answer, 400, "max_rows")
        answer = raw(server, "GET", "/v1/tail/train.metrics?limit=5000")
        assert_refused(answer, 400, "max_rows")
        client.close()


def test_a_slow_client_cannot_hold_the_controller(controller):
    """A body that never arrives does not block others (each connection is served on its own)."""
    stalled = socket.create_connection(address(controller), timeout=5)
    host, port = address(controller)
    stalled.sendall(
        f"POST /v1/jobs HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n{".encode()
    )
    try:
        started = time.monotonic()
        assert raw(controller, "GET", "/v1/jobs/j-000001")[0] == 404
        assert time.monotonic() - started < 2
    finally:
        stalled.close()
    threading.Event().wait(0.1)
    assert queued(controller) == 0


# -- the layer itself, on a small app ---------------------------------------------------------


@pytest.fixture
def echo():
    """An HttpServer whose POST /echo counts the body it read, and GET /boom has a bug."""
    from starlette.responses import Response

    from keel.core.http import HttpPolicy
    from keel.core.http_server import HttpServer, endpoints, json_response, read_body

    seen: list[int] = []

    async def echo_body(request):
        body = await read_body(request)
        seen.append(len(body))
        return json_response({"bytes": len(body)})

    async def boom(request) -> Response:
        raise ZeroDivisionError("a bug")

    app = endpoints({"/echo": {"POST": echo_body}, "/boom": {"GET": boom}})
    policy = HttpPolicy(max_body_bytes=1000, body_timeout_seconds=0.5)
    with HttpServer(app, policy) as server:
        server.seen = seen
        yield server


def test_a_chunked_body_is_counted_and_cut_at_the_limit(echo):
    host, port = address(echo)
    with socket.create_connection((host, port), timeout=5) as connection:
        connection.sendall(
            f"POST /echo HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        for _ in range(20):  # 20 x 100 bytes: over the limit of 1000
            connection.sendall(b"64\r\n" + b"x" * 100 + b"\r\n")
        connection.sendall(b"0\r\n\r\n")
        answer = connection.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413") and b"limit of 1000 bytes" in answer
    assert echo.seen == []  # the endpoint never got a body
    chunked = b"5\r\nhello\r\n0\r\n\r\n"
    headers = {**JSON, "Transfer-Encoding": "chunked"}
    assert raw(echo, "POST", "/echo", chunked, headers) == (200, {"bytes": 5})


def test_an_oversized_body_is_refused_before_it_is_sent(echo):
    host, port = address(echo)
    with socket.create_connection((host, port), timeout=5) as connection:
        connection.sendall(
            f"POST /echo HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000000000\r\n\r\n".encode()
        )
        assert connection.recv(4096).startswith(b"HTTP/1.1 413")  # no byte of the body sent


def test_a_stalled_body_is_a_408(echo):
    host, port = address(echo)
    with socket.create_connection((host, port), timeout=5) as connection:
        connection.sendall(
            f"POST /echo HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            "Content-Length: 10\r\n\r\n12345".encode()
        )
        started = time.monotonic()
        answer = connection.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert 0.4 < time.monotonic() - started < 3


def test_a_bug_is_a_logged_500_with_one_line(echo, caplog):
    status, payload = raw(echo, "GET", "/boom")
    assert status == 500 and payload["error"].startswith("internal error (ZeroDivisionError)")
    assert "a bug" in caplog.text  # the traceback went to the log, not to the client
    assert raw(echo, "GET", "/nothing")[0] == 404
    assert_refused(raw(echo, "GET", "/echo"), 405, "takes POST")


def test_the_policy_refuses_what_would_open_it_to_web_pages():
    from keel.core.errors import UsageError
    from keel.core.http import HttpPolicy, is_loopback

    with pytest.raises(UsageError, match="without a preflight"):
        HttpPolicy(write_types=frozenset({"application/json", "text/plain"}))
    with pytest.raises(UsageError, match="without a token"):
        HttpPolicy().check_bind("0.0.0.0")
    HttpPolicy(token="t").check_bind("0.0.0.0")
    assert [is_loopback(h) for h in ("localhost", "127.0.0.2", "[::1]", "10.0.0.1", "evil")] == [
        True,
        True,
        True,
        False,
        False,
    ]
