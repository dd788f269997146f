"""SIGTERM as a request to stop after saving, for work that can save its progress (training).

Slurm preempts with SIGTERM (then SIGKILL after its grace time), and `keel job cancel` sends
SIGTERM first too. A training loop registered here finishes the step it is in, writes a
checkpoint and raises `Stopped`, so the rerun loses nothing; with no such work running, SIGTERM
keeps its default meaning and ends the process at once.

A signal handler can only be installed from the main thread, while `keel run` trains in worker
threads: so the main thread installs the handler (`install_handler`, called by the commands that
may train) and the work, in any thread, holds `stoppable()` while it runs and polls
`stop_requested()` at its safe points.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from keel.core.errors import KeelError

_requested = threading.Event()
_lock = threading.Lock()
_running = 0  # stoppable work in progress, in any thread


class Stopped(KeelError):
    """The work stopped on SIGTERM after saving its progress; run the same command to resume.
    Exits 143 (128 + SIGTERM), as a process ended by SIGTERM does."""

    exit_code = 128 + signal.SIGTERM


def install_handler() -> bool:
    """Make SIGTERM a stop request while stoppable work runs; whether it was installed (only
    the main thread can install it; elsewhere SIGTERM keeps its meaning)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


@contextmanager
def stoppable() -> Iterator[None]:
    """Mark stoppable work as running for the block: a SIGTERM meanwhile sets `stop_requested`."""
    global _running
    with _lock:
        _running += 1
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if _running == 0:
                _requested.clear()


def stop_requested() -> bool:
    """Whether a SIGTERM arrived while stoppable work was running."""
    return _requested.is_set()


def _on_sigterm(signum: int, frame: object) -> None:
    with _lock:
        running = _running
    if running:
        _requested.set()
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing to save: end as SIGTERM does
    os.kill(os.getpid(), signal.SIGTERM)
