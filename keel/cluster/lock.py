"""One controller per root: an OS lock (flock) on `<root>/controller.lock`, held for the
controller's whole life.

The kernel drops the lock when its holder exits, SIGKILL included, so a crashed controller never
leaves a stale lock behind, and two processes can never both hold it: whoever fails to take it
does not run a controller. `held_by_someone` asks without taking it for more than an instant.
The root must be on a local file system (flock across NFS clients is not reliable).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from keel.core.flock import try_lock

LOCK_FILE = "controller.lock"


class ControllerLock:
    """The lock of one root; `acquire()` says whether this process now holds it."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Take the lock without waiting; False when another process holds it."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = try_lock(self.path)
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def held_by_someone(root: Path) -> bool:
    """Whether a process (this one included, through another ControllerLock) holds the lock."""
    path = Path(root) / LOCK_FILE
    if not path.exists():
        return False
    probe = ControllerLock(Path(root))
    if probe.acquire():
        probe.release()
        return False
    return True
