"""The provenance record of a step attempt, stored as `.keel/step.json`.

One record per attempt: what ran (name, identity, config as hashed, dependencies), with what
(keel version, git commit of the experiment), for what (the experiment record, if any), where
(host, pid, output path), when (start and end, UTC), and how it ended (status; error and
traceback on failure).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import socket
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import keel


class Status(enum.StrEnum):
    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"


@dataclass(frozen=True)
class StepRecord:
    name: str
    identity: str
    status: Status
    output: str
    config: Any
    dependencies: list[dict[str, str]]
    version: str | None
    attempt: str
    host: str
    pid: int
    keel_version: str
    git_commit: str | None
    start_time: str
    end_time: str | None = None
    error: str | None = None
    traceback: str | None = None
    experiment: str | None = None
    """The experiment record the attempt ran for (provenance only, never in the identity)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True, default=str) + "\n"

    @classmethod
    def from_json(cls, text: str) -> StepRecord:
        data = json.loads(text)
        data["status"] = Status(data["status"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    def finished(
        self, status: Status, error: str | None = None, tb: str | None = None
    ) -> StepRecord:
        """This record, ended now with `status`."""
        return dataclasses.replace(
            self, status=status, end_time=utc_now(), error=error, traceback=tb
        )

    def ended_after(self, moment: datetime) -> bool:
        """True when this attempt has ended, later than `moment` (a timezone-aware datetime)."""
        return self.end_time is not None and datetime.fromisoformat(self.end_time) > moment

    def age_seconds(self, now: float | None = None) -> float:
        """Seconds since the attempt ended (or started, while it runs)."""
        moment = datetime.fromisoformat(self.end_time or self.start_time).timestamp()
        return (time.time() if now is None else now) - moment


def utc_now() -> str:
    """The current time as ISO 8601 in UTC with microseconds."""
    return datetime.now(UTC).isoformat()


def host_name() -> str:
    return socket.gethostname()


def keel_version() -> str:
    return keel.__version__


def git_commit(directory: Path) -> str | None:
    """HEAD of the git repository holding `directory`, with "+dirty" when it has changes; None
    outside a repository or without git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    suffix = "+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else ""
    return head.stdout.strip() + suffix
