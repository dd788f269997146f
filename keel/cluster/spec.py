"""What a user asks for: a job (a command run as one or more replicas) and its resources.

Replicas of a job form a gang: all of them start together on one cluster or none does. Priority
bands order the queue (production before interactive before batch) and decide who may preempt
whom: a production job may stop batch work when capacity is short.
"""

from __future__ import annotations

import enum
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from keel.core.errors import UsageError


class Priority(enum.IntEnum):
    """Lower value = served first. Only PRODUCTION preempts, and only BATCH is preempted."""

    PRODUCTION = 0
    INTERACTIVE = 1
    BATCH = 2

    @classmethod
    def parse(cls, text: str) -> Priority:
        try:
            return cls[text.upper()]
        except KeyError:
            names = ", ".join(p.name.lower() for p in cls)
            raise UsageError(f"unknown priority {text!r}: use one of {names}") from None


@dataclass(frozen=True)
class Resources:
    """Per replica: cpus, memory (MiB, 0 = unspecified) and devices of one type."""

    cpus: float = 1.0
    memory_mb: int = 0
    device_type: str = "cpu"
    device_count: int = 0

    def demand(self) -> dict[str, float]:
        """The capacity one replica takes, per device type (cpus are device type "cpu")."""
        demand = {"cpu": self.cpus}
        if self.device_type != "cpu" and self.device_count:
            demand[self.device_type] = float(self.device_count)
        return demand


@dataclass(frozen=True)
class JobSpec:
    command: tuple[str, ...]
    name: str = ""
    resources: Resources = field(default_factory=Resources)
    replicas: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    region: str = ""  # "" = any region
    cluster: str = ""  # "" = any cluster; else only the cluster of that name
    priority: Priority = Priority.BATCH
    max_retries: int = 0  # attempts after a failure
    max_preemptions: int = 10  # requeues after a preemption or a lost worker
    workdir: str = ""

    def validate(self, *, check_command: bool = True) -> JobSpec:
        """Refuse what no cluster could run, with one line saying what to change."""
        if not self.command:
            raise UsageError(
                "the job has no command: give one after --, e.g. keel job run -- echo hi"
            )
        r = self.resources
        if r.cpus <= 0 or r.memory_mb < 0 or r.device_count < 0 or self.replicas < 1:
            raise UsageError(
                f"resources must be positive: cpus={r.cpus}, memory_mb={r.memory_mb}, "
                f"devices={r.device_type}:{r.device_count}, replicas={self.replicas}"
            )
        if r.device_type != "cpu" and r.device_count == 0:
            raise UsageError(f"device {r.device_type!r} with count 0: ask for at least one")
        if self.max_retries < 0 or self.max_preemptions < 0:
            raise UsageError("max_retries and max_preemptions must be 0 or more")
        if check_command and not _command_exists(self.command[0], self.workdir):
            raise UsageError(
                f"command {self.command[0]!r} not found on PATH or as a file: check its spelling"
            )
        return self

    def demand(self) -> dict[str, float]:
        """The capacity the whole gang takes, per device type."""
        return {kind: amount * self.replicas for kind, amount in self.resources.demand().items()}


def parse_device(text: str) -> tuple[str, int]:
    """'h100:8' -> ('h100', 8); 'tpu-v5e' -> ('tpu-v5e', 1)."""
    kind, _, count = text.partition(":")
    if not kind:
        raise UsageError(f"device {text!r}: write TYPE:COUNT, e.g. h100:8")
    try:
        number = int(count) if count else 1
    except ValueError:
        raise UsageError(f"device {text!r}: the count after ':' must be a whole number") from None
    return kind.lower(), number


def _command_exists(program: str, workdir: str) -> bool:
    if os.sep in program:
        return os.path.exists(os.path.join(workdir or os.getcwd(), program))
    return shutil.which(program) is not None


def entry_point_command(entry: str, arguments: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The command that runs a Python entry point: 'pkg.module' (as `python -m`) or
    'pkg.module:function' (imported and called with no arguments), with this interpreter."""
    module, _, function = entry.partition(":")
    names = [*module.split("."), *([function] if function else [])]
    if not module or not all(name.isidentifier() for name in names):
        raise UsageError(f"entry point {entry!r}: write package.module or package.module:function")
    if not function:
        return (sys.executable, "-m", module, *arguments)
    if arguments:
        raise UsageError(
            f"entry point {entry!r} takes no arguments: use package.module to pass them"
        )
    return (sys.executable, "-c", f"import {module}; {module}.{function}()")
