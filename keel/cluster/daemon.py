"""Running a controller: in the foreground (`keel cluster start`) or, when a job command finds
none, as an embedded one detached in the background that exits once idle.

One controller per root: a controller holds the root's lock (keel.cluster.lock) for its whole
life, and a process that cannot take it runs none (a job command then only submits; the running
controller picks the job up). A running controller also announces itself in
`<root>/controller.json` (pid, host, config, start time, URL). The embedded controller is
started with the same root and config and stops after `EMBEDDED_IDLE_SECONDS` with no pending or
running job.

    python -m keel.cluster.daemon ROOT [CONFIG]      # what `keel job run` starts when needed
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from keel.cluster import state
from keel.cluster.api import ControllerServer
from keel.cluster.config import FederationConfig, load_federation, make_backend
from keel.cluster.controller import Controller
from keel.cluster.lock import ControllerLock, held_by_someone
from keel.cluster.secrets import private_dir
from keel.core import paths
from keel.core.errors import KeelError, UsageError
from keel.core.process import process_alive

logger = logging.getLogger(__name__)
ANNOUNCEMENT = "controller.json"
EMBEDDED_IDLE_SECONDS = 30.0
ALREADY_RUNNING_EXIT = 3  # the embedded controller's exit status when another one runs


def build_controller(root: Path, federation: FederationConfig) -> Controller:
    backends = {c.name: make_backend(c, root) for c in federation.clusters}
    return Controller(
        root,
        backends,
        regions={c.name: c.region for c in federation.clusters},
        report_every=federation.report_every,
        telemetry=federation.telemetry,
    )


def running_controller(root: Path) -> dict[str, Any] | None:
    """The announcement of the controller running for `root`, or None when none does. A
    controller runs while a process holds the root's lock; one that has just taken it and not yet
    announced itself shows as {"pid": None, "url": None, "starting": True}."""
    if not held_by_someone(root):
        return None
    try:
        announcement = orjson.loads((root / ANNOUNCEMENT).read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        announcement = None
    if (
        announcement is None
        or announcement.get("host") != socket.gethostname()
        or not process_alive(announcement["pid"])
    ):
        return {"pid": None, "url": None, "starting": True}
    return announcement


class ControllerRunning(UsageError):
    """Another process holds the root's lock: it is the controller, this one does not run."""


def run(
    root: Path,
    config: str | None,
    *,
    stop_when_idle: float | None = None,
    serve: tuple[str, int, str | None] | None = None,
) -> None:
    """Run a controller for `root` until stopped (or idle that long), holding the root's lock the
    whole time; ControllerRunning if another process holds it. `serve` = (host, port, token)
    also serves its HTTP API (keel.cluster.api)."""
    private_dir(root)
    federation = load_federation(config)
    lock = ControllerLock(root)
    if not lock.acquire():
        running = running_controller(root) or {}
        raise ControllerRunning(
            f"a controller already runs for {root} (pid {running.get('pid') or 'starting'}): "
            "stop it first with `keel cluster stop`"
        )
    try:
        while True:
            went_idle = _run_locked(root, config, federation, stop_when_idle, serve)
            lock.release()
            # A job submitted after the idle check saw no lock taken or saw ours: look once more
            # now that it is released, and carry on if there is work and nobody else took over.
            if not went_idle or not _has_active_jobs(root) or not lock.acquire():
                return
    finally:
        lock.release()


def _run_locked(
    root: Path,
    config: str | None,
    federation: FederationConfig,
    stop_when_idle: float | None,
    serve: tuple[str, int, str | None] | None,
) -> bool:
    """One controller's life under the lock; True when it stopped because it was idle."""
    server = ControllerServer(root.resolve(), *serve).start() if serve is not None else None
    controller = build_controller(root, federation)
    announcement = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "config": config,
        "started": time.time(),
        "clusters": [c.name for c in federation.clusters],
        "url": server.url if server is not None else None,
    }
    paths.write_text(root / ANNOUNCEMENT, orjson.dumps(announcement).decode())
    with state.transaction(controller.database):
        state.event(controller.database, None, "controller started", f"pid {os.getpid()}")
    try:
        return controller.run(tick_seconds=federation.tick_seconds, stop_when_idle=stop_when_idle)
    finally:
        if server is not None:
            server.stop()
        controller.logs.close()
        controller.close()
        (root / ANNOUNCEMENT).unlink(missing_ok=True)  # ours: we still hold the lock


def _has_active_jobs(root: Path) -> bool:
    database = state.connect(root / "state.db")
    try:
        query = "SELECT count(*) FROM jobs WHERE state IN ('pending', 'running', 'preempted')"
        return database.execute(query).fetchone()[0] > 0
    finally:
        database.close()


def ensure_controller(root: Path, config: str | None) -> None:
    """Start an embedded controller for `root` unless one runs (it then picks up the work)."""
    if running_controller(root) is None:
        start_embedded(root, config)


def start_embedded(root: Path, config: str | None) -> int:
    """Start a detached controller for `root` that exits when idle; return its pid. When another
    process takes the root's lock first, that one is the controller and this one exits at once."""
    private_dir(root)
    command = [sys.executable, "-m", "keel.cluster.daemon", str(root)]
    if config:
        command.append(config)
    with open(root / "controller.log", "ab") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
    deadline = time.monotonic() + 20.0
    while running_controller(root) is None:
        code = process.poll()
        if code == ALREADY_RUNNING_EXIT:
            return process.pid  # another controller held the lock: it runs the work
        if code is not None:
            raise KeelError(
                f"the embedded controller exited at once: see {root / 'controller.log'}"
            )
        if time.monotonic() > deadline:
            raise KeelError(f"the embedded controller did not start: see {root / 'controller.log'}")
        time.sleep(0.05)
    return process.pid


def main(arguments: list[str]) -> int:
    """`python -m keel.cluster.daemon ROOT [CONFIG]`: the embedded controller's process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        run(
            Path(arguments[0]),
            arguments[1] if len(arguments) > 1 else None,
            stop_when_idle=EMBEDDED_IDLE_SECONDS,
        )
    except ControllerRunning as error:
        logger.info("not starting: %s", error)
        return ALREADY_RUNNING_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
