"""A step lock with a heartbeat, so that many runners execute each step once.

The lock is a small JSON file (owner, host, pid, heartbeat time) created exclusively. Its holder
rewrites the heartbeat every `heartbeat_every` seconds from a background thread. A lock is stale,
and may be taken over, when its heartbeat is older than `stale_after` seconds, or at once when its
holder ran on this host and that process is gone (killed, crashed). Takeover is itself exclusive:
the taker first creates `lock.json.takeover-{digest of the stale content}`, so of several runners
that saw the same stale lock only one replaces it.

Local filesystems get O_EXCL creation (atomic). On object stores the creation is "write if absent"
where the filesystem supports it and check-then-write otherwise: best effort, documented in
docs/steps.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from keel.core import paths
from keel.core.errors import LockLostError
from keel.core.process import process_alive, process_start

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LockSettings:
    """Timing of step locks, in seconds."""

    heartbeat_every: float = 5.0
    stale_after: float = 60.0
    poll_every: float = 0.25


@dataclass(frozen=True)
class LockInfo:
    """What a lock file says about its holder."""

    owner: str
    host: str
    pid: int
    pid_start: int | None
    heartbeat: float

    def is_stale(self, settings: LockSettings, now: float | None = None) -> bool:
        if self.host == socket.gethostname() and not process_alive(self.pid, self.pid_start):
            return True
        return (time.time() if now is None else now) - self.heartbeat > settings.stale_after


class StepLock:
    """An exclusive, heartbeated lock at `path` (a local path or fsspec URL)."""

    def __init__(self, path: str, settings: LockSettings | None = None) -> None:
        self.path = path
        self.settings = settings or LockSettings()
        self.owner = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost = threading.Event()

    def try_acquire(self) -> bool:
        """Take the lock if it is free or stale; never blocks. True when this object holds it."""
        if self._create_exclusive():
            self._start_heartbeat()
            return True
        holder = self.holder()
        if holder is None:
            return False  # being created by someone else right now, or just released: retry later
        if not holder.is_stale(self.settings):
            return False
        if self._take_over(holder):
            self._start_heartbeat()
            return True
        return False

    def holder(self) -> LockInfo | None:
        """The current holder, or None when there is no lock or it is being written."""
        try:
            data = json.loads(paths.read_text(self.path))
            return LockInfo(**data)
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, TypeError):
            if self._abandoned_while_created():
                return LockInfo(owner="?", host="?", pid=-1, pid_start=None, heartbeat=0.0)
            return None

    def check_held(self) -> None:
        """Raise LockLostError unless this object still holds the lock."""
        holder = self.holder()
        if self._lost.is_set() or holder is None or holder.owner != self.owner:
            raise LockLostError(
                f"lock {self.path} was taken over by another runner while this one held it"
            )

    def release(self) -> None:
        """Stop the heartbeat and delete the lock if this object still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        holder = self.holder()
        if holder is not None and holder.owner == self.owner:
            _remove(self.path)

    def _info(self) -> LockInfo:
        pid = os.getpid()
        return LockInfo(self.owner, socket.gethostname(), pid, process_start(pid), time.time())

    def _content(self) -> str:
        return json.dumps(asdict(self._info()))

    def _create_exclusive(self) -> bool:
        content = self._content()
        if paths.is_local(self.path):
            target = paths.local_path(self.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                descriptor = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                handle.write(content)
                handle.flush()
                os.fsync(handle.fileno())
            return True
        fs, fs_path = paths.filesystem(self.path)
        try:
            with fs.open(fs_path, "xb") as handle:
                handle.write(content.encode("utf-8"))
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError):  # this filesystem has no exclusive create
            if fs.exists(fs_path):
                return False
            fs.pipe_file(fs_path, content.encode("utf-8"))
        holder = self.holder()
        return holder is not None and holder.owner == self.owner

    def _take_over(self, stale: LockInfo) -> bool:
        digest = hashlib.sha256(json.dumps(asdict(stale)).encode()).hexdigest()[:16]
        token = StepLock(f"{self.path}.takeover-{digest}", self.settings)
        if not token._create_exclusive():
            return False
        try:
            if self.holder() != stale:
                return False  # someone else replaced it in between
            logger.warning(
                "taking over stale lock %s (holder %s pid %s, last heartbeat %.0f s ago)",
                self.path,
                stale.host,
                stale.pid,
                time.time() - stale.heartbeat,
            )
            _remove(self.path)
            return self._create_exclusive()
        finally:
            _remove(token.path)

    def _abandoned_while_created(self) -> bool:
        """An unreadable lock file older than stale_after: its creator died mid-write."""
        fs, fs_path = paths.filesystem(self.path)
        try:
            modified = fs.modified(fs_path).timestamp()
        except FileNotFoundError:
            return False
        return time.time() - modified > self.settings.stale_after

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._lost.clear()
        self._thread = threading.Thread(
            target=self._beat, name=f"keel-lock-heartbeat:{self.path}", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_every):
            holder = self.holder()
            if holder is None or holder.owner != self.owner:
                logger.error("lost lock %s to another runner", self.path)
                self._lost.set()
                return
            paths.write_text(self.path, self._content())


def _remove(path: str) -> None:
    fs, fs_path = paths.filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(fs_path)
