"""Running a controller: in the foreground (`keel cluster start`) or, when a job command finds
none, as an embedded one detached in the background that exits once idle.

A running controller announces itself in `<root>/controller.json` (pid, host, config, start time);
job commands read it to know whether one is running. The embedded controller is started with the
same root and config and stops after `EMBEDDED_IDLE_SECONDS` with no pending or running job.

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

from keel.cluster.api import ControllerServer
from keel.cluster.config import FederationConfig, load_federation, make_backend
from keel.cluster.controller import Controller
from keel.core import paths
from keel.core.process import process_alive

logger = logging.getLogger(__name__)
ANNOUNCEMENT = "controller.json"
EMBEDDED_IDLE_SECONDS = 30.0


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
    """The announcement of a live controller for `root`, or None."""
    try:
        announcement = orjson.loads((root / ANNOUNCEMENT).read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None
    if announcement.get("host") != socket.gethostname() or not process_alive(announcement["pid"]):
        return None
    return announcement


def run(
    root: Path,
    config: str | None,
    *,
    stop_when_idle: float | None = None,
    serve: tuple[str, int, str | None] | None = None,
) -> None:
    """Run a controller for `root` until stopped (or idle that long); announce it meanwhile.
    `serve` = (host, port, token) also serves its HTTP API (keel.cluster.api)."""
    root.mkdir(parents=True, exist_ok=True)
    federation = load_federation(config)
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
    try:
        controller.run(tick_seconds=federation.tick_seconds, stop_when_idle=stop_when_idle)
    finally:
        if server is not None:
            server.stop()
        controller.logs.close()
        controller.close()
        current = running_controller(root)
        if current is None or current["pid"] == os.getpid():
            (root / ANNOUNCEMENT).unlink(missing_ok=True)


def start_embedded(root: Path, config: str | None) -> int:
    """Start a detached controller for `root` that exits when idle; return its pid."""
    root.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "keel.cluster.daemon", str(root)]
    if config:
        command.append(config)
    with open(root / "controller.log", "ab") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
    deadline = time.monotonic() + 20.0
    while running_controller(root) is None:
        if process.poll() is not None:
            raise RuntimeError(
                f"the embedded controller exited at once: see {root / 'controller.log'}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the embedded controller did not start: see {root / 'controller.log'}"
            )
        time.sleep(0.05)
    return process.pid


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    run(
        Path(sys.argv[1]),
        sys.argv[2] if len(sys.argv) > 2 else None,
        stop_when_idle=EMBEDDED_IDLE_SECONDS,
    )
