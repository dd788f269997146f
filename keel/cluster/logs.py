"""Task output: read from the attempt's files; streamed to telemetry when a target is set.

Backends write each attempt's stdout and stderr to files (`TaskBackend.log_files`). With a
telemetry target the controller forwards new complete lines every tick to the namespace
`cluster.task_log` (ts, job_id, replica, attempt, stream, line), remembering per attempt how many
bytes it has sent (in the attempts table, so a restarted controller neither repeats nor skips
lines); an attempt that ended is sent to its last byte, a final line without a newline included.
The values of the job's secret variables are hidden in the rows (keel.cluster.secrets).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import orjson
import pyarrow as pa

from keel.cluster.backend import TaskBackend
from keel.cluster.secrets import Redactor
from keel.cluster.state import redactor
from keel.telemetry.client import Telemetry
from keel.telemetry.sink import now, open_target

logger = logging.getLogger(__name__)
NAMESPACE = "cluster.task_log"
DONE = "[-1, -1]"  # log_offsets of an attempt whose output has all been sent
SCHEMA = pa.schema(
    [
        ("ts", pa.timestamp("us")),
        ("job_id", pa.string()),
        ("replica", pa.int64()),
        ("attempt", pa.int64()),
        ("stream", pa.string()),
        ("line", pa.string()),
    ]
)


class LogStreamer:
    def __init__(
        self, database: sqlite3.Connection, backends: Mapping[str, TaskBackend], target: str
    ) -> None:
        self.database = database
        self.backends = backends
        self.target = target
        self._client: Telemetry | None = None
        self._redactors: dict[str, Redactor] = {}  # job -> its secrets, hidden in the rows

    def stream(self) -> int:
        """Send every attempt's new lines; return how many were sent."""
        if not self.target:
            return 0
        rows = self.database.execute(
            "SELECT job_id, replica, attempt, cluster, handle, state, log_offsets FROM attempts "
            "WHERE handle IS NOT NULL AND log_offsets != ?",
            (DONE,),
        ).fetchall()
        sent = 0
        for row in rows:
            backend = self.backends.get(row["cluster"])
            if backend is None:
                continue
            ended = row["state"] not in ("launching", "pending", "running")
            offsets = orjson.loads(row["log_offsets"])
            lines: list[tuple[str, str]] = []
            for index, (stream, path) in enumerate(
                zip(("stdout", "stderr"), backend.log_files(row["handle"]), strict=True)
            ):
                new, offsets[index] = _read_lines(Path(path), offsets[index], final=ended)
                lines.extend((stream, line) for line in new)
            if lines:
                hide = self._redactor(row["job_id"])
                self._write(row, [(stream, hide(line)) for stream, line in lines])
                sent += len(lines)
            self.database.execute(
                "UPDATE attempts SET log_offsets = ? "
                "WHERE job_id = ? AND replica = ? AND attempt = ?",
                (
                    DONE if ended else orjson.dumps(offsets).decode(),
                    row["job_id"],
                    row["replica"],
                    row["attempt"],
                ),
            )
        return sent

    def _write(self, row: sqlite3.Row, lines: list[tuple[str, str]]) -> None:
        if self._client is None:
            self._client = open_target(self.target)
        stamp = now()
        count = len(lines)
        table = pa.table(
            {
                "ts": pa.array([stamp] * count, pa.timestamp("us")),
                "job_id": [row["job_id"]] * count,
                "replica": pa.array([row["replica"]] * count, pa.int64()),
                "attempt": pa.array([row["attempt"]] * count, pa.int64()),
                "stream": [stream for stream, _ in lines],
                "line": [line for _, line in lines],
            },
            schema=SCHEMA,
        )
        self._client.write(NAMESPACE, table)

    def _redactor(self, job_id: str) -> Redactor:
        if job_id not in self._redactors:
            if len(self._redactors) > 10_000:
                self._redactors.clear()
            self._redactors[job_id] = redactor(self.database, job_id)
        return self._redactors[job_id]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _read_lines(path: Path, offset: int, *, final: bool) -> tuple[list[str], int]:
    """Complete lines after byte `offset` (all of it when `final`) and the new offset."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    if not final:
        cut = data.rfind(b"\n") + 1
        data = data[:cut]
    text = data.decode("utf-8", "replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines, offset + len(data)


def output_file(root: Path, job_id: str, task: Mapping, stream: str) -> Path:
    """Where a task's latest attempt wrote `stream` ("stdout" or "stderr"): its handle's
    directory for the local backend, else the attempt's directory under `root`/tasks."""
    if task.get("handle") and (Path(task["handle"]) / stream).exists():
        return Path(task["handle"]) / stream
    return root / "tasks" / job_id / str(task["replica"]) / str(task["attempt"]) / stream


def follow_file(path: Path, *, poll_seconds: float = 0.5, done=lambda: False) -> Iterator[str]:
    """Yield the lines of a growing file until `done()` is true and the file is read out."""
    offset = 0
    while True:
        finished = done()
        lines, offset = _read_lines(path, offset, final=finished)
        yield from lines
        if finished:
            return
        time.sleep(poll_seconds)
