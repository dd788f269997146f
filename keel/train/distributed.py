"""Joining a gang: JAX's distributed runtime started from the environment keel's launchers set.

Every process of a gang is started (by `keel job run --replicas N`, `keel train --processes N`
or keel.core.gang.run_local_gang) with `KEEL_COORDINATOR=host:port`, `KEEL_REPLICA=i` and
`KEEL_REPLICAS=N`. `initialize_from_env()` turns that into `jax.distributed.initialize`, with
gloo as the CPU collectives and timeouts short enough that a gang never waits long for a member:

- start-up: a coordinator nobody serves fails every other process within
  `REACH_TIMEOUT_SECONDS` (or the seconds `KEEL_COORDINATOR_TIMEOUT` says) with one `error:`
  line (`GangError`, exit 2). JAX's own client aborts the process (SIGABRT, a C++ stack trace)
  when it cannot connect, so the port is first tried here with plain TCP; a member that never
  comes makes the others abort after `INIT_TIMEOUT_SECONDS`;
- a member that dies mid-run (SIGKILL, a lost node) stops sending heartbeats; after
  `HEARTBEAT_TIMEOUT_SECONDS` the coordination service tells the others, which then exit
  instead of hanging in a collective (JAX's defaults are 100 s heartbeats, 300 s start-up);
- a process that ends waits at most `SHUTDOWN_TIMEOUT_SECONDS` for the others at the exit
  barrier.

Call `initialize_from_env()` before anything touches a JAX backend (devices, arrays).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from keel.core.errors import UsageError
from keel.core.gang import COORDINATOR, REPLICA, REPLICAS

logger = logging.getLogger(__name__)

REACH_TIMEOUT_SECONDS = 30  # a member's wait for the coordinator's port to accept connections
REACH_TIMEOUT = "KEEL_COORDINATOR_TIMEOUT"  # seconds, instead of REACH_TIMEOUT_SECONDS
INIT_TIMEOUT_SECONDS = 40  # all members registered with the coordinator (JAX default 300)
HEARTBEAT_TIMEOUT_SECONDS = 20  # a silent member is declared dead (JAX default 100)
SHUTDOWN_TIMEOUT_SECONDS = 20  # the exit barrier (JAX default 300)
SHARED_TOKEN = ".keel-gang-token"


class GangError(UsageError):
    """A gang cannot form or work as asked: bad KEEL_* variables, a coordinator that cannot be
    reached, a run directory the processes do not share."""


@dataclass(frozen=True)
class GangInfo:
    """Where this process stands in its gang."""

    coordinator: str  # host:port of process 0's coordination service
    process: int  # 0..processes-1 (jax.process_index())
    processes: int  # the gang's size (jax.process_count())
    reach_timeout_s: float = REACH_TIMEOUT_SECONDS  # how long a member tries the coordinator


def gang_from_env(env: dict[str, str] | None = None) -> GangInfo | None:
    """The gang described by KEEL_COORDINATOR / KEEL_REPLICA / KEEL_REPLICAS, or None when this
    process runs alone (KEEL_REPLICAS unset or 1). KEEL_COORDINATOR_TIMEOUT (seconds, optional)
    bounds a member's wait for its coordinator. Raises GangError for values that make no gang."""
    env = dict(os.environ if env is None else env)
    size_text = env.get(REPLICAS, "1").strip() or "1"
    try:
        size = int(size_text)
    except ValueError:
        raise GangError(f"{REPLICAS}={size_text!r} is not a number of processes") from None
    if size < 1:
        raise GangError(f"{REPLICAS}={size} must be at least 1")
    if size == 1:
        return None
    index_text = env.get(REPLICA, "").strip()
    if not index_text.isdigit() or int(index_text) >= size:
        raise GangError(f"{REPLICA}={index_text!r} must be a process index in 0..{size - 1}")
    coordinator = env.get(COORDINATOR, "").strip()
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise GangError(
            f"{COORDINATOR}={coordinator!r} must be host:port (a gang of {size} processes needs "
            "its coordinator's address; keel's launchers set it)"
        )
    return GangInfo(coordinator, int(index_text), size, _reach_timeout(env))


def _reach_timeout(env: dict[str, str]) -> float:
    """KEEL_COORDINATOR_TIMEOUT in seconds (a positive number; REACH_TIMEOUT_SECONDS when unset)."""
    text = env.get(REACH_TIMEOUT, "").strip()
    if not text:
        return REACH_TIMEOUT_SECONDS
    refused = GangError(f"{REACH_TIMEOUT}={text!r} must be a positive number of seconds")
    try:
        seconds = float(text)
    except ValueError:
        raise refused from None
    if not 0 < seconds < float("inf"):  # nan and inf too
        raise refused
    return seconds


