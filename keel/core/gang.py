"""Local gangs without a controller: N copies of one command that find each other.

`run_local_gang(argv, processes)` starts `processes` copies of `argv` on this machine, each with
the environment a keel launcher gives the members of a gang:

- `KEEL_COORDINATOR=127.0.0.1:<port>`: where process 0 serves JAX's distributed runtime (one free
  port, chosen once for the gang),
- `KEEL_REPLICA=i` (0..N-1) and `KEEL_REPLICAS=N`.

Process 0's stdout and stderr pass through as they are; the others' lines are prefixed with
"[process i] " so interleaved output stays readable. When a member exits non-zero the others are
stopped (SIGTERM, then SIGKILL after `STOP_GRACE_SECONDS`) and its exit code is returned: one dead
member fails the whole gang, as on a cluster. Ctrl-C or SIGTERM to this process stops them all.
The members stay in this process's process group, so whoever stops the group (a terminal's
Ctrl-C, keel's local backend cancelling a job, a SIGKILL of the group) stops them too.

This module imports no JAX; keel/train/distributed.py reads the environment set here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import BinaryIO

from keel.core.errors import UsageError

logger = logging.getLogger(__name__)

COORDINATOR = "KEEL_COORDINATOR"  # host:port of process 0's JAX coordination service
REPLICA = "KEEL_REPLICA"  # this process's index in its gang, 0..N-1
REPLICAS = "KEEL_REPLICAS"  # the gang's size N
STOP_GRACE_SECONDS = 5.0  # SIGTERM -> SIGKILL when stopping the rest of a gang
_POLL_SECONDS = 0.05
_GLOO_CONNECTED = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    rb"Expected number of connected peer ranks is : \1(?!\d)"
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` now (the OS picks it; another process may take it
    before it is used, which the gang then reports as a failed start)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def gang_env(coordinator: str, replica: int, replicas: int) -> dict[str, str]:
    """The variables that tell one member of a gang where it stands."""
    return {COORDINATOR: coordinator, REPLICA: str(replica), REPLICAS: str(replicas)}


def run_local_gang(
    argv: Sequence[str], processes: int, env: Mapping[str, str] | None = None
) -> int:
    """Run `processes` copies of `argv` as one gang; return 0 when all succeed, else the exit
    code of the first member that failed (128 + signal for one killed by a signal, as a shell
    reports it). `env` (default: this process's environment) is what each member starts from."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise UsageError(f"a gang needs a positive number of processes, got {processes!r}")
    if not argv:
        raise UsageError("a gang needs a command to run")
    base = dict(os.environ if env is None else env)
    coordinator = f"127.0.0.1:{free_port()}"
    members: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    try:
        for replica in range(processes):
            member = subprocess.Popen(
                list(argv),
                env={**base, **gang_env(coordinator, replica, processes)},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            members.append(member)
            prefix = b"" if replica == 0 else f"[process {replica}] ".encode()
            for source, target in ((member.stdout, sys.stdout), (member.stderr, sys.stderr)):
                pump = threading.Thread(target=_forward, args=(source, target, prefix), daemon=True)
                pump.start()
                pumps.append(pump)
        logger.info("gang of %d processes, coordinator %s", processes, coordinator)
        with _sigterm_as_exit():
            code = _wait_for_gang(members)
    except FileNotFoundError as error:
        _stop(members)
        raise UsageError(f"cannot start {argv[0]}: {error.strerror}") from None
    except BaseException:  # KeyboardInterrupt, SystemExit from SIGTERM: stop them all
        _stop(members)
        raise
    for pump in pumps:
        pump.join(timeout=STOP_GRACE_SECONDS)
    return code


def _wait_for_gang(members: list[subprocess.Popen[bytes]]) -> int:
    """Wait until every member succeeded (0) or one failed: then stop the rest and return its
    exit code."""
    while True:
        running = False
        for replica, member in enumerate(members):
            code = member.poll()
            if code is None:
                running = True
            elif code != 0:
                code = 128 - code if code < 0 else code  # -9 (SIGKILL) -> 137
                logger.warning(
                    "process %d/%d exited with code %d: stopping the gang",
                    replica,
                    len(members),
                    code,
                )
                _stop(members)
                return code
        if not running:
            return 0
        time.sleep(_POLL_SECONDS)


def _stop(members: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every member still running, SIGKILL what is left after the grace period.

    Every wait is bounded: a KeyboardInterrupt that lands inside Popen.poll() can leave the
    Popen's internal wait lock held (a CPython race), and an unbounded wait() would then block
    for good; a member killed but not reaped here is reaped by init once this process exits."""
    for member in members:
        if member.poll() is None:
            member.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while any(m.poll() is None for m in members) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    for member in members:
        if member.poll() is None:
            member.kill()
        try:
            member.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            logger.warning("gang member pid %d did not exit after SIGKILL", member.pid)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While the gang runs, SIGTERM to this process raises SystemExit(143) (Python's default
    would end it at once, leaving the members running); only the main thread can set it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(number: int, frame: object) -> None:
        raise SystemExit(128 + number)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _forward(source: BinaryIO, target, prefix: bytes) -> None:
    """Copy `source` line by line to `target` (a text stream), each line after `prefix`; gloo's
    notes that a rank connected to its peers (a dozen lines per program) are left out."""
    output = getattr(target, "buffer", None)
    with source:
        for line in iter(source.readline, b""):
            line = _without_gloo_notes(line)
            if not line:
                continue
            data = prefix + line
            if output is not None:
                output.write(data)
                output.flush()
            else:  # a text stream without bytes (pytest's capture)
                target.write(data.decode(errors="replace"))
                target.flush()


def _without_gloo_notes(line: bytes) -> bytes:
    """`line` without gloo's notes that a rank connected to all the peers it expected (gloo's
    threads write them into each other, so they are cut out wherever they stand); b"" when
    nothing else is left. A note with fewer peers than expected stays."""
    if b"[Gloo]" not in line:
        return line
    rest = _GLOO_CONNECTED.sub(b"", line)
    return rest if rest.strip() else b""
