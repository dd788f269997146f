"""The local backend: tasks are subprocesses of this machine, tracked through their directories.

Each attempt gets a directory (the handle, 0700): `stdout`, `stderr` (0600, made just before the
task is started), `pid` (pid; kernel start time, so a reused pid is not mistaken for the task;
cpus) and, written by the task's shell wrapper as it exits, `exit_code`. All state is in files,
so a controller restarted after a crash finds its tasks again: one still running is adopted, a
finished one reports its exit code, one that vanished without an exit code (SIGKILL, a reboot) is
LOST; one started by a controller killed before it wrote `pid` is found through /proc (the
session leader whose stdout is the attempt's file). Tasks run in their own session, so a
controller that dies does not take them down, and cancel stops the whole process group. The
replicas of a gang are such tasks on this machine: KEEL_COORDINATOR (127.0.0.1:<port>, as the
launcher chose it) reaches them as it is.

The pool is a scale group: `scale_to(cpus)` sets how many cpus the backend offers, between
`min_cpus` and `max_cpus` (default: this machine's cpus); the controller grows it while work waits
and shrinks it when idle.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from keel.cluster.backend import Capacity, TaskLaunch, TaskState, TaskStatus
from keel.cluster.secrets import private_dir
from keel.core.errors import UsageError
from keel.core.process import process_alive, process_start

CANCEL_GRACE_SECONDS = 5.0


class LocalBackend:
    """Runs tasks as local subprocesses (see the module docstring)."""

    name = "local"

    def __init__(
        self,
        log_root: str | os.PathLike[str],
        *,
        max_cpus: float | None = None,
        min_cpus: float = 1.0,
        region: str = "",
    ) -> None:
        for option, value in (("max_cpus", max_cpus), ("min_cpus", min_cpus)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            ):
                raise UsageError(f"{option} must be a positive number of cpus, got {value!r}")
        self.log_root = Path(log_root)
        self.max_cpus = float(max_cpus if max_cpus is not None else os.cpu_count() or 1)
        self.min_cpus = min(min_cpus, self.max_cpus)
        self.cpus = self.max_cpus
        self.region = region
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._used: dict[str, float] = {}  # handle -> cpus, for tasks this process started

    def launch(self, task: TaskLaunch) -> str:
        directory = (
            Path(task.log_dir) if task.log_dir else self.log_root / task.task_id / str(task.attempt)
        )
        private_dir(directory)  # its output may show the job's secrets
        handle = str(directory)
        if (directory / "pid").exists():
            return handle  # launched before (the controller died before recording it): adopt
        if (directory / "stdout").exists() and self._adopt_interrupted(directory, task.cpus):
            return handle  # a launch was begun (stdout is made just before the start): adopt
        workdir = task.workdir or None
        if workdir is not None and not os.path.isdir(workdir):
            raise UsageError(f"working directory {workdir} does not exist")
        # The wrapper records the exit code atomically, so it survives this process.
        script = (
            f"{shlex.join(task.command)}; code=$?; "
            f"echo $code > {shlex.quote(str(directory / 'exit_code.tmp'))} && "
            f"mv {shlex.quote(str(directory / 'exit_code.tmp'))} "
            f"{shlex.quote(str(directory / 'exit_code'))}; exit $code"
        )
        env = {
            **os.environ,
            **task.env,
            "KEEL_TASK_ID": task.task_id,
            "KEEL_ATTEMPT": str(task.attempt),
        }
        with (
            _private_append(directory / "stdout") as stdout,
            _private_append(directory / "stderr") as stderr,
        ):
            child = subprocess.Popen(
                ["/bin/sh", "-c", script],
                stdout=stdout,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                cwd=workdir,
                env=env,
                start_new_session=True,
            )
        (directory / "pid").write_text(f"{child.pid} {process_start(child.pid)} {task.cpus}\n")
        self._children[handle] = child
        self._used[handle] = task.cpus
        return handle

    def _adopt_interrupted(self, directory: Path, cpus: float) -> bool:
        """A launch of this attempt was begun (its `stdout` exists) but `pid` was never written:
        the controller died in between. If the task started, adopt it: find its wrapper, the
        session leader whose stdout is this attempt's file (Linux /proc), or its exit code.
        False: it never started (or no /proc to tell), so it is started now."""
        if (directory / "exit_code").exists():
            return True  # it ran and ended: its status is its exit code
        target = str(directory / "stdout")
        try:
            entries = os.listdir("/proc")
        except OSError:
            return False
        for name in entries:
            if not name.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{name}/fd/1") != target or os.getsid(int(name)) != int(name):
                    continue
            except OSError:  # gone, or not ours
                continue
            (directory / "pid").write_text(f"{name} {process_start(int(name))} {cpus}\n")
            return True
        return False

    def poll(self, handles: list[str]) -> dict[str, TaskStatus]:
        return {handle: self._status(handle) for handle in handles}

    def _status(self, handle: str) -> TaskStatus:
        directory = Path(handle)
        child = self._children.get(handle)
        if child is not None:
            child.poll()  # reap, so a finished child is not a zombie that looks alive
        if (directory / "cancelled").exists() and not self._alive(directory):
            self._forget(handle)
            return TaskStatus(handle, TaskState.CANCELLED, reason="cancelled")
        exit_file = directory / "exit_code"
        if exit_file.exists():
            self._forget(handle)
            code = int(exit_file.read_text().strip() or "1")
            if code == 0:
                return TaskStatus(handle, TaskState.SUCCEEDED, 0)
            return TaskStatus(handle, TaskState.FAILED, code, f"exited with code {code}")
        if not (directory / "pid").exists():
            return TaskStatus(handle, TaskState.LOST, reason=f"no task was started in {handle}")
        if self._alive(directory):
            # A task adopted after a restart counts against the pool like one started here.
            self._used.setdefault(handle, float((directory / "pid").read_text().split()[2]))
            return TaskStatus(handle, TaskState.RUNNING)
        self._forget(handle)
        return TaskStatus(handle, TaskState.LOST, reason="the process ended without an exit code")

    def cancel(self, handle: str) -> None:
        directory = Path(handle)
        if not (directory / "pid").exists() or (directory / "exit_code").exists():
            return
        (directory / "cancelled").touch()
        pid = int((directory / "pid").read_text().split()[0])
        if not self._alive(directory):
            return
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + CANCEL_GRACE_SECONDS
        while self._alive(directory) and time.monotonic() < deadline:
            child = self._children.get(handle)
            if child is not None:
                child.poll()
            time.sleep(0.05)
        if self._alive(directory):
            _signal_group(pid, signal.SIGKILL)

    def log_files(self, handle: str) -> tuple[str, str]:
        return str(Path(handle) / "stdout"), str(Path(handle) / "stderr")

    def capacity(self) -> Capacity:
        for handle in list(self._used):
            self._status(handle)
        used = sum(self._used.values())
        # total: what the pool can grow to (what a job may ask for); free: the pool as sized now.
        return Capacity(
            total={"cpu": self.max_cpus},
            free={"cpu": max(0.0, self.cpus - used)},
            region=self.region,
        )

    def scale_to(self, cpus: float) -> float:
        """Offer `cpus` (clamped to [min_cpus, max_cpus]); return what is offered now."""
        self.cpus = min(self.max_cpus, max(self.min_cpus, cpus))
        return self.cpus

    def close(self) -> None:
        """Forget the children (they keep running; a new backend finds them by handle)."""
        self._children.clear()

    def _alive(self, directory: Path) -> bool:
        try:
            pid_text, started, _ = (directory / "pid").read_text().split()
        except (FileNotFoundError, ValueError):
            return False
        child = self._children.get(str(directory))
        if child is not None and child.poll() is not None:
            return False
        return process_alive(int(pid_text), None if started == "None" else int(started))

    def _forget(self, handle: str) -> None:
        self._children.pop(handle, None)
        self._used.pop(handle, None)


def _private_append(path: Path):
    """`path` opened to append bytes, created 0600."""
    return open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600), "ab")


def _signal_group(pid: int, number: int) -> None:
    try:
        os.killpg(pid, number)
    except ProcessLookupError:
        return
