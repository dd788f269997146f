"""The controller over HTTP, for job commands on other machines: `--controller http://host:port`.

`keel cluster start --port N` serves it next to the tick loop (standard library server: the
requests are small and few). JSON in and out; errors are {"error": one line} with 400 (bad input,
e.g. a negative count), 401 (token), 404 (unknown job or path). Bound to 127.0.0.1 unless a token
is given.

    POST /v1/jobs                      JobSpec as JSON -> {"id": "j-000042"}
    GET  /v1/jobs/ID                   the job's status (as `keel job status --json`)
    POST /v1/jobs/ID/cancel            -> {"state": ...}
    GET  /v1/jobs/ID/logs?replica=0&stream=stdout&offset=0 -> {"text", "offset", "done"}
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from keel.cluster import state
from keel.cluster.logs import output_file
from keel.cluster.spec import JobSpec
from keel.core.errors import KeelError, UsageError
from keel.telemetry.server import is_loopback

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20
LOG_CHUNK_BYTES = 1 << 20


class ControllerServer:
    """Serves the controller state under `root` over HTTP on a background thread."""

    def __init__(
        self, root: Path, host: str = "127.0.0.1", port: int = 0, token: str | None = None
    ) -> None:
        if not is_loopback(host) and not token:
            raise UsageError(
                f"binding the controller to {host} needs --token (or bind to 127.0.0.1)"
            )
        self.root = root
        self.token = token
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> ControllerServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(owner: ControllerServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s " + format, self.address_string(), *args)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def _answer(self, method: str) -> None:
            try:
                self._authorize()
                status, payload = self._route(method)
            except _Refusal as refusal:
                status, payload = refusal.status, {"error": refusal.message}
            except KeelError as error:
                status, payload = (404 if "no job" in str(error) else 400), {"error": str(error)}
            except Exception:  # logged; the server keeps serving
                logger.exception("controller API: %s %s failed", method, self.path)
                status, payload = 500, {"error": "internal error: see the controller's log"}
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorize(self) -> None:
            if owner.token is None:
                return
            given = self.headers.get("Authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), owner.token.encode()):
                raise _Refusal(401, "missing or wrong token")

        def _route(self, method: str) -> tuple[int, Any]:
            url = urlsplit(self.path)
            parts = [p for p in url.path.split("/") if p]
            query = parse_qs(url.query)
            database = state.connect(owner.root / "state.db")
            try:
                if method == "POST" and parts == ["v1", "jobs"]:
                    spec = state.decode_spec(json.dumps(self._body()))
                    return 200, {"id": state.submit(database, spec.validate(check_command=False))}
                if len(parts) >= 3 and parts[:2] == ["v1", "jobs"]:
                    job_id = parts[2]
                    if method == "GET" and len(parts) == 3:
                        return 200, state.job_status(database, job_id)
                    if method == "POST" and parts[3:] == ["cancel"]:
                        return 200, {"state": state.request_cancel(database, job_id)}
                    if method == "GET" and parts[3:] == ["logs"]:
                        return 200, _log_chunk(owner.root, database, job_id, query)
                raise _Refusal(404, f"no such endpoint: {method} {url.path}")
            finally:
                database.close()

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise _Refusal(413, f"body of {length} bytes: at most {MAX_BODY_BYTES}")
            try:
                return json.loads(self.rfile.read(length) or b"null")
            except json.JSONDecodeError as error:
                raise _Refusal(400, f"body is not JSON: {error}") from None

    return Handler


class _Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _log_chunk(root: Path, database, job_id: str, query: dict[str, list[str]]) -> dict[str, Any]:
    status = state.job_status(database, job_id)
    replica = int(query.get("replica", ["0"])[0])
    stream = query.get("stream", ["stdout"])[0]
    if stream not in ("stdout", "stderr"):
        raise UsageError(f"stream {stream!r}: use stdout or stderr")
    offset = int(query.get("offset", ["0"])[0])
    task = next((t for t in status["tasks"] if t["replica"] == replica), None)
    done = status["state"] in state.FINAL_JOB_STATES
    if task is None or task["handle"] is None:
        return {"text": "", "offset": offset, "done": done}
    try:
        with open(output_file(root, job_id, task, stream), "rb") as handle:
            handle.seek(offset)
            data = handle.read(LOG_CHUNK_BYTES)
    except FileNotFoundError:
        data = b""
    more = len(data) == LOG_CHUNK_BYTES
    return {
        "text": data.decode("utf-8", "replace"),
        "offset": offset + len(data),
        "done": done and not more,
    }


class ControllerClient:
    """Job commands against a controller's HTTP API."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise UsageError(f"controller URL {url!r}: expected http://host:port")
        self.url, self.token, self.timeout = url, token, timeout
        self._address = (parts.hostname, parts.port or 80)

    def submit(self, spec: JobSpec) -> str:
        return self._call("POST", "/v1/jobs", json.loads(state.encode_spec(spec)))["id"]

    def status(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> str:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")["state"]

    def logs(self, job_id: str, replica: int, stream: str, offset: int) -> dict[str, Any]:
        path = f"/v1/jobs/{job_id}/logs?replica={replica}&stream={stream}&offset={offset}"
        return self._call("GET", path)

    def _call(self, method: str, path: str, payload: Any = None) -> Any:
        connection = http.client.HTTPConnection(*self._address, timeout=self.timeout)
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            answer = response.read()
        except OSError as error:
            raise UsageError(
                f"no controller at {self.url} ({error}): start one with `keel cluster start --port`"
            ) from None
        finally:
            connection.close()
        data = json.loads(answer or b"{}")
        if response.status != 200:
            raise UsageError(f"controller at {self.url}: {data.get('error', response.status)}")
        return data
