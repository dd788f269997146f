"""Serving an HTTP API: Starlette routes behind keel.core.http's policy, run by uvicorn (httptools).

    server = HttpServer(endpoints({"/v1/health": {"GET": health}}), HttpPolicy(token=...))
    server.start()   # a background thread; or server.serve_forever() in this one
    server.url       # http://127.0.0.1:PORT (the socket is bound at construction: port 0 works)
    server.stop()    # stop accepting, close idle connections, wait for running requests

Endpoints are `async def endpoint(request) -> Response`; blocking work goes through
`run_in_threadpool`. Errors are raised (HttpError, or exceptions that the server's ErrorMap
names), never written as responses by hand, so that every error is the same one-line JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Self

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route, Router

from keel.core.errors import KeelError, UsageError
from keel.core.http import (
    JSON,
    AsgiApp,
    ErrorMap,
    HttpError,
    HttpPolicy,
    PolicyGuard,
    Receive,
    Scope,
    Send,
    content_type,
    error_body,
    send_error,
)

__all__ = [
    "HttpServer",
    "count_param",
    "endpoints",
    "json_response",
    "read_body",
    "read_json",
    "require_type",
    "run_in_threadpool",
]

logger = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]
KEEP_ALIVE_SECONDS = 30.0
"""An idle keep-alive connection is closed after this long."""
HEADER_SECONDS = 30.0
"""A connection must send a whole request head this soon after it opens or after its previous
answer (slow-header clients cannot hold connection slots)."""
GRACEFUL_STOP_SECONDS = 10.0
"""stop() waits this long for running requests before cancelling them."""
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


class HttpServer:
    """Serves `app` (an ASGI app, e.g. from `endpoints`) under `policy` on host:port (port 0:
    any free port; see `url`). `errors`: how exceptions from `app` become statuses (ErrorMap).
    Use `start()` + `stop()` (a daemon thread) or `serve_forever()` (this thread, until `stop()`
    from another thread, SIGINT or SIGTERM: uvicorn stops, then re-raises the signal)."""

    def __init__(
        self,
        app: AsgiApp,
        policy: HttpPolicy,
        host: str = "127.0.0.1",
        port: int = 0,
        errors: ErrorMap = (),
        name: str = "keel-http",
    ) -> None:
        import uvicorn  # here, not at the top: `keel` commands that serve nothing start faster

        policy.check_bind(host)
        self.name = name
        self._socket = _listen(host, port)
        bound_port = self._socket.getsockname()[1]
        self._host = host
        guard = PolicyGuard(app, policy, host, bound_port, errors)
        self._config = uvicorn.Config(
            guard,
            http=_protocol(policy.max_connections),
            ws="none",
            lifespan="off",
            log_config=None,
            access_log=False,
            proxy_headers=False,
            server_header=False,
            timeout_keep_alive=int(KEEP_ALIVE_SECONDS),
            timeout_graceful_shutdown=int(GRACEFUL_STOP_SECONDS),
        )
        self._server = uvicorn.Server(self._config)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._claimed = False
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """http://HOST:PORT of the listening socket."""
        host = self._socket.getsockname()[0] if self._host in ("", "0.0.0.0", "::") else self._host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self._socket.getsockname()[1]}"

    @property
    def stopping(self) -> bool:
        """True once stop() was called or a signal asked the server to stop (streams end)."""
        return self._stopping.is_set() or self._server.should_exit

    def start(self) -> HttpServer:
        """Serve in a daemon thread; returns once the server accepts connections."""
        self._claim()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            self._stopping.wait(0.01)
        if not self._server.started:
            raise KeelError(f"the {self.name} server did not start: see the log above")
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until stop(), SIGINT or SIGTERM."""
        self._claim()
        self._run()

    def stop(self) -> None:
        """Stop accepting, close idle connections, end streams (see `stopping`), and wait up to
        GRACEFUL_STOP_SECONDS for running requests."""
        self._stopping.set()
        self._server.should_exit = True
        with self._lock:
            claimed, self._claimed = self._claimed, True
        if not claimed:  # never served: nothing runs, only the socket to close
            self._socket.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> HttpServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _claim(self) -> None:
        with self._lock:
            if self._claimed:
                raise UsageError(
                    f"this {self.name} server is serving or was stopped: make a new one"
                )
            self._claimed = True

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self._stopping.set()
            self._socket.close()


def endpoints(table: Mapping[str, Mapping[str, Endpoint]]) -> Router:
    """A Starlette router: {path: {method: endpoint}}; paths take Starlette's `{name}` and
    `{name:path}` parameters. Unknown paths are 404 and other methods 405, as JSON errors."""
    routes = [
        Route(path, _by_method(path, dict(methods)), methods=METHODS)
        for path, methods in table.items()
    ]
    return Router(routes, default=_not_found)


async def read_body(request: Request) -> bytes:
    """The whole request body (the policy has bounded its size and its pace)."""
    chunks = []
    try:
        async for chunk in request.stream():
            chunks.append(chunk)
    except ClientDisconnect:
        raise HttpError(400, "the client went away before the body ended") from None
    return b"".join(chunks)


def require_type(request: Request, *kinds: str) -> str:
    """The request's Content-Type if it is one of `kinds`, else 415."""
    kind = content_type(request.headers.getlist("content-type"))
    if kind not in kinds:
        raise HttpError(415, f"Content-Type {kind or '(none)'!r}: send {' or '.join(kinds)}")
    return kind


