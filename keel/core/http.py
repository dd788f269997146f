"""The HTTP request policy of every keel server (telemetry, the controller API, the dashboard), in
one place: an ASGI middleware that checks each request before the application sees it.

A request passes when, in this order:
1. its Host names this server (a loopback name or the bound address, with the bound port;
   beyond loopback also this machine's host name, and any name on a wildcard bind): else 421.
   A page whose DNS name was rebound to 127.0.0.1 sends its own name, so it is refused;
2. it has no Origin, or the server's own (and no cross-site Sec-Fetch-Site): else 403;
3. with a token set: `Authorization: Bearer TOKEN`, compared in constant time: else 401;
4. a write (POST, PUT, PATCH, DELETE) says a Content-Type from `write_types`, none of which a
   browser may send cross-origin without a CORS preflight (text/plain, forms and multipart are
   such types): else 415. The servers answer no preflight, so a page cannot send them at all;
5. its body is bounded: Content-Length a decimal count (else 400) of at most `max_body_bytes`
   (else 413, unread), a write without a length or chunked body 411; a chunked body is
   counted as it is read and cut at the limit (413); a body that stalls for
   `body_timeout_seconds` is 408.
Errors are JSON `{"error": "one line", "kind": ...}`. Exceptions from the application map to
statuses by `ErrorMap` (first matching class wins): keel's UsageError and KeelError are 400,
anything else is logged with its traceback and answered 500 "internal error".
Connections are bounded by the server (keel.core.http_server: `max_connections`, 503 beyond).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
import socket
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from keel.core.errors import KeelError, UsageError, one_line

logger = logging.getLogger(__name__)

ARROW_STREAM = "application/vnd.apache.arrow.stream"
JSON = "application/json"
NDJSON = "application/x-ndjson"
WRITE_TYPES = frozenset({JSON, NDJSON, ARROW_STREAM})
"""Content types a write may have: none is a 'simple' type a page may send without a preflight."""
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
_DIGITS = re.compile(r"[0-9]{1,18}")
_PORT = re.compile(r"[0-9]{1,5}")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ErrorMap = Sequence[tuple[type[BaseException], int, str]]
"""(exception class, HTTP status, kind), in order: an error takes the first class that it is."""

DEFAULT_ERRORS: ErrorMap = ((UsageError, 400, "usage"), (KeelError, 400, "error"))


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class HttpPolicy:
    """What a server accepts. `token`: required as `Authorization: Bearer TOKEN` when set (a
    server bound beyond loopback must have one). `max_body_bytes`: the largest request body.
    `max_connections`: open connections served at once (more get 503). `body_timeout_seconds`:
    the longest wait for the next bytes of a body. `write_types`: the Content-Types a write may
    have. `allowed_hosts`: more names the Host header may give (e.g. a DNS alias of the machine).
    """

    token: str | None = None
    max_body_bytes: int = 1 << 20
    max_connections: int = 64
    body_timeout_seconds: float = 60.0
    write_types: frozenset[str] = WRITE_TYPES
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_connections < 1:
            raise UsageError(
                f"max_body_bytes and max_connections must be positive, got "
                f"{self.max_body_bytes} and {self.max_connections}"
            )
        if not self.body_timeout_seconds > 0:
            raise UsageError(f"body_timeout_seconds must be positive: {self.body_timeout_seconds}")
        if self.write_types - WRITE_TYPES:
            raise UsageError(
                f"write types {sorted(self.write_types - WRITE_TYPES)} can be sent by any web page"
                f" without a preflight: use some of {sorted(WRITE_TYPES)}"
            )

    def check_bind(self, host: str) -> None:
        """Refuse to serve beyond loopback without a token."""
        if not self.token and not is_loopback(host):
            raise UsageError(
                f"refusing to serve on {host} without a token: pass --token, or bind to 127.0.0.1"
            )


class HttpError(Exception):
    """A request answered with `status` and a one-line JSON error of `kind`."""

    def __init__(self, status: int, message: str, kind: str = "usage") -> None:
        super().__init__(message)
        self.status = status
        self.message = one_line(message)
        self.kind = kind


def error_body(message: str, kind: str) -> bytes:
    return orjson.dumps({"error": one_line(message), "kind": kind})


class PolicyGuard:
    """The ASGI middleware that applies `policy` to every request to `app` (see the module's
    docstring), for a server listening on `host`:`port`, and answers `errors` as JSON."""

    def __init__(
        self, app: AsgiApp, policy: HttpPolicy, host: str, port: int, errors: ErrorMap = ()
    ) -> None:
        self.app = app
        self.policy = policy
        self.port = port
        self.errors = (*errors, *DEFAULT_ERRORS)
        bound = host.strip("[]").lower()
        self.any_host = bound in WILDCARD_HOSTS
        names = {*LOOPBACK_NAMES, bound, *(name.lower() for name in policy.allowed_hosts)}
        if not is_loopback(bound):
            names.add(socket.gethostname().lower())
        self.host_names = frozenset(names)
        shown = "127.0.0.1" if is_loopback(bound) or self.any_host else host
        self._own = f"http://{shown}:{port}"
        self._token = policy.token.encode() if policy.token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            length = self.check(scope)
            await self.app(scope, self._bounded(receive, length), tracked_send)
        except Exception as error:
            status, kind = self._classify(error)
            if status >= 500:
                logger.error(
                    "%s %s failed", scope["method"], scope["path"], exc_info=not _keel(error)
                )
            if started:
                raise  # a stream broke midway: the server hangs up
            message = str(error) if status < 500 or _keel(error) else _internal(error)
            await send_error(send, status, message, kind)

    def check(self, scope: Scope) -> int | None:
        """Apply the policy to the request's headers; its declared body length (None: chunked)."""
        headers = _headers(scope)
        authority = self._check_host(headers)
        self._check_origin(headers, authority, scope.get("scheme", "http"))
        self._check_token(headers)
        return self._check_body(scope["method"], headers)

    def _check_host(self, headers: dict[bytes, list[bytes]]) -> tuple[str, int]:
        values = headers.get(b"host", [])
        given = values[0].decode("latin-1") if len(values) == 1 else ""
        name, port = _split_authority(given)
        if port != self.port or name is None or not (self.any_host or name in self.host_names):
            raise HttpError(
                421,
                f"Host {given!r} does not name this server: use {self._own} (DNS rebinding "
                "and foreign names are refused)",
            )
        return name, port

    def _check_origin(
        self, headers: dict[bytes, list[bytes]], authority: tuple[str, int], scheme: str
    ) -> None:
        site = b",".join(headers.get(b"sec-fetch-site", [])).lower()
        if site in (b"cross-site", b"same-site"):
            raise HttpError(403, "cross-site requests are refused (Sec-Fetch-Site); Origin too")
        for value in headers.get(b"origin", []):
            origin = value.decode("latin-1").strip()
            own_scheme, _, rest = origin.partition("://")
            if own_scheme.lower() != scheme or "/" in rest or _split_authority(rest) != authority:
                raise HttpError(
                    403, f"Origin {origin!r} is not this server's: cross-origin requests refused"
                )

    def _check_token(self, headers: dict[bytes, list[bytes]]) -> None:
        if self._token is None:
            return
        values = headers.get(b"authorization", [])
        given = values[0] if len(values) == 1 else b""
        scheme, _, value = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(value, self._token):
            what = "wrong" if values else "missing"
            raise HttpError(401, f"{what} token: send Authorization: Bearer TOKEN", "auth")

    def _check_body(self, method: str, headers: dict[bytes, list[bytes]]) -> int | None:
        if method in WRITE_METHODS:
            kind = content_type(headers.get(b"content-type", []))
            if kind not in self.policy.write_types:
                raise HttpError(
                    415,
                    f"Content-Type {kind or '(none)'!r}: send one of "
                    f"{', '.join(sorted(self.policy.write_types))}",
                )
        lengths = headers.get(b"content-length", [])
        if lengths:
            declared = b",".join(lengths).decode("latin-1").strip()
            if not _DIGITS.fullmatch(declared):
                raise HttpError(400, f"Content-Length {declared!r} is not a byte count")
            length = int(declared)
            if length > self.policy.max_body_bytes:
                raise HttpError(413, self._too_large(f"request body of {length} bytes"))
            return length
        if b"transfer-encoding" in headers:
            return None
        if method in WRITE_METHODS:
            raise HttpError(411, "send a Content-Length header with the body")
        return 0

    def _too_large(self, what: str) -> str:
        limit = self.policy.max_body_bytes
        return f"{what} is over this server's limit of {limit} bytes: send smaller batches"

    def _bounded(self, receive: Receive, length: int | None) -> Receive:
        """`receive` that counts body bytes (413 past the limit) and times out stalled bodies."""
        limit, timeout = self.policy.max_body_bytes, self.policy.body_timeout_seconds
        received = 0
        done = length == 0

        async def bounded_receive() -> Message:
            nonlocal received, done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout)
            except TimeoutError:
                raise HttpError(408, f"the request body stalled for {timeout:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HttpError(413, self._too_large("the chunked request body"))
                done = not message.get("more_body", False)
            return message

        return bounded_receive

    def _classify(self, error: Exception) -> tuple[int, str]:
        if isinstance(error, HttpError):
            return error.status, error.kind
        for kind_of_error, status, kind in self.errors:
            if isinstance(error, kind_of_error):
                return status, kind
        return 500, "error"


async def send_error(
    send: Send, status: int, message: str, kind: str, *, close: bool = False
) -> None:
    """Answer with a JSON error. The connection stays usable unless `close` (the server drops
    what is left of an unread body, so the client reads this answer instead of a reset)."""
    body = error_body(message, kind)
    headers = [(b"content-type", JSON.encode()), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def content_type(values: Sequence[bytes | str]) -> str:
    """The media type of a Content-Type header, lowercased, without parameters ('' if absent or
    given twice)."""
    if len(values) != 1:
        return ""
    value = values[0].decode("latin-1") if isinstance(values[0], bytes) else values[0]
    return value.split(";")[0].strip().lower()


def _headers(scope: Scope) -> dict[bytes, list[bytes]]:
    headers: dict[bytes, list[bytes]] = {}
    for name, value in scope["headers"]:
        headers.setdefault(name.lower(), []).append(value)
    return headers


def _split_authority(authority: str) -> tuple[str | None, int | None]:
    """(lowercased host name, port) of `host[:port]` or `[v6][:port]`; port 80 if absent;
    (None, None) if malformed."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        name, _, rest = authority[1:].partition("]")
        if rest and not rest.startswith(":"):
            return None, None
        port_text = rest[1:] if rest else ""
    else:
        name, _, port_text = authority.partition(":")
    if not name or any(c in name for c in "@/\\ \t") or not _PORT.fullmatch(port_text or "80"):
        return None, None
    return name, int(port_text) if port_text else 80


def _keel(error: Exception) -> bool:
    return isinstance(error, KeelError | HttpError)


def _internal(error: Exception) -> str:
    return f"internal error ({type(error).__name__}): see the server's log"
