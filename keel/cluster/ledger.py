"""The reservation ledger: free capacity between a cluster's capacity reports.

A cluster reports its free capacity now and then (every k ticks). Between two reports the
controller keeps assigning; those assignments are not in the last report yet, so each one is
recorded as a reservation and subtracted: free = reported - reserved since the report. A report
taken at tick t (before tick t's launches) clears the reservations of earlier ticks, whose launches
the engine's numbers include. A job that ends between reports frees nothing until the next report:
capacity is never counted twice, so several ticks between reports never over-assign.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class Report:
    free: dict[str, float]
    tick: int


@dataclass
class CapacityLedger:
    reports: dict[str, Report] = field(default_factory=dict)
    reservations: dict[str, tuple[str, Mapping[str, float], int]] = field(default_factory=dict)

    def report(self, cluster: str, free: Mapping[str, float], tick: int) -> None:
        """A capacity report taken at the start of `tick`, before that tick's launches."""
        self.reports[cluster] = Report(dict(free), tick)
        for job, (where, _, at) in list(self.reservations.items()):
            if where == cluster and at < tick:
                del self.reservations[job]

    def reserve(self, job: str, cluster: str, demand: Mapping[str, float], tick: int) -> None:
        """Hold `demand` (kept, not copied: the caller never changes it) on `cluster`."""
        self.reservations[job] = (cluster, demand, tick)

    def free(self, cluster: str) -> dict[str, float]:
        """Capacity the scheduler may still hand out on `cluster` (nothing before a report)."""
        report = self.reports.get(cluster)
        if report is None:
            return {}
        free = dict(report.free)
        for where, demand, _ in self.reservations.values():
            if where == cluster:
                for kind, amount in demand.items():
                    free[kind] = free.get(kind, 0.0) - amount
        return free
