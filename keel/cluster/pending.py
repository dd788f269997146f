"""The controller's queue of pending jobs, kept in memory in queue order.

The controller loads it once at start and then keeps it up to date as jobs arrive (new rows in
the jobs table), are assigned, rejected, requeued or cancelled, so a tick never re-reads the
whole queue from SQLite (10,000 queued ids took ~10 ms a tick). Queue order is the scheduler's:
priority band first (production, interactive, batch), then submission sequence.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain

from keel.cluster.scheduler import PendingJob
from keel.cluster.spec import Priority


class PendingQueue:
    """Pending jobs by id, in (priority, sequence) order."""

    def __init__(self) -> None:
        # One dict per priority band, in insertion order; a band is re-sorted only after a job
        # went in out of sequence order (a requeued job), which is rare.
        self._bands: dict[Priority, dict[str, PendingJob]] = {band: {} for band in Priority}
        self._unsorted: set[Priority] = set()
        self._band_of: dict[str, Priority] = {}  # job id -> its band
        self._shapes: dict[tuple, int] = {}  # PendingJob.shape -> jobs of that shape queued

    def __len__(self) -> int:
        return len(self._band_of)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._band_of

    @property
    def shapes(self) -> int:
        """How many distinct job shapes (scheduler.PendingJob.shape) are queued."""
        return len(self._shapes)

    def add(self, job: PendingJob) -> None:
        band = self._bands[job.priority]
        if job.job_id in band:
            return
        if band and band[next(reversed(band))].sequence > job.sequence:
            self._unsorted.add(job.priority)
        band[job.job_id] = job
        self._band_of[job.job_id] = job.priority
        self._shapes[job.shape] = self._shapes.get(job.shape, 0) + 1

    def remove(self, job_id: str) -> None:
        """Take a job out of the queue (no-op when it is not queued)."""
        priority = self._band_of.pop(job_id, None)
        if priority is None:
            return
        job = self._bands[priority].pop(job_id)
        left = self._shapes[job.shape] - 1
        if left:
            self._shapes[job.shape] = left
        else:
            del self._shapes[job.shape]

    def ordered(self) -> Iterator[PendingJob]:
        """Every queued job, in queue order, as an iterator (a scheduling round reads the head
        of the queue: no list of 10,000 jobs is made each tick); valid until the queue
        changes."""
        for priority in self._unsorted:
            band = self._bands[priority]
            self._bands[priority] = {
                job.job_id: job for job in sorted(band.values(), key=lambda j: j.sequence)
            }
        self._unsorted.clear()
        return chain.from_iterable(self._bands[priority].values() for priority in Priority)