def initialize_from_env() -> GangInfo | None:
    """Join the gang the environment describes (see the module docstring); None when this
    process runs alone, in which case JAX is left untouched."""
    gang = gang_from_env()
    if gang is None:
        return None
    import jax

    # Before any backend starts: XLA:CPU's cross-process collectives go over gloo (TCP).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info("%s: joining the gang at %s", process_label(gang), gang.coordinator)
    if gang.process != 0:  # process 0 serves the coordinator itself
        wait_for_coordinator(gang, gang.reach_timeout_s)
    jax.distributed.initialize(
        coordinator_address=gang.coordinator,
        num_processes=gang.processes,
        process_id=gang.process,
        initialization_timeout=INIT_TIMEOUT_SECONDS,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_SECONDS,
    )
    return gang


def wait_for_coordinator(gang: GangInfo, timeout_s: float) -> None:
    """Wait until the coordinator's port accepts a TCP connection (process 0 may start later
    than this one); raise GangError when it does not within `timeout_s` seconds."""
    host, _, port = gang.coordinator.rpartition(":")
    host = host.strip("[]")  # an IPv6 address in brackets
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise GangError(
                    f"{process_label(gang)} cannot reach its gang's coordinator "
                    f"{gang.coordinator} (KEEL_COORDINATOR) within {timeout_s:g} s: "
                    f"{error.strerror or error}; process 0 did not start there, or the "
                    "address is not reachable from this host"
                ) from None
        time.sleep(0.2)


def is_primary(gang: GangInfo | None = None) -> bool:
    """Whether this process writes and says what a run writes and says once (config, metrics,
    results, telemetry, the CLI's report): process 0 of its gang, or a process on its own. The
    one test of it in keel; `gang` defaults to the one the environment describes (KEEL_REPLICA,
    KEEL_REPLICAS), which is the process index `initialize_from_env` gives jax."""
    gang = gang if gang is not None else gang_from_env()
    return gang is None or gang.process == 0


def process_label(gang: GangInfo | None = None) -> str:
    """How log lines name this process: "process 1/2" ("process 0/1" alone); `gang` defaults to
    the one the environment describes."""
    gang = gang if gang is not None else gang_from_env()
    return "process 0/1" if gang is None else f"process {gang.process}/{gang.processes}"


def check_shared_directory(path: str | os.PathLike[str], gang: GangInfo | None = None) -> None:
    """Check that every process of the gang sees the same directory at `path` (every process of
    a multi-host run must write and read the run directory on shared storage). Process 0 writes a
    fresh token there; after a barrier every process reads it back. Every process must call this
    (it is a collective) after `initialize_from_env`; raises GangError on every process when any
    one of them does not see the token. `gang` defaults to the one the environment describes;
    a process alone has nothing to check."""
    gang = gang if gang is not None else gang_from_env()
    if gang is None:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    directory = Path(path)
    token_file = directory / SHARED_TOKEN
    # Everyone agrees on the token through the coordinator, not through the file system.
    token = uuid.uuid4().hex if gang.process == 0 else ""
    token = _broadcast_text(token, multihost_utils)
    if gang.process == 0:
        directory.mkdir(parents=True, exist_ok=True)
        token_file.write_text(token)
    multihost_utils.sync_global_devices(f"keel shared directory {token}")
    try:
        sees = token_file.read_text() == token
    except FileNotFoundError:
        sees = False
    # Every process learns who does not see it, so all of them stop (none waits in a barrier).
    seen = np.asarray(multihost_utils.process_allgather(np.array([sees]))).reshape(-1)
    if gang.process == 0:
        token_file.unlink(missing_ok=True)
    blind = [index for index, ok in enumerate(seen) if not ok]
    if blind:
        names = ", ".join(str(index) for index in blind)
        raise GangError(
            f"{directory} is not shared by the gang: process {names} of {gang.processes} did "
            "not find the token process 0 wrote there; the run directory of a gang must be on "
            "storage every process sees (a network file system or an object store), not on one "
            "host's local disk"
        )


def _broadcast_text(text: str, multihost_utils) -> str:
    """Process 0's `text` (at most 64 ASCII characters) on every process."""
    import numpy as np  # with JAX, as the callers have it

    data = np.zeros(64, dtype=np.uint8)
    encoded = text.encode("ascii")
    data[: len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(data))
    return bytes(shared.astype(np.uint8)).rstrip(b"\0").decode("ascii")
