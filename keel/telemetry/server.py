"""An HTTP front for a TelemetryStore: writes, SQL queries and tails as JSON or Arrow IPC.

Built on the standard library's `http.server.ThreadingHTTPServer`: it adds no dependency, and the
cost of a request is dominated by its bulk body (an Arrow IPC stream decoded by pyarrow, rows made
durable by the store, results encoded by DuckDB and pyarrow), not by HTTP parsing, so an async
framework would buy little. One thread per connection; HTTP/1.1 keep-alive.

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

With a token, every request needs `Authorization: Bearer TOKEN`. The server never compacts by
itself: whoever opens the store chooses (`keel logs serve` opens it with auto_compact_seconds=300).
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import ipaddress
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import orjson
import pyarrow as pa

from keel.core.errors import KeelError, UsageError
from keel.telemetry.client import poll_rows, time_column
from keel.telemetry.schema import (
    StoreBusyError,
    TelemetryInputError,
    TelemetryQueryError,
    check_namespace,
)
from keel.telemetry.store import TelemetryStore
from keel.telemetry.wire import (
    ARROW_STREAM,
    JSON,
    NDJSON,
    arrow_stream,
    decode_rows,
    json_default,
    ndjson_rows,
)

logger = logging.getLogger(__name__)

FOLLOW_POLL_SECONDS = 0.5
"""How often a follow stream looks for new rows."""
FOLLOW_HEARTBEAT_SECONDS = 10.0
"""A follow stream with no new rows sends a blank line this often (keeps clients' reads alive)."""
CONNECTION_TIMEOUT_SECONDS = 120.0
"""A connection that sends nothing for this long (idle keep-alive, stalled body) is closed."""
LINGER_SECONDS = 2.0
LINGER_BYTES = 64 << 20
"""A refused body is discarded for at most this long / this much before the connection closes."""


class HttpError(Exception):
    """A request answered with `status` and a one-line JSON error."""

    def __init__(self, status: int, message: str, kind: str = "usage") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


class TelemetryServer:
    """Serves `store` over HTTP on host:port (port 0: any free port; see `url`).

    `token`: required as `Authorization: Bearer TOKEN` when set; a server bound to an address other
    than loopback must have one. `max_request_bytes`: larger bodies are refused (413) unread.
    Use `start()` + `stop()` (a background thread) or `serve_forever()` (this thread, until
    KeyboardInterrupt or `stop()` from another thread). The caller owns and closes the store.
    """

    def __init__(
        self,
        store: TelemetryStore,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_request_bytes: int = 256 << 20,
    ) -> None:
        if not token and not is_loopback(host):
            raise UsageError(
                f"refusing to serve telemetry on {host} without a token: pass --token (or set "
                "KEEL_TELEMETRY_TOKEN), or bind to 127.0.0.1"
            )
        if max_request_bytes < 1:
            raise UsageError(f"max_request_bytes must be positive, got {max_request_bytes}")
        self.store = store
        self.token = token or None
        self.max_request_bytes = max_request_bytes
        self._lock = threading.Lock()
        self._idle: set[_Handler] = set()
        self._stopping = threading.Event()
        self._serving = False
        self._closed = False
        self._thread: threading.Thread | None = None
        try:
            self._httpd = _HttpServer((host, port), self)
        except OSError as error:
            raise UsageError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None

    @property
    def url(self) -> str:
        """http://HOST:PORT of the listening socket."""
        host, port = self._httpd.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}"

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def start(self) -> TelemetryServer:
        """Serve in a daemon thread; returns self."""
        self._claim()
        self._thread = threading.Thread(target=self._serve, name="telemetry-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until `stop()` or KeyboardInterrupt; then close connections."""
        self._claim()
        self._serve()

    def _claim(self) -> None:
        with self._lock:
            if self._closed or self._serving:
                raise UsageError("this telemetry server is serving or was stopped: make a new one")
            self._serving = True

    def _serve(self) -> None:
        try:
            self._httpd.serve_forever(poll_interval=0.5)
        finally:
            self._close()

    def stop(self) -> None:
        """Stop accepting, end follow streams and idle connections, wait for running requests."""
        self._begin_stop()
        if self._serving:
            self._httpd.shutdown()
        if self._thread is not None:
            self._thread.join()
        self._close()

    def __enter__(self) -> TelemetryServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _begin_stop(self) -> None:
        with self._lock:
            self._stopping.set()
            idle = list(self._idle)
        for handler in idle:
            handler.interrupt()

    def _close(self) -> None:
        self._begin_stop()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._httpd.server_close()  # joins the connection threads

    def _enter_idle(self, handler: _Handler) -> bool:
        """Mark a connection as waiting for its next request; False when stopping."""
        with self._lock:
            if self._stopping.is_set():
                return False
            self._idle.add(handler)
            return True

    def _leave_idle(self, handler: _Handler) -> None:
        with self._lock:
            self._idle.discard(handler)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], owner: TelemetryServer) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.owner = owner
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "keel-telemetry/1"
    timeout = CONNECTION_TIMEOUT_SECONDS
    server: _HttpServer

    @property
    def owner(self) -> TelemetryServer:
        return self.server.owner

    # -- connection life cycle --------------------------------------------------------------

    def handle_one_request(self) -> None:
        if not self.owner._enter_idle(self):
            self.close_connection = True
            return
        try:
            super().handle_one_request()
        finally:
            self.owner._leave_idle(self)
        if self.owner.stopping:
            self.close_connection = True

    def parse_request(self) -> bool:
        self.owner._leave_idle(self)  # the request line arrived: busy until answered
        return super().parse_request()

    def interrupt(self) -> None:
        """Wake a connection blocked waiting for its next request (the server is stopping)."""
        with contextlib.suppress(OSError):  # already closed by the client
            self.connection.shutdown(socket.SHUT_RD)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    # -- dispatch ---------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        self._body_read = False
        self._headers_sent = False
        target = urlsplit(self.path)
        try:
            self._authorize()
            action = self._route(method, target.path)
            action(parse_qs(target.query))
            if self._body_unread():
                self.close_connection = True
        except HttpError as error:
            self._fail(error.status, error.message, error.kind)
        except TelemetryInputError as error:
            self._fail(400, str(error), "input")
        except TelemetryQueryError as error:
            self._fail(400, str(error), "query")
        except StoreBusyError as error:
            self._fail(503, str(error), "busy")
        except UsageError as error:
            self._fail(400, str(error), "usage")
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("client %s went away during %s %s", self.client_address, method, self.path)
            self.close_connection = True
        except KeelError as error:
            logger.error("telemetry server: %s %s failed: %s", method, target.path, error)
            self._fail(500, str(error), "error")
        except Exception as error:
            logger.exception("telemetry server: %s %s failed", method, target.path)
            self._fail(500, f"internal error: {type(error).__name__}: {_one_line(error)}", "error")

    def _authorize(self) -> None:
        token = self.owner.token
        if token is None:
            return
        given = self.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            value.strip().encode(), token.encode()
        ):
            what = "wrong" if given else "missing"
            raise HttpError(
                401, f"{what} token: send Authorization: Bearer TOKEN (keel logs --token)"
            )

    def _route(self, method: str, path: str) -> Callable[[dict[str, list[str]]], None]:
        routes: dict[str, tuple[str, Callable[..., None]]] = {
            "/v1/health": ("GET", lambda query: self._send_json(200, {"ok": True})),
            "/v1/namespaces": ("GET", self._namespaces),
            "/v1/query": ("POST", self._query),
            "/v1/compact": ("POST", self._compact),
        }
        prefixed: dict[str, tuple[str, Callable[..., None]]] = {
            "/v1/write/": ("POST", self._write),
            "/v1/tail/": ("GET", self._tail),
        }
        if path in routes:
            allowed, action = routes[path]
        else:
            prefix = next((p for p in prefixed if path.startswith(p) and len(path) > len(p)), None)
            if prefix is None:
                raise HttpError(404, f"no endpoint {path}: see /v1/health, /v1/namespaces, ...")
            allowed, handler = prefixed[prefix]
            namespace = check_namespace(unquote(path[len(prefix) :]))

            def action(query: dict[str, list[str]]) -> None:
                handler(namespace, query)

        if method != allowed:
            raise HttpError(405, f"{path} takes {allowed}, not {method}")
        return action

    # -- endpoints --------------------------------------------------------------------------

    def _namespaces(self, query: dict[str, list[str]]) -> None:
        namespaces = {
            name: {
                "columns": {field.name: str(field.type) for field in schema},
                "schema": base64.b64encode(schema.serialize().to_pybytes()).decode("ascii"),
            }
            for name, schema in sorted(self.owner.store.namespaces().items())
        }
        self._send_json(200, {"namespaces": namespaces})

    def _write(self, namespace: str, query: dict[str, list[str]]) -> None:
        kind = self._content_type((ARROW_STREAM, JSON, NDJSON))
        body = self._read_body()
        rows = self.owner.store.write(namespace, decode_rows(kind, body))
        self._send_json(200, {"rows": rows})

    def _query(self, query: dict[str, list[str]]) -> None:
        payload = self._json_body()
        sql = payload.get("sql")
        if not isinstance(sql, str) or not sql.strip():
            raise HttpError(400, 'send {"sql": "SELECT ..."}')
        self._send_table(self.owner.store.query(sql))

    def _compact(self, query: dict[str, list[str]]) -> None:
        payload = self._json_body()
        namespace = payload.get("namespace")
        if namespace is not None:
            check_namespace(namespace)
        report = self.owner.store.compact(namespace)
        self._send_json(200, report.to_dict())

    def _tail(self, namespace: str, query: dict[str, list[str]]) -> None:
        if namespace not in self.owner.store.namespaces():
            raise HttpError(404, f"no namespace {namespace!r}: see /v1/namespaces")
        limit = _int_param(query, "limit", 20)
        after = _time_param(query, "after")
        if _param(query, "follow") in (None, "", "0", "false"):
            self._send_table(self.owner.store.tail(namespace, limit, after))
            return
        self._follow(namespace, limit, after)

    def _follow(self, namespace: str, limit: int, after: datetime | None) -> None:
        time_column(self.owner.store, namespace)  # refuse a namespace without one before streaming
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", NDJSON)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self._headers_sent = True
        self._client_gone = False
        last_sent = time.monotonic()
        for table in poll_rows(
            self.owner.store, namespace, limit, after, FOLLOW_POLL_SECONDS, self._wait
        ):
            if table.num_rows:
                self._send_chunk(ndjson_rows(table))
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent > FOLLOW_HEARTBEAT_SECONDS:
                self._send_chunk(b"\n")
                last_sent = time.monotonic()
        if not self._client_gone:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    def _wait(self, seconds: float) -> bool:
        """Sleep `seconds` watching the socket; False when the client left or we are stopping."""
        deadline = time.monotonic() + seconds
        while not self.owner.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            readable, _, _ = select.select([self.connection], [], [], min(left, 0.5))
            if readable:
                try:
                    data = self.connection.recv(1, socket.MSG_PEEK)
                except OSError:
                    data = b""
                if not data:
                    self._client_gone = True
                    return False
                time.sleep(max(0.0, deadline - time.monotonic()))  # sent more: ignored
        return False

    # -- request and response plumbing ------------------------------------------------------

    def _content_type(self, accepted: tuple[str, ...]) -> str:
        kind = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if kind not in accepted:
            raise HttpError(400, f"Content-Type {kind or '(none)'!r}: send one of {accepted}")
        return kind

    def _read_body(self) -> bytes:
        """The whole body, checked against Content-Length and the size limit before reading."""
        if self.headers.get("Transfer-Encoding"):
            raise HttpError(411, "send a Content-Length (chunked request bodies are not accepted)")
        declared = self.headers.get("Content-Length")
        if declared is None:
            raise HttpError(411, "send a Content-Length header with the body")
        try:
            length = int(declared)
        except ValueError:
            length = -1
        if length < 0:
            raise HttpError(400, f"Content-Length {declared!r} is not a byte count")
        limit = self.owner.max_request_bytes
        if length > limit:
            raise HttpError(
                413,
                f"request body of {length} bytes is over this server's limit of {limit} bytes: "
                "send smaller batches",
            )
        body = self.rfile.read(length)
        if len(body) != length:
            raise HttpError(400, f"body ended after {len(body)} of {length} bytes")
        self._body_read = True
        return body

    def _json_body(self) -> dict[str, Any]:
        self._content_type((JSON,))
        body = self._read_body()
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as error:
            raise HttpError(400, f"body is not JSON: {error}") from None
        if not isinstance(payload, dict):
            raise HttpError(400, "send a JSON object")
        return payload

    def _body_unread(self) -> bool:
        declared = self.headers.get("Content-Length", "0").strip() not in ("", "0")
        return not self._body_read and (declared or bool(self.headers.get("Transfer-Encoding")))

    def _send_table(self, table: pa.Table) -> None:
        if ARROW_STREAM in self.headers.get("Accept", ""):
            self._send(200, ARROW_STREAM, arrow_stream(table))
            return
        columns = [column.to_pylist() for column in table.columns]
        rows = list(zip(*columns, strict=True))
        self._send_json(200, {"columns": table.column_names, "rows": rows})

    def _send_json(self, status: int, payload: Any) -> None:
        self._send(status, JSON, orjson.dumps(payload, default=json_default))

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self._headers_sent = True
        self.wfile.write(body)

    def _send_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _fail(self, status: int, message: str, kind: str) -> None:
        if self._headers_sent:  # a stream broke midway: all we can do is hang up
            self.close_connection = True
            return
        if status >= 500 or status == 401 or self._body_unread():
            self.close_connection = True  # an unread body would be taken for the next request
        logger.debug("%s %s -> %d %s", self.command, self.path, status, message)
        try:
            self._send(status, JSON, orjson.dumps({"error": _one_line(message), "kind": kind}))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return
        if self._body_unread():
            self._linger()

    def _linger(self) -> None:
        """After refusing a request unread: stop sending and discard what the client still sends
        (for at most LINGER_SECONDS / LINGER_BYTES), so that it reads our answer instead of a
        connection reset (closing a socket with unread data resets it)."""
        deadline = time.monotonic() + LINGER_SECONDS
        discarded = 0
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_SECONDS)
            while discarded < LINGER_BYTES and time.monotonic() < deadline:
                data = self.connection.recv(1 << 16)
                if not data:
                    break
                discarded += len(data)


def _param(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[-1] if values else None


def _int_param(query: dict[str, list[str]], name: str, default: int) -> int:
    value = _param(query, name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise HttpError(400, f"{name}={value!r}: expected a count (0 or more)")
    return number


def _time_param(query: dict[str, list[str]], name: str) -> datetime | None:
    value = _param(query, name)
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise HttpError(400, f"{name}={value!r}: expected an ISO-8601 time") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _one_line(error: Exception | str) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