def count_param(request: Request, name: str, default: int) -> int:
    """A query parameter that is a count (0 or more); 400 if it is anything else."""
    value = request.query_params.get(name)
    if value is None:
        return default
    if not value.isascii() or not value.isdigit() or len(value) > 18:
        raise HttpError(400, f"{name}={value!r}: expected a count (0 or more)")
    return int(value)


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object (415 unless sent as application/json, 400 unless an object)."""
    require_type(request, JSON)
    body = await read_body(request)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise HttpError(400, f"body is not JSON: {error}") from None
    if not isinstance(payload, dict):
        raise HttpError(400, f"send a JSON object, not {type(payload).__name__}")
    return payload


def json_response(
    payload: Any, status: int = 200, default: Callable[[Any], Any] | None = None
) -> Response:
    """`payload` as a JSON response (orjson; `default` for types it does not know)."""
    return Response(orjson.dumps(payload, default=default), status, media_type=JSON)


def _by_method(path: str, methods: dict[str, Endpoint]) -> Endpoint:
    allowed = ", ".join(methods)

    async def dispatch(request: Request) -> Response:
        endpoint = methods.get(request.method)
        if endpoint is None and request.method == "HEAD":
            endpoint = methods.get("GET")  # the server sends the head of the GET answer
        if endpoint is None:
            raise HttpError(405, f"{path} takes {allowed}, not {request.method}")
        return await endpoint(request)

    return dispatch


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    raise HttpError(404, f"no endpoint {scope['method']} {scope['path']}")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]") or "0.0.0.0", port))
        listener.listen(2048)
    except OSError as error:
        listener.close()
        raise UsageError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return listener


def _protocol(max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with JSON errors for malformed requests, at most
    `max_connections` connections served (more: 503), and a deadline for request heads."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Protocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            self._cancel_head_timer()
            if len(self.connections) <= max_connections:
                super().on_headers_complete()
                return
            logger.warning(
                "%d connections: over the limit of %d, answering 503",
                len(self.connections),
                max_connections,
            )
            app, self.app = self.app, _busy
            try:
                super().on_headers_complete()
            finally:
                self.app = app

        def on_response_complete(self) -> None:
            super().on_response_complete()
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self._arm_head_timer()

        def send_400_response(self, msg: str) -> None:
            body = error_body(
                "malformed HTTP request (request line, a header or Content-Length)", "usage"
            )
            head = (
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            )
            self.transport.write(head + body)
            self.transport.close()

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(HEADER_SECONDS, self._head_timeout)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            with contextlib.suppress(Exception):
                self.transport.close()

    return Protocol


async def _busy(scope: Scope, receive: Receive, send: Send) -> None:
    await send_error(
        send,
        503,
        "too many connections to this server: try again shortly",
        "overloaded",
        close=True,
    )


class ServedApi:
    """What a keel server object (the telemetry server, the controller API, the dashboard) offers
    around its one HttpServer, kept in `self._http` by the subclass's __init__: its url, serving
    in a background thread or in this one, stopping, and use as a context manager."""

    _http: HttpServer

    @property
    def url(self) -> str:
        """http://HOST:PORT of the listening socket."""
        return self._http.url

    def start(self) -> Self:
        """Serve in a daemon thread; returns self."""
        self._http.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until `stop()`, SIGINT or SIGTERM (re-raised once stopped)."""
        self._http.serve_forever()

    def stop(self) -> None:
        """Stop accepting, close idle connections, wait for running requests."""
        self._http.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
