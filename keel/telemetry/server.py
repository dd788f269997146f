"""An HTTP front for a TelemetryStore: writes, SQL queries and tails as JSON or Arrow IPC.

Served by keel.core.http_server (Starlette on uvicorn) under keel.core.http's policy: loopback
unless a token is set, Host and Origin checked, writes only as JSON / NDJSON / Arrow IPC, bodies
up to `max_request_bytes`, at most `max_connections` connections; query results capped by
`query_limits` (rows, bytes, seconds). Blocking store calls run in the server's thread pool.

Endpoints (errors are JSON `{"error": "one line", "kind": ...}` with a 4xx/5xx status):

- GET  /v1/health -> {"ok": true}
- GET  /v1/namespaces -> {"namespaces": {name: {"columns": {col: type}, "schema": base64}}}
  ("schema" is the Arrow IPC-serialized schema, for clients that want exact types)
- POST /v1/write/{namespace}: an Arrow IPC stream, JSON (a list of row objects or
  {"rows": [...]}) or NDJSON; answers {"rows": n} once the store made them durable.
- POST /v1/query {"sql": "..."}: {"columns": [...], "rows": [[...], ...]}, or an Arrow IPC stream
  when the request accepts application/vnd.apache.arrow.stream.
- GET  /v1/tail/{namespace}?limit=20&after=ISO[&follow=1]: like a query; with follow=1, an
  NDJSON stream of rows as they arrive (blank lines are heartbeats) until either side stops.
- POST /v1/compact {"namespace": name or null}: the store's CompactionReport as JSON.

The server never compacts by itself: whoever opens the store chooses (`keel logs serve` opens it
with auto_compact_seconds=300).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import orjson
import pyarrow as pa
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from keel.core.errors import KeelError, UsageError
from keel.core.http import ARROW_STREAM, JSON, NDJSON, HttpError, HttpPolicy, content_type
from keel.core.http_server import (
    HttpServer,
    ServedApi,
    count_param,
    endpoints,
    json_response,
    read_body,
    read_json,
    run_in_threadpool,
)
from keel.telemetry.client import RowFollower
from keel.telemetry.schema import (
    QueryLimitError,
    QueryLimits,
    StoreBusyError,
    TelemetryInputError,
    TelemetryQueryError,
    check_namespace,
)
from keel.telemetry.store import TelemetryStore
from keel.telemetry.times import check_time_unit
from keel.telemetry.wire import arrow_stream, decode_rows, json_default, ndjson_rows

FOLLOW_POLL_SECONDS = 0.5
"""How often a follow stream looks for new rows."""
FOLLOW_HEARTBEAT_SECONDS = 10.0
"""A follow stream with no new rows sends a blank line this often (keeps clients' reads alive)."""
JSON_BATCH_ROWS = 16_384
"""A JSON answer is encoded this many rows at a time (not the whole result as Python objects)."""
ERRORS = (
    (QueryLimitError, 400, "limit"),
    (TelemetryInputError, 400, "input"),
    (TelemetryQueryError, 400, "query"),
    (StoreBusyError, 503, "busy"),
    (UsageError, 400, "usage"),
    (KeelError, 500, "error"),  # the store failed (disk, corruption): logged
)
"""How the store's errors are answered (the client raises the same classes from `kind`)."""


class TelemetryServer(ServedApi):
    """Serves `store` over HTTP on host:port (port 0: any free port; see `url`).

    `token`: required as `Authorization: Bearer TOKEN` when set; a server bound to an address other
    than loopback must have one. `max_request_bytes`: larger bodies are refused (413) unread.
    `max_connections`: connections served at once (more get 503). `query_limits`: caps on each
    query's and tail's result. Use `start()` + `stop()` (a background thread) or
    `serve_forever()` (this thread, until SIGINT/SIGTERM or `stop()` from another thread).
    The caller owns and closes the store.
    """

    def __init__(
        self,
        store: TelemetryStore,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_request_bytes: int = 256 << 20,
        max_connections: int = 64,
        query_limits: QueryLimits | None = None,
    ) -> None:
        if max_request_bytes < 1:
            raise UsageError(f"max_request_bytes must be positive, got {max_request_bytes}")
        self.store = store
        self.token = token or None
        self.max_request_bytes = max_request_bytes
        self.query_limits = query_limits or QueryLimits()
        policy = HttpPolicy(
            token=self.token, max_body_bytes=max_request_bytes, max_connections=max_connections
        )
        app = endpoints(
            {
                "/v1/health": {"GET": self._health},
                "/v1/namespaces": {"GET": self._namespaces},
                "/v1/write/{namespace:path}": {"POST": self._write},
                "/v1/query": {"POST": self._query},
                "/v1/tail/{namespace:path}": {"GET": self._tail},
                "/v1/compact": {"POST": self._compact},
            }
        )
        self._http = HttpServer(app, policy, host, port, ERRORS, name="telemetry-server")

    @property
    def stopping(self) -> bool:
        return self._http.stopping

    # -- endpoints ------------------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        return json_response({"ok": True})

    async def _namespaces(self, request: Request) -> Response:
        schemas = await run_in_threadpool(self.store.namespaces)
        namespaces = {
            name: {
                "columns": {field.name: str(field.type) for field in schema},
                "schema": base64.b64encode(schema.serialize().to_pybytes()).decode("ascii"),
            }
            for name, schema in sorted(schemas.items())
        }
        return json_response({"namespaces": namespaces})

    async def _write(self, request: Request) -> Response:
        namespace = check_namespace(request.path_params["namespace"])
        kind = content_type(request.headers.getlist("content-type"))
        time_unit = check_time_unit(request.query_params.get("time_unit"))
        body = await read_body(request)
        rows = await run_in_threadpool(self._store_rows, namespace, kind, body, time_unit)
        return json_response({"rows": rows})

    def _store_rows(self, namespace: str, kind: str, body: bytes, time_unit: str | None) -> int:
        return self.store.write(namespace, decode_rows(kind, body), time_unit=time_unit)

    async def _query(self, request: Request) -> Response:
        payload = await read_json(request)
        sql = payload.get("sql")
        if not isinstance(sql, str) or not sql.strip():
            raise HttpError(400, 'send {"sql": "SELECT ..."}')
        table = await run_in_threadpool(self.store.query, sql, self.query_limits)
        return await self._table_response(request, table)

    async def _compact(self, request: Request) -> Response:
        payload = await read_json(request)
        namespace = payload.get("namespace")
        if namespace is not None:
            check_namespace(namespace)
        report = await run_in_threadpool(self.store.compact, namespace)
        return json_response(report.to_dict(), default=json_default)

    async def _tail(self, request: Request) -> Response:
        namespace = check_namespace(request.path_params["namespace"])
        if namespace not in await run_in_threadpool(self.store.namespaces):
            raise HttpError(404, f"no namespace {namespace!r}: see /v1/namespaces")
        limit = count_param(request, "limit", 20)
        if limit > self.query_limits.max_rows:
            raise HttpError(
                400,
                f"limit={limit} is over this server's cap of {self.query_limits.max_rows:,} "
                "rows (max_rows)",
            )
        after = _time_param(request, "after")
        if request.query_params.get("follow", "") in ("", "0", "false"):
            table = await run_in_threadpool(self.store.tail, namespace, limit, after)
            return await self._table_response(request, table)
        follower = await run_in_threadpool(RowFollower, self.store, namespace, limit, after)
        first = await run_in_threadpool(follower.first)
        return StreamingResponse(
            self._follow(follower, first),
            media_type=NDJSON,
            headers={"Cache-Control": "no-store"},
        )

    async def _follow(self, follower: RowFollower, table: pa.Table) -> AsyncIterator[bytes]:
        """NDJSON rows as they arrive, blank-line heartbeats, until the server stops (the client
        leaving cancels this)."""
        last_sent = time.monotonic()
        while True:
            if table.num_rows:
                yield await run_in_threadpool(ndjson_rows, table)
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent > FOLLOW_HEARTBEAT_SECONDS:
                yield b"\n"
                last_sent = time.monotonic()
            await asyncio.sleep(FOLLOW_POLL_SECONDS)
            if self.stopping:
                return
            table = await run_in_threadpool(follower.next)

    async def _table_response(self, request: Request, table: pa.Table) -> Response:
        if table.nbytes > self.query_limits.max_bytes:
            raise QueryLimitError(
                f"the result is {table.nbytes} bytes, over this server's cap of "
                f"{self.query_limits.max_bytes} bytes: select fewer rows or columns"
            )
        if ARROW_STREAM in request.headers.get("accept", ""):
            body = await run_in_threadpool(arrow_stream, table)
            return Response(body, media_type=ARROW_STREAM)
        return StreamingResponse(_json_table(table), media_type=JSON)


def _json_table(table: pa.Table) -> Iterator[bytes]:
    """{"columns": [...], "rows": [[...], ...]} in pieces of JSON_BATCH_ROWS rows."""
    yield b'{"columns":' + orjson.dumps(table.column_names) + b',"rows":['
    separator = b""
    for batch in table.to_batches(max_chunksize=JSON_BATCH_ROWS):
        if not batch.num_rows:
            continue
        columns = [column.to_pylist() for column in batch.columns]
        rows = orjson.dumps(list(zip(*columns, strict=True)), default=json_default)
        yield separator + rows[1:-1]
        separator = b","
    yield b"]}"


def _time_param(request: Request, name: str) -> datetime | None:
    value = request.query_params.get(name)
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise HttpError(400, f"{name}={value!r}: expected an ISO-8601 time") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
