"""The controller over HTTP, for job commands on other machines: `--controller http://host:port`.

`keel cluster start --port N` serves it next to the tick loop, through keel.core.http_server
under keel.core.http's policy: bound to 127.0.0.1 unless a token is given; Host and Origin
checked (a web page cannot submit a job: JSON-only writes, no CORS); bodies up to
MAX_BODY_BYTES. JSON in and out; errors are {"error": one line} with 400 (bad input, e.g. a
negative count or a malformed spec), 401 (token), 404 (unknown job or path), 415 (not JSON).

    POST /v1/jobs                      JobSpec as JSON -> {"id": "j-000042"}
    GET  /v1/jobs/ID                   the job's status (as `keel job status --json`)
    POST /v1/jobs/ID/cancel            -> {"state": ...}
    GET  /v1/jobs/ID/logs?replica=0&stream=stdout&offset=0 -> {"text", "offset", "done"}
"""

from __future__ import annotations

import http.client
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from keel.cluster import state
from keel.cluster.logs import output_file
from keel.cluster.spec import JobSpec
from keel.core.errors import UsageError
from keel.core.http import JSON, HttpError, HttpPolicy
from keel.core.http_server import (
    HttpServer,
    ServedApi,
    count_param,
    endpoints,
    json_response,
    read_body,
    require_type,
    run_in_threadpool,
)

MAX_BODY_BYTES = 1 << 20
LOG_CHUNK_BYTES = 1 << 20
T = TypeVar("T")


class ControllerServer(ServedApi):
    """Serves the controller state under `root` over HTTP on a background thread."""

    def __init__(
        self, root: Path, host: str = "127.0.0.1", port: int = 0, token: str | None = None
    ) -> None:
        self.root = root
        self.token = token or None
        policy = HttpPolicy(token=self.token, max_body_bytes=MAX_BODY_BYTES)
        app = endpoints(
            {
                "/v1/jobs": {"POST": self._submit},
                "/v1/jobs/{job_id}": {"GET": self._status},
                "/v1/jobs/{job_id}/cancel": {"POST": self._cancel},
                "/v1/jobs/{job_id}/logs": {"GET": self._logs},
            }
        )
        self._http = HttpServer(app, policy, host, port, name="controller-api")

    async def _submit(self, request: Request) -> Response:
        require_type(request, JSON)
        spec = state.decode_spec(await read_body(request)).validate(check_command=False)
        job_id = await run_in_threadpool(self._in_database, lambda db: state.submit(db, spec))
        return json_response({"id": job_id})

    async def _status(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        return json_response(await self._for_job(job_id, lambda db: state.job_status(db, job_id)))

    async def _cancel(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        after = await self._for_job(job_id, lambda db: state.request_cancel(db, job_id))
        return json_response({"state": after})

    async def _logs(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        replica = count_param(request, "replica", 0)
        offset = count_param(request, "offset", 0)
        stream = request.query_params.get("stream", "stdout")
        if stream not in ("stdout", "stderr"):
            raise HttpError(400, f"stream={stream!r}: use stdout or stderr")
        chunk = await self._for_job(
            job_id, lambda db: _log_chunk(self.root, db, job_id, replica, stream, offset)
        )
        return json_response(chunk)

    async def _for_job(self, job_id: str, action: Callable[[sqlite3.Connection], T]) -> T:
        """`action` on the state database, in the thread pool; 404 if there is no such job."""
        try:
            return await run_in_threadpool(self._in_database, action)
        except state.UnknownJobError as error:
            raise HttpError(404, str(error)) from None

    def _in_database(self, action: Callable[[sqlite3.Connection], T]) -> T:
        database = state.connect(self.root / "state.db")
        try:
            return action(database)
        finally:
            database.close()


def _log_chunk(
    root: Path, database: sqlite3.Connection, job_id: str, replica: int, stream: str, offset: int
) -> dict[str, Any]:
    """Up to LOG_CHUNK_BYTES of a task's output from byte `offset`, with the job's secrets hidden
    as `keel job logs` hides them (keel.cluster.state.redactor). A chunk ends at a line's end, so
    no secret is cut in two, unless the job has ended and its last line has no newline, or one
    line is longer than a chunk. "offset" is where the next chunk starts."""
    status = state.job_status(database, job_id)
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
    if more or not done:  # the output goes on: stop at the last whole line
        cut = data.rfind(b"\n") + 1
        data = data[:cut] if cut or not more else data
    hide = state.redactor(database, job_id)
    return {
        "text": hide(data.decode("utf-8", "replace")),
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
        try:
            data = json.loads(answer or b"{}")
        except ValueError:
            data = {"error": f"HTTP {response.status}: {answer[:200].decode(errors='replace')}"}
        if response.status != 200:
            error = data.get("error") if isinstance(data, dict) else None
            raise UsageError(f"controller at {self.url}: {error or f'HTTP {response.status}'}")
        return data
