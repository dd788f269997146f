"""Fuzzing the HTTP APIs (telemetry, controller, dashboard) over real sockets (Hypothesis,
derandomized): random methods, paths, headers, lengths, content types and bodies; random JSON
shapes and Arrow column types for telemetry writes; random SQL; random job specs. Never a 5xx,
every error one JSON line, and a refused write stores nothing (row and job counts compared around
each request; the dashboard never changes the store)."""

import json
import string

import pyarrow as pa
import pytest
from fuzz_support import FUZZ, assert_answered, exchange, queued_jobs, stored_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from keel.cluster import state
from keel.cluster.spec import JobSpec
from keel.dashboard.server import DashboardServer
from keel.dashboard.sources import Sources
from keel.telemetry.wire import arrow_stream

NAMESPACES = ["fuzz.a", "fuzz.b", "fuzz.c"]
TELEMETRY_PATHS = [
    "/v1/health",
    "/v1/namespaces",
    "/v1/query",
    "/v1/compact",
    *(f"/v1/write/{name}" for name in NAMESPACES),
    "/v1/write/Fuzz",
    "/v1/write/..%2Fx",
    "/v1/write/",
    "/v1/tail/fuzz.a",
    "/v1/tail/fuzz.a?limit=3&after=2026-01-01T00:00:00",
    "/v1/tail/fuzz.a?limit=-1",
    "/v1/tail/fuzz.a?limit=99999999999999999999&after=nope",
    "/v1/tail/no.such",
    "/",
    "*",
]
CONTROLLER_PATHS = [
    "/v1/jobs",
    "/v1/jobs/j-000001",
    "/v1/jobs/j-000001/cancel",
    "/v1/jobs/j-000001/logs",
    "/v1/jobs/j-000001/logs?replica=x&offset=-1&stream=err",
    "/v1/jobs/j-000001/logs?replica=0&offset=99999999999999999999",
    "/v1/jobs/%00",
    "/v1/jobs/j-000001/cancel/more",
]
DASHBOARD_PATHS = [
    "/",
    "/static/dashboard.js",
    "/static/..%2Fserver.py",
    "/static/nope.js",
    "/api/overview",
    "/api/runs",
    "/api/metric-names?run=x",
    "/api/metrics?run=x'&name=loss&name=",
    "/api/metrics",
    "/api/config-diff?a=x",
    "/api/stages",
    "/api/steps",
    "/api/jobs",
    "/api/jobs/j-000001/logs",
    "/api/search?q=%25'",
    "/api/search?q=",
    "/api/sql",
]
CONTENT_TYPES = [
    None,
    "application/json",
    "application/x-ndjson",
    "application/vnd.apache.arrow.stream",
    "APPLICATION/JSON; charset=utf-8",
    "text/plain",
    "text/plain;charset=UTF-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "",
    "application/json, text/plain",
]
PATH_CHARACTERS = string.ascii_letters + string.digits + "-._~%/?&=+:@!$'()*,;[]"
HEADER_VALUE = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
HEADER_NAME = st.text(string.ascii_letters + string.digits + "-_", min_size=1, max_size=20)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(
        ["2026-11-01T00:00:00", "2026-11-01", "9999-12-31", "0001-01-01T00:00:00Z", "12:00"]
    ),
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=6,
)
"""JSON values, empty objects included (the store refuses them: Parquet cannot hold them)."""
column_names = st.sampled_from(["ts", "step", "loss", "run", "msg", "", "TS", "a b"]) | st.text(
    max_size=6
)
rows = st.lists(st.dictionaries(column_names, values, max_size=5), max_size=6)


