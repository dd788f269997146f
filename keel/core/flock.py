"""An exclusive lock on a file, held by an open descriptor (flock).

The kernel drops it when its holder exits, SIGKILL included, so a crashed holder never leaves a
stale lock behind. Used for one controller per cluster root and one writer per telemetry root. The
file must be on a local file system (flock across NFS clients is not reliable).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def try_lock(path: Path, mode: int = 0o600) -> int | None:
    """Open `path` (made if missing, with `mode`) and lock it without waiting: the descriptor that
    holds the lock (close it to release), or None when another descriptor holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
