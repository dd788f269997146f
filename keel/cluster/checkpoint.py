"""Checkpoints of the state database's write-ahead log, off the controller's tick.

In WAL mode SQLite copies the log back into the database file (a checkpoint, with two fsyncs
under synchronous=NORMAL) inside whichever commit grows the log past `wal_autocheckpoint` pages.
At 10,000 queued jobs that was every few ticks, and a checkpoint of ~1,000 pages takes 15-47 ms
on a small VM's disk, against ~1 ms for the tick's commit. The controller's connection
therefore checkpoints only as a backstop (the log past BACKSTOP_PAGES), and a thread of its own,
with its own connection, runs a PASSIVE checkpoint (it never blocks a writer or a reader) once
the controller has changed EVERY_ROWS rows since the last one: not after every tick, as each
checkpoint costs two fsyncs, and ticks of a few jobs come many a second.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

logger = logging.getLogger(__name__)
BACKSTOP_PAGES = 10_000  # ~40 MB of log: only reached if the thread cannot keep up
EVERY_ROWS = 4_000  # rows changed between checkpoints (~3 ticks at 10,000 queued jobs)


class Checkpointer:
    """Runs `PRAGMA wal_checkpoint(PASSIVE)` on `path` from a thread once `committed` has seen
    `every_rows` rows changed since the last time (a request that arrives while one runs is
    served by the next); `close()` stops it."""

    def __init__(self, path: str | Path, every_rows: int = EVERY_ROWS) -> None:
        self.path = str(path)
        self.every_rows = every_rows
        self._changes_then = 0  # the writer's total_changes when a checkpoint was last asked for
        self.done = 0  # checkpoints run
        self.failures = 0  # checkpoints that raised (logged; the backstop still bounds the log)
        self._wanted = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="keel-wal-checkpoint", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def committed(self, writer: sqlite3.Connection) -> None:
        """Called after the writer's commits: asks for a checkpoint when it is due."""
        if writer.total_changes - self._changes_then >= self.every_rows:
            self._changes_then = writer.total_changes
            self._wanted.set()

    def close(self) -> None:
        self._closing = True
        self._wanted.set()
        self._thread.join()

    def _run(self) -> None:
        database = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            while True:
                self._wanted.wait()
                self._wanted.clear()
                if self._closing:
                    return
                try:
                    database.execute("PRAGMA wal_checkpoint(PASSIVE)")
                    self.done += 1
                except sqlite3.Error as error:  # the tick goes on; the backstop bounds the log
                    self.failures += 1
                    logger.warning("checkpointing %s failed: %s", self.path, error)
        finally:
            database.close()
