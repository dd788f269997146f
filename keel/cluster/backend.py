"""The TaskBackend contract: how the controller starts, observes and stops tasks on an engine.

A backend returns plain data and never touches the controller's database; the controller decides,
the backend carries out. Every method may be called again after a controller restart with handles
from a previous process, so a handle must be enough to find a task again (a directory, a Slurm job
id, a Ray submission id), and `poll` must tell a finished task's outcome long after it ended.
`launch` of an attempt the engine already has returns its handle (adoption after a restart). An
engine that cannot be reached raises a KeelError from `poll` or `capacity`: the controller skips
that cluster for the tick rather than calling its tasks lost.
"""

from __future__ import annotations

import enum
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from keel.core.errors import UsageError

RAY_INSTALL = "pip install 'keel[ray]'"
"""How to install Ray for keel: pyproject.toml's `ray` extra."""


class TaskState(enum.StrEnum):
    """What a backend reports about one launched task."""

    PENDING = "pending"  # accepted by the engine, not started yet (e.g. queued in Slurm)
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # exited non-zero, or the engine failed it; `reason` says which
    LOST = "lost"  # the engine no longer knows it (node gone, handle unknown)
    CANCELLED = "cancelled"  # stopped through cancel()


@dataclass(frozen=True)
class TaskLaunch:
    """Everything a backend needs to start one replica of a job (one attempt)."""

    task_id: str  # unique per job replica, e.g. "j-000042.0"
    attempt: int  # 1, 2, ... (a retry or a requeue after preemption is a new attempt)
    command: tuple[str, ...]  # argv; argv[0] is found on PATH by the engine
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: float = 1.0
    memory_mb: int = 0  # 0: no limit asked
    device_type: str = "cpu"
    device_count: int = 0
    log_dir: str = ""  # a directory for this attempt's stdout / stderr files
    workdir: str = ""  # where the command runs ("" = the controller's working directory)
    # A gang's replicas of this attempt share this directory ("" for a job of one replica):
    # its `coordinator` file holds KEEL_COORDINATOR as the launcher chose it; a backend whose
    # replicas land on other hosts rendezvouses there (see slurm.py). env has KEEL_COORDINATOR,
    # KEEL_REPLICA and KEEL_REPLICAS for every replica of a gang.
    gang_dir: str = ""


class TaskStatus(NamedTuple):
    """What `poll` says of one task (a named tuple: a controller reads ~1,000 a tick, and one
    costs about half what a frozen dataclass does to make)."""

    handle: str
    state: TaskState
    exit_code: int | None = None
    reason: str = ""  # one line for failed / lost tasks


@dataclass(frozen=True)
class Capacity:
    """What a cluster offers right now: free and total per device type (cpus under "cpu")."""

    total: Mapping[str, float]
    free: Mapping[str, float]
    region: str = ""


class TaskBackend(Protocol):
    """An engine that runs tasks: local subprocesses, Slurm, Ray."""

    name: str

    def launch(self, task: TaskLaunch) -> str:
        """Start the task; return its handle. Raises UsageError if the engine refuses it
        (a command that does not exist, a resource the engine cannot give)."""
        ...

    def poll(self, handles: list[str]) -> dict[str, TaskStatus]:
        """The current state of each handle (unknown handles: LOST)."""
        ...

    def cancel(self, handle: str) -> None:
        """Stop the task (a no-op if it already ended)."""
        ...

    def log_files(self, handle: str) -> tuple[str, str]:
        """Paths of the task's stdout and stderr files (they may not exist yet)."""
        ...

    def capacity(self) -> Capacity:
        """What the engine can run now; the controller reports it to the scheduler."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ScaleGroup(Protocol):
    """A backend whose capacity the controller may size (the local pool; a cloud node group)."""

    def scale_to(self, cpus: float) -> float:
        """Offer about `cpus` (clamped to the group's limits); return what is offered now."""
        ...


def require_ray(what: str) -> None:
    """Raise UsageError (one line: what needs Ray, how to install it) when Ray is not installed.

    Looks for the package without importing it (importing Ray takes seconds), so a command can
    check its `--backend ray` before doing any work."""
    if importlib.util.find_spec("ray") is None:
        raise UsageError(f"{what} needs Ray, which is not installed: {RAY_INSTALL}")
