"""One long-lived thread that interrupts queries past their deadline.

A `threading.Timer` per query starts (and joins) a thread each time: ~0.7 ms per query on a busy
machine. The watchdog keeps a heap of deadlines instead; arming and disarming a query is a lock, a
heap push and a dict update. `disarm` and the interrupt take the same lock, so once `disarm`
returns no interrupt for that query can still arrive.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Watchdog:
    """Calls a query's `interrupt` once `time.monotonic()` passes its deadline (seconds)."""

    def __init__(self, name: str = "keel-telemetry-watchdog") -> None:
        self._name = name
        self._lock = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, Callable[[], None]] = {}
        self._fired: set[int] = set()
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def arm(self, deadline: float, interrupt: Callable[[], None]) -> int:
        """Watch one query; returns the token to `disarm` it with."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the query watchdog is stopped")
            token = next(self._tokens)
            self._armed[token] = interrupt
            if len(self._heap) > 4 * len(self._armed) + 1024:  # mostly disarmed entries
                self._heap = [entry for entry in self._heap if entry[1] in self._armed]
                heapq.heapify(self._heap)
            earliest = not self._heap or deadline < self._heap[0][0]
            heapq.heappush(self._heap, (deadline, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name=self._name, daemon=True)
                self._thread.start()
            elif earliest:
                self._lock.notify()
            return token

    def disarm(self, token: int) -> bool:
        """Stop watching the query; True if it was interrupted."""
        with self._lock:
            self._armed.pop(token, None)
            if token in self._fired:
                self._fired.discard(token)
                return True
            return False

    def stop(self) -> None:
        """End the thread; armed queries are no longer interrupted."""
        with self._lock:
            self._stopping = True
            self._armed.clear()
            self._lock.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _watch(self) -> None:
        with self._lock:
            while not self._stopping:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)  # disarmed: drop lazily
                if not self._heap:
                    self._lock.wait()
                    continue
                deadline, token = self._heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
                heapq.heappop(self._heap)
                interrupt = self._armed.pop(token)
                self._fired.add(token)
                try:
                    interrupt()  # under the lock: disarm cannot return between fire and interrupt
                except Exception:
                    logger.exception("interrupting a query past its deadline failed")