@st.composite
def requests(draw, paths: list[str]) -> tuple[bytes, bool, str]:
    """(request bytes, whether to half-close after it, its path)."""
    method = draw(
        st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "BREW"])
    )
    path = draw(
        st.sampled_from(paths) | st.text(PATH_CHARACTERS, max_size=30).map(lambda p: "/" + p)
    )
    headers: list[tuple[str, str]] = []
    host = draw(st.sampled_from(["own", "own", "own", "localhost", "evil", "", "none", "two"]))
    headers += {
        "own": [("Host", "{own}")],
        "localhost": [("Host", "localhost:{port}")],
        "evil": [("Host", "evil.example:{port}")],
        "": [("Host", "")],
        "none": [],
        "two": [("Host", "{own}"), ("Host", "evil.example")],
    }[host]
    kind = draw(st.sampled_from(CONTENT_TYPES) | HEADER_VALUE)
    if kind is not None:
        headers.append(("Content-Type", kind))
    origin = draw(st.sampled_from([None, None, "http://{own}", "http://evil.example", "null"]))
    if origin is not None:
        headers.append(("Origin", origin))
    authorization = draw(st.sampled_from([None, None, "Bearer x", "x", ""]))
    if authorization is not None:
        headers.append(("Authorization", authorization))
    headers += draw(st.lists(st.tuples(HEADER_NAME, HEADER_VALUE), max_size=3))
    body = draw(
        st.binary(max_size=200)
        | values.map(lambda v: json.dumps(v).encode())
        | rows.map(lambda r: json.dumps(r).encode())
    )
    framing = draw(
        st.sampled_from(
            [
                *("exact", "exact", "exact", "none", "chunked", "bad-chunked", "short", "huge"),
                *("negative", "text", "two"),
            ]
        )
    )
    half_close = False
    if framing == "exact":
        headers.append(("Content-Length", str(len(body))))
    elif framing == "none":
        body = b""
    elif framing in ("chunked", "bad-chunked"):
        headers.append(("Transfer-Encoding", "chunked"))
        size = f"{len(body):x}" if framing == "chunked" else "zz"
        body = (f"{size}\r\n".encode() + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
    elif framing == "short":
        headers.append(("Content-Length", str(len(body) + 10)))
        half_close = True
    elif framing == "huge":
        headers.append(("Content-Length", str(10**12)))
    elif framing == "negative":
        headers.append(("Content-Length", "-1"))
    elif framing == "text":
        headers.append(("Content-Length", draw(st.sampled_from(["abc", "1e3", "", " 5", "0x10"]))))
    else:
        headers += [("Content-Length", str(len(body))), ("Content-Length", str(len(body) + 1))]
    head = "".join(f"{name}: {value}\r\n" for name, value in headers)
    return f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode() + body, half_close, path


def _fill(request: bytes, server) -> bytes:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return request.replace(b"{own}", f"{host}:{port}".encode()).replace(b"{port}", port.encode())


@settings(FUZZ, max_examples=300)
@given(request=requests(TELEMETRY_PATHS))
def test_random_requests_to_the_telemetry_server(telemetry, request):
    data, half_close, path = request
    data = _fill(data, telemetry)
    before = stored_rows(telemetry.store)
    answer = exchange(telemetry, data, half_close)
    assert_answered(answer, data)
    after = stored_rows(telemetry.store)
    if answer is not None and answer[0] == 200 and path.startswith("/v1/write/"):
        added = sum(after.values()) - sum(before.values())
        assert added == answer[1]["rows"], (answer, data[:500])
    else:
        assert after == before, (answer, data[:500])


@settings(FUZZ, max_examples=300)
@given(request=requests(CONTROLLER_PATHS))
def test_random_requests_to_the_controller_api(controller, request):
    data, half_close, path = request
    data = _fill(data, controller)
    before = queued_jobs(controller)
    answer = exchange(controller, data, half_close)
    assert_answered(answer, data)
    submitted = answer is not None and answer[0] == 200 and path == "/v1/jobs"
    assert queued_jobs(controller) == before + submitted, (answer, data[:500])


@pytest.fixture(scope="module")
def dashboard(telemetry):
    """The dashboard over the fuzzed telemetry server's store (no prefix: no steps or jobs)."""
    with DashboardServer(Sources(None, telemetry.store, "fuzz")) as server:
        yield server


@settings(FUZZ, max_examples=100)
@given(request=requests(DASHBOARD_PATHS))
def test_random_requests_to_the_dashboard(dashboard, telemetry, request):
    data, half_close, _ = request
    data = _fill(data, dashboard)
    before = stored_rows(telemetry.store)
    answer = exchange(dashboard, data, half_close)
    assert_answered(answer, data)
    assert stored_rows(telemetry.store) == before, (answer, data[:500])


def _post(server, path: str, body: bytes, kind: str) -> tuple[bytes, tuple | None]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    return request, exchange(server, request)


def _check_write(telemetry, namespace: str, body: bytes, kind: str, sent_rows: int | None):
    before = stored_rows(telemetry.store)
    request, answer = _post(telemetry, f"/v1/write/{namespace}", body, kind)
    assert_answered(answer, request)
    telemetry.store.flush()  # an acknowledged write must become a segment, not fail later
    after = stored_rows(telemetry.store)
    if answer[0] == 200:
        assert answer[1]["rows"] == after.get(namespace, 0) - before.get(namespace, 0)
        if sent_rows is not None:
            assert answer[1]["rows"] == sent_rows
        assert {n: c for n, c in after.items() if n != namespace} == {
            n: c for n, c in before.items() if n != namespace
        }
    else:
        assert after == before, (answer, request[:500])


@FUZZ
@given(
    namespace=st.sampled_from(NAMESPACES),
    payload=rows | rows.map(lambda r: {"rows": r}) | values,
    ndjson=st.booleans(),
)
def test_random_json_writes_store_all_or_nothing(telemetry, namespace, payload, ndjson):
    if ndjson and isinstance(payload, list):
        body = b"\n".join(json.dumps(row).encode() for row in payload)
    else:
        body = json.dumps(payload).encode()
    sent = len(payload) if isinstance(payload, list) else None
    kind = "application/x-ndjson" if ndjson else "application/json"
    _check_write(telemetry, namespace, body, kind, sent)


ARROW_TYPES = {
    "int8": (pa.int8(), st.integers(-128, 127)),
    "int64": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "uint64": (pa.uint64(), st.integers(0, 2**64 - 1)),
    "float32": (pa.float32(), st.floats(width=32)),
    "float64": (pa.float64(), st.floats()),
    "bool": (pa.bool_(), st.booleans()),
    "string": (pa.string(), st.text(max_size=10)),
    "large_string": (pa.large_string(), st.text(max_size=10)),
    "binary": (pa.binary(), st.binary(max_size=10)),
    "timestamp_us": (pa.timestamp("us"), st.datetimes()),
    "timestamp_ns_utc": (pa.timestamp("ns", "UTC"), st.integers(-(2**62), 2**62)),
    "timestamp_s": (pa.timestamp("s"), st.integers(-(2**40), 2**40)),
    "date32": (pa.date32(), st.dates()),
    "time64": (pa.time64("us"), st.times()),
    "duration": (pa.duration("ms"), st.integers(-(2**40), 2**40)),
    "decimal": (pa.decimal128(10, 2), st.decimals(-(10**7), 10**7, places=2)),
    "list": (pa.list_(pa.int32()), st.lists(st.integers(-100, 100), max_size=3)),
    "struct": (pa.struct([("a", pa.int32())]), st.fixed_dictionaries({"a": st.integers(0, 9)})),
    "null": (pa.null(), st.none()),
}


@st.composite
def arrow_tables(draw) -> pa.Table:
    length = draw(st.integers(0, 5))
    names = draw(st.lists(column_names, min_size=1, max_size=4))
    columns = []
    for _ in names:
        arrow_type, elements = ARROW_TYPES[draw(st.sampled_from(sorted(ARROW_TYPES)))]
        cells = draw(st.lists(st.none() | elements, min_size=length, max_size=length))
        columns.append(pa.array(cells, arrow_type))
    if draw(st.booleans()) and length:
        names[0], columns[0] = (
            "ts",
            pa.array(
                draw(st.lists(st.datetimes(), min_size=length, max_size=length)), pa.timestamp("us")
            ),
        )
    return pa.Table.from_arrays(columns, names=names)


@FUZZ
@given(namespace=st.sampled_from(NAMESPACES), table=arrow_tables())
def test_random_arrow_writes_store_all_or_nothing(telemetry, namespace, table):
    body = arrow_stream(table)
    _check_write(telemetry, namespace, body, "application/vnd.apache.arrow.stream", table.num_rows)


SQL_WORDS = [
    "SELECT", "*", "FROM", '"fuzz.a"', '"fuzz.b"', "fuzz", "WHERE", "ts", "step", "loss", ">",
    "=", "1", "'x'", "(", ")", ",", "GROUP BY", "ORDER BY", "LIMIT", "count(*)", "AS", "n",
    "UNION ALL", "JOIN", "ON", "read_parquet('/etc/passwd')", "COPY", "ATTACH", "PRAGMA", ";",
    "range(10)", "NULL", "TIMESTAMP '9999-12-31'", "CAST(", "AS INT)", "::BLOB", "'\\x00'",
]  # fmt: skip
sql = st.one_of(
    st.lists(st.sampled_from(SQL_WORDS), max_size=12).map(" ".join),
    st.text(max_size=60),
    st.integers(1, 400).map(lambda n: "SELECT " + "(" * n + "1" + ")" * n),
    st.integers(1, 1500).map(lambda n: "SELECT " + " + ".join(["1"] * n)),
    st.just("SELECT * FROM range(100000000)"),
)


@settings(FUZZ, max_examples=200)
@given(query=sql, arrow=st.booleans())
def test_random_sql_is_answered_or_refused_in_one_line(telemetry, query, arrow):
    host, port = telemetry.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"sql": query}).encode()
    accept = "Accept: application/vnd.apache.arrow.stream\r\n" if arrow else ""
    request = (
        f"POST /v1/query HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"{accept}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    assert_answered(exchange(telemetry, request), request)


SPEC = json.loads(state.encode_spec(JobSpec(("true",), name="fuzz")))
"""A whole job spec as the controller API takes it (every key, as the client sends it)."""


@st.composite
def specs(draw):
    spec = json.loads(json.dumps(SPEC))
    for key in draw(st.lists(st.sampled_from(sorted(SPEC)), max_size=3)):
        if draw(st.booleans()):
            spec.pop(key, None)
        else:
            spec[key] = draw(values)
    for key in draw(st.lists(st.sampled_from(sorted(SPEC["resources"])), max_size=2)):
        if isinstance(spec.get("resources"), dict):
            spec["resources"][key] = draw(values)
    if draw(st.integers(0, 9)) == 0:
        spec[draw(st.text(max_size=5))] = draw(values)
    return draw(st.just(spec) | values) if draw(st.integers(0, 9)) == 0 else spec


@settings(FUZZ, max_examples=200)
@given(spec=specs())
def test_random_job_specs_are_queued_or_refused_in_one_line(controller, spec):
    before = queued_jobs(controller)
    request, answer = _post(controller, "/v1/jobs", json.dumps(spec).encode(), "application/json")
    assert_answered(answer, request)
    assert queued_jobs(controller) == before + (answer[0] == 200), (answer, spec)
