"""The fuzz suite's settings and a raw HTTP client that sends exactly the bytes it is given."""

import http.client
import json
import socket
import sqlite3

from hypothesis import HealthCheck, settings

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
"""Every fuzz test: the same examples on every run (derandomized), no example database."""


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def stored_rows(store) -> dict[str, int]:
    """Rows per namespace."""
    return {
        name: store.query(f'SELECT count(*) AS n FROM "{name}"').column("n")[0].as_py()
        for name in store.namespaces()
    }


def queued_jobs(server) -> int:
    with sqlite3.connect(server.root / "state.db") as database:
        return database.execute("SELECT count(*) FROM jobs").fetchone()[0]


def exchange(server, request: bytes, half_close: bool = False):
    """Send `request` as is; (status, parsed JSON or text), or None when the server closed the
    connection without an answer (only allowed after `half_close`: the body was left short)."""
    with socket.create_connection(address(server), timeout=10) as connection:
        connection.sendall(request)
        if half_close:
            connection.shutdown(socket.SHUT_WR)
        method = request.split(b" ", 1)[0].decode("latin-1")
        response = http.client.HTTPResponse(connection, method=method)
        try:
            response.begin()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            assert half_close, f"no answer to {request[:300]!r}"
            return None
        streamed = response.getheader("Content-Type") == "application/x-ndjson"
        data = b"" if streamed else response.read()  # a follow stream runs until closed
    try:
        payload = json.loads(data)
    except ValueError:
        payload = data.decode(errors="replace")
    return response.status, payload


def assert_answered(answer, request: bytes) -> None:
    """Not a 5xx; an error is JSON with one line."""
    if answer is None:
        return
    status, payload = answer
    assert status < 500, (answer, request[:500])
    if status >= 400 and not request.startswith(b"HEAD "):  # an answer to HEAD has no body
        assert isinstance(payload, dict) and "\n" not in payload["error"], (answer, request[:500])
