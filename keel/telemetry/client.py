"""One interface to telemetry, local or remote: a TelemetryStore on disk or a `keel logs serve`.

`connect("keel-out/telemetry")` opens the store in this process; `connect("http://host:8470")`
talks to a server. Both answer the `Telemetry` protocol with the same types: write returns the
number of rows made durable, query and tail return Arrow tables, errors are the store's
TelemetryInputError / TelemetryQueryError / UsageError with the same one-line messages.
"""

from __future__ import annotations

import base64
import http.client
import select
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, Protocol
from urllib.parse import quote, urlencode, urlsplit

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from keel.core.errors import KeelError, UsageError
from keel.telemetry.manifest import load_manifest
from keel.telemetry.schema import (
    QueryLimitError,
    StoreBusyError,
    TelemetryInputError,
    TelemetryQueryError,
    check_namespace,
)
from keel.telemetry.shared import SharedStore
from keel.telemetry.store import CompactionReport, TelemetryStore
from keel.telemetry.times import check_time_unit
from keel.telemetry.wire import ARROW_STREAM, arrow_stream, json_default, read_stream

FOLLOW_BATCH_ROWS = 100_000
"""At most this many new rows per poll of a follow (more in one poll: the oldest are skipped)."""


class Telemetry(Protocol):
    """What a TelemetryStore and an HttpTelemetry both offer."""

    def write(
        self,
        namespace: str,
        data: pa.Table | pa.RecordBatch | list[dict],
        time_unit: str | None = None,
    ) -> int: ...

    def query(self, sql: str) -> pa.Table: ...

    def tail(self, namespace: str, limit: int = 20, after: datetime | None = None) -> pa.Table: ...

    def namespaces(self) -> dict[str, pa.Schema]: ...

    def compact(self, namespace: str | None = None) -> CompactionReport: ...

    def close(self) -> None: ...


class TelemetryConnectionError(KeelError):
    """The connection to a telemetry server broke mid-request; a write may or may not be stored."""


def connect(target: str, token: str | None = None) -> Telemetry:
    """An HttpTelemetry for an http(s):// URL, else a handle on the store at the directory `target`
    (shared with every other handle on it in this process: one writer per root and process)."""
    if target.startswith(("http://", "https://")):
        return HttpTelemetry(target, token=token)
    return SharedStore(target)


