"""A real local Ray head for tests: `ray start --head` with its own temp dir, ports and token.

Every port is picked free (the dashboard, the client server, the dashboard agent; workers bind
random ports), so the head can run beside other Ray instances on the machine. Token
authentication is on, with a fresh token in the temp dir (nothing is written to ~/.ray). The head
is stopped by signalling only the processes it started: its process group and their descendants
(`ray stop` would stop every Ray instance of this user on the machine).

Import the fixture into a test module: `from ray_head import ray_head` (pytest puts this
directory on sys.path, as tests/cluster has no __init__.py).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_SECONDS = 90.0
STOP_GRACE_SECONDS = 2.0  # then SIGKILL: the monitor and agents linger on SIGTERM


@dataclass(frozen=True)
class RayHead:
    address: str  # the dashboard (Jobs API), e.g. http://127.0.0.1:40525
    token: str  # the cluster's auth token
    temp_dir: str


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    """A 2-cpu Ray head, shared by the tests of one module."""
    with local_ray_head(num_cpus=2) as head:
        yield head


@contextlib.contextmanager
def local_ray_head(num_cpus: int = 2) -> Iterator[RayHead]:
    """Start a Ray head, wait until its Jobs API answers, yield it, then stop its processes."""
    ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray is None:
        pytest.fail("the `ray` command is missing: pip install 'ray[default]'")
    # Short: Ray puts unix sockets under it (a socket path has at most 107 characters).
    temp_dir = tempfile.mkdtemp(prefix="kray", dir="/tmp")
    token = secrets.token_hex(32)
    token_file = Path(temp_dir) / "auth_token"
    token_file.write_text(token)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    dashboard = _free_port()
    command = [
        ray,
        "start",
        "--head",
        "--port=0",
        f"--dashboard-port={dashboard}",
        f"--num-cpus={num_cpus}",
        "--include-dashboard=true",
        f"--temp-dir={temp_dir}",
        f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        "--min-worker-port=0",
        "--max-worker-port=0",
        "--disable-usage-stats",
    ]
    log_path = Path(temp_dir) / "ray-start.log"
    # A file, not a pipe: the daemons inherit the output and outlive `ray start`.
    with open(log_path, "wb") as output:
        starter = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    group = starter.pid  # the daemons stay in the new session's process group
    head = RayHead(f"http://127.0.0.1:{dashboard}", token, temp_dir)
    try:
        if starter.wait(timeout=START_TIMEOUT_SECONDS) != 0:
            pytest.fail(f"ray start failed:\n{log_path.read_text()[-3000:]}")
        _wait_for_jobs_api(head)
        yield head
    finally:
        _stop(group, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_jobs_api(head: RayHead) -> None:
    request = urllib.request.Request(
        f"{head.address}/api/jobs/", headers={"Authorization": f"Bearer {head.token}"}
    )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
                last = f"status {response.status}"
        except (urllib.error.URLError, OSError) as error:
            last = str(error)
        time.sleep(0.5)
    pytest.fail(f"ray's Jobs API at {head.address} did not answer: {last}")


def _stop(group: int, temp_dir: str) -> None:
    """SIGTERM the head's processes (its group, their descendants, anything naming its temp
    dir), then SIGKILL those still alive after a grace period."""
    pids = _head_processes(group, temp_dir)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while time.monotonic() < deadline and _alive(pids):
        time.sleep(0.2)
    _signal_all(_alive(pids) | _head_processes(group, temp_dir), signal.SIGKILL)


def _head_processes(group: int, temp_dir: str) -> set[int]:
    parents: dict[int, int] = {}
    mine: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if stat[0] == "Z":
            continue
        parents[pid] = int(stat[1])
        if int(stat[2]) == group or temp_dir in cmdline:
            mine.add(pid)
    grown = True
    while grown:  # add descendants: job drivers run in sessions of their own
        more = {pid for pid, parent in parents.items() if parent in mine} - mine
        mine |= more
        grown = bool(more)
    mine.discard(os.getpid())
    return mine


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _signal_all(pids: set[int], number: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, number)