class HttpTelemetry:
    """A client of a telemetry server at `url` (http:// or https://).

    Tables travel as Arrow IPC streams, row lists as JSON. Each thread keeps its own keep-alive
    connection; reads (query, tail, namespaces) are retried once on a connection the server
    closed, writes never are (a retried write could store its rows twice). `timeout`: seconds
    to wait for the server on each socket operation.
    """

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"telemetry URL {url!r}: expected http://HOST:PORT or https://...")
        self.url = url.rstrip("/")
        self.token = token or None
        self.timeout = timeout
        self._parts = parts
        self._base = parts.path.rstrip("/")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[http.client.HTTPConnection] = []

    def __enter__(self) -> HttpTelemetry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the Telemetry protocol -------------------------------------------------------------

    def write(
        self,
        namespace: str,
        data: pa.Table | pa.RecordBatch | list[dict],
        time_unit: str | None = None,
    ) -> int:
        """Send rows; returns how many the server made durable. `time_unit`: the unit (s, ms, us,
        ns) of epoch numbers in time columns, as for TelemetryStore.write."""
        check_namespace(namespace)
        check_time_unit(time_unit)
        if isinstance(data, pa.RecordBatch):
            data = pa.Table.from_batches([data])
        if isinstance(data, pa.Table):
            body, kind = arrow_stream(data), ARROW_STREAM
        elif isinstance(data, list):
            body = orjson.dumps(data, default=json_default, option=orjson.OPT_SERIALIZE_NUMPY)
            kind = "application/json"
        else:
            raise TelemetryInputError(
                f"cannot write {type(data).__name__}: send an Arrow table or a list of row dicts"
            )
        path = f"/v1/write/{quote(namespace, safe='')}"
        if time_unit is not None:
            path += f"?time_unit={time_unit}"
        answer = self._request("POST", path, body, {"Content-Type": kind}, idempotent=False)
        return int(orjson.loads(answer)["rows"])

    def query(self, sql: str) -> pa.Table:
        """DuckDB SQL run by the server; the result as an Arrow table."""
        body = orjson.dumps({"sql": sql})
        headers = {"Content-Type": "application/json", "Accept": ARROW_STREAM}
        return read_stream(self._request("POST", "/v1/query", body, headers))

    def tail(self, namespace: str, limit: int = 20, after: datetime | None = None) -> pa.Table:
        """The latest `limit` rows (later than `after`), ascending by time."""
        path = f"/v1/tail/{quote(check_namespace(namespace), safe='')}?{_tail_query(limit, after)}"
        return read_stream(self._request("GET", path, None, {"Accept": ARROW_STREAM}))

    def namespaces(self) -> dict[str, pa.Schema]:
        answer = orjson.loads(self._request("GET", "/v1/namespaces"))
        return {
            name: pa.ipc.read_schema(pa.py_buffer(base64.b64decode(entry["schema"])))
            for name, entry in answer["namespaces"].items()
        }

    def compact(self, namespace: str | None = None) -> CompactionReport:
        body = orjson.dumps({"namespace": namespace})
        answer = orjson.loads(
            self._request("POST", "/v1/compact", body, {"Content-Type": "application/json"})
        )
        return CompactionReport(**answer)

    def follow(
        self, namespace: str, limit: int = 20, after: datetime | None = None
    ) -> Iterator[dict[str, Any]]:
        """The latest `limit` rows, then each new row as it arrives, as dicts (times as ISO
        strings); runs until the server stops or the caller stops iterating."""
        query = _tail_query(limit, after) + "&follow=1"
        path = f"{self._base}/v1/tail/{quote(check_namespace(namespace), safe='')}?{query}"
        connection = self._new_connection()
        try:
            try:
                connection.request("GET", path, headers=self._headers({}))
                response = connection.getresponse()
            except ConnectionRefusedError:
                raise self._no_server() from None
            except (http.client.HTTPException, OSError) as error:
                raise self._broken("follow", error) from None
            if response.status != 200:
                self._raise(response.status, response.read())
            while line := response.readline():
                if line.strip():
                    yield orjson.loads(line)
        finally:
            connection.close()

    def close(self) -> None:
        """Close every thread's connection (a later call opens a new one)."""
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()

    # -- HTTP plumbing ----------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        idempotent: bool = True,
    ) -> bytes:
        """The body of a 200 answer; raises the server's error otherwise."""
        for attempt in (1, 2):
            connection, reused = self._connection()
            try:
                connection.request(method, self._base + path, body, self._headers(headers or {}))
                response = connection.getresponse()
                answer = response.read()
            except ConnectionRefusedError:
                self._drop(connection)
                raise self._no_server() from None
            except (http.client.HTTPException, OSError) as error:
                self._drop(connection)
                if reused and idempotent and attempt == 1:
                    continue
                raise self._broken(f"{method} {path.split('?')[0]}", error) from None
            if response.will_close:
                self._drop(connection)
            if response.status != 200:
                self._raise(response.status, answer)
            return answer
        raise AssertionError("unreachable")

    def _headers(self, headers: dict[str, str]) -> dict[str, str]:
        if self.token:
            return {**headers, "Authorization": f"Bearer {self.token}"}
        return headers

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it was used before."""
        connection = getattr(self._local, "connection", None)
        if connection is not None and connection.sock is not None and _closed_by_peer(connection):
            self._drop(connection)
            connection = None
        if connection is None:
            connection = self._new_connection()
            self._local.connection = connection
            with self._lock:
                self._connections.append(connection)
        return connection, connection.sock is not None

    def _new_connection(self) -> http.client.HTTPConnection:
        kind = (
            http.client.HTTPSConnection
            if self._parts.scheme == "https"
            else (http.client.HTTPConnection)
        )
        return kind(self._parts.hostname, self._parts.port, timeout=self.timeout)

    def _drop(self, connection: http.client.HTTPConnection) -> None:
        connection.close()
        if getattr(self._local, "connection", None) is connection:
            self._local.connection = None
        with self._lock:
            if connection in self._connections:
                self._connections.remove(connection)

    def _no_server(self) -> UsageError:
        return UsageError(f"no telemetry server at {self.url}: start it with `keel logs serve`")

    def _broken(self, what: str, error: Exception) -> TelemetryConnectionError:
        detail = str(error) or type(error).__name__
        return TelemetryConnectionError(
            f"lost the connection to the telemetry server at {self.url} during {what}: {detail}"
        )

    def _raise(self, status: int, answer: bytes) -> None:
        try:
            payload = orjson.loads(answer)
            message, kind = str(payload["error"]), payload.get("kind")
        except (orjson.JSONDecodeError, KeyError, TypeError):
            message, kind = f"HTTP {status}: {answer[:200].decode(errors='replace')}", None
        errors: dict[str | None, type[UsageError]] = {
            "limit": QueryLimitError,
            "input": TelemetryInputError,
            "query": TelemetryQueryError,
            "busy": StoreBusyError,
        }
        if kind in errors:
            raise errors[kind](message)
        if status >= 500:
            raise KeelError(f"the telemetry server at {self.url} failed: {message}")
        raise UsageError(message)


def poll_rows(
    store: TelemetryStore | SharedStore,
    namespace: str,
    limit: int = 20,
    after: datetime | None = None,
    interval: float = 0.5,
    wait: Callable[[float], bool] | None = None,
) -> Iterator[pa.Table]:
    """The latest `limit` rows, then every `interval` seconds the rows whose time is later than
    the last one seen (possibly none). Ends when `wait(interval)` returns False (default: sleeps
    and goes on forever)."""

    def sleep(seconds: float) -> bool:
        time.sleep(seconds)
        return True

    wait = wait or sleep
    follower = RowFollower(store, namespace, limit, after)
    yield follower.first()
    while wait(interval):
        yield follower.next()


class RowFollower:
    """A namespace's rows in time order as they arrive: `first()` the latest `limit` rows (later
    than `after`), then each `next()` the rows later than the last one seen (possibly none; at
    most FOLLOW_BATCH_ROWS, the newest). Raises UsageError at once for a namespace without a
    time column. Blocking: each call is one store query."""

    def __init__(
        self,
        store: TelemetryStore | SharedStore,
        namespace: str,
        limit: int = 20,
        after: datetime | None = None,
    ) -> None:
        self.store, self.namespace, self.limit = store, namespace, limit
        self.column = time_column(store, namespace)
        self.last = after

    def first(self) -> pa.Table:
        table = self.store.tail(self.namespace, max(self.limit, 1), self.last)  # one: the time seen
        self.last = _latest(table, self.column, self.last)
        return table.slice(table.num_rows - min(self.limit, table.num_rows))

    def next(self) -> pa.Table:
        table = self.store.tail(self.namespace, FOLLOW_BATCH_ROWS, self.last)
        self.last = _latest(table, self.column, self.last)
        return table


def time_column(store: TelemetryStore | SharedStore, namespace: str) -> str:
    """The namespace's time column, which tail orders and filters by."""
    manifest = load_manifest(store.root / check_namespace(namespace))
    column = manifest.options.time_column if manifest is not None else None
    if column is None:
        raise UsageError(f"namespace {namespace!r} has no timestamp column to follow rows by")
    return column


def _latest(table: pa.Table, column: str, default: datetime | None) -> datetime | None:
    if not table.num_rows:
        return default
    latest = pc.max(table.column(column)).as_py()
    return latest if latest is not None else default


def _tail_query(limit: int, after: datetime | None) -> str:
    params: dict[str, str | int] = {"limit": limit}
    if after is not None:
        params["after"] = after.isoformat()
    return urlencode(params)


def _closed_by_peer(connection: http.client.HTTPConnection) -> bool:
    """Whether an idle keep-alive socket was closed by the server (readable = EOF or junk)."""
    try:
        readable, _, _ = select.select([connection.sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
