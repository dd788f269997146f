"""The scheduling decision: a pure function from the queue and the clusters' capacity to actions.

For each pending job, in priority order (production, interactive, batch) and then submission order:
- reject it, with the reason, when no cluster could ever run it: no cluster in its region, no
  cluster with its device type, or no single cluster large enough for the whole gang (capacity never
  sums across clusters: an 8-GPU gang is not split 4 + 4);
- assign it to one cluster whose free capacity holds the whole gang now: the home cluster when it
  fits, else the peer that fits most tightly on the job's scarcest resource;
- else, for a production job, preempt the newest batch work on the cluster where the fewest jobs
  must stop, and hold that cluster for it (nothing lower starts there this round);
- else leave it queued, with the reason. Queued jobs hold no capacity.
Within a round a job shape that did not fit once does not fit again, so once every shape in the
queue is blocked the rest of the queue (no production job among it) is only waiting: given
`shape_count` (how many distinct shapes the queue holds), the round stops there and the decision
gives each shape's reason instead of listing 10,000 waiting jobs one by one.
Nothing here touches a database or a backend; the controller applies the decision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import orjson

from keel.cluster.spec import Priority

EPSILON = 1e-9
_queue_order = attrgetter("priority", "sequence")


@dataclass(slots=True)
class PendingJob:
    """A queued job as the scheduler sees it (the controller keeps one per queued job: slotted,
    never changed once made). `demand` may be shared by jobs of one shape and is never mutated;
    `shape` is computed from it unless the caller passes the one it interned (keel.cluster.feed)."""

    job_id: str
    priority: Priority
    sequence: int  # submission order
    demand: Mapping[str, float]  # the whole gang, per device type ("cpu" = cpus)
    region: str = ""
    cluster: str = ""  # "" = any; else only this cluster
    shape: tuple = ()  # what placement depends on: jobs of one shape fit or do not fit alike

    def __post_init__(self) -> None:
        if not self.shape:
            self.shape = job_shape(self.demand, self.region, self.cluster)


def job_shape(demand: Mapping[str, float], region: str, cluster: str) -> tuple:
    """PendingJob.shape: (sorted demand items, region, cluster)."""
    return tuple(sorted(demand.items())), region, cluster


def shape_key(shape: tuple) -> str:
    """A job shape (`job_shape`) as text: the key of its waiting reason in the state database
    (keel.cluster.state's waiting table), made alike by the controller, which holds the shape,
    and by a reader, which makes the shape from the job's spec."""
    return orjson.dumps(shape).decode()


@dataclass(slots=True)
class RunningJob:
    """A running job as the scheduler sees it (never changed once made; `demand` is never
    mutated)."""

    job_id: str
    cluster: str
    priority: Priority
    sequence: int
    demand: Mapping[str, float]
    stopping: bool = False  # already being preempted or cancelled: its capacity is coming back


@dataclass(frozen=True)
class ClusterView:
    """A cluster as the scheduler sees it: advertised total, and free = last report minus what
    was assigned since (the reservation ledger)."""

    name: str
    total: Mapping[str, float]
    free: Mapping[str, float]
    region: str = ""


@dataclass
class Decision:
    assignments: list[tuple[str, str]] = field(default_factory=list)  # (job, cluster)
    preemptions: list[str] = field(default_factory=list)  # running jobs to stop and requeue
    rejections: dict[str, str] = field(default_factory=dict)  # job -> why no cluster can run it
    waiting: dict[str, str] = field(default_factory=dict)  # job -> why it is still queued
    # When the round stopped before the end of the queue (see the module docstring): why each
    # shape waits; the jobs it did not look at wait for their shape's reason.
    blocked: dict[tuple, str] = field(default_factory=dict)


def schedule(
    pending: Iterable[PendingJob],
    running: Sequence[RunningJob],
    clusters: Sequence[ClusterView],
    home: str | None = None,
    *,
    in_order: bool = False,
    shape_count: int | None = None,
) -> Decision:
    """Decide this round's assignments, preemptions and rejections (see the module docstring).
    `in_order`: `pending` is already sorted by (priority, sequence) (and may be an iterator);
    `shape_count`: the number of distinct `PendingJob.shape`s in `pending`, which lets the round
    stop early (with in_order)."""
    decision = Decision()
    free = {c.name: dict(c.free) for c in clusters}
    held: set[str] = set()  # clusters held for a blocked production job this round
    stopping = {c.name: _zero() for c in clusters}
    for job in running:
        if job.stopping and job.cluster in stopping:
            _add(stopping[job.cluster], job.demand)
    preemptible: dict[str, list[RunningJob]] = {}  # filled when a production job needs it

    # Within a round free capacity only shrinks and held clusters only grow, so a job shape
    # (demand, region) that did not fit once does not fit again: decide it once per round.
    shapes: dict[tuple, tuple[list[ClusterView], str]] = {}
    blocked: dict[tuple, str] = {}
    production = Priority.PRODUCTION
    ordered = pending if in_order else sorted(pending, key=_queue_order)
    every_shape = shape_count if in_order and shape_count is not None else -1
    for job in ordered:
        shape = job.shape
        if len(blocked) == every_shape and job.priority != production:
            decision.blocked = blocked
            break
        if shape in blocked and job.priority != production:
            decision.waiting[job.job_id] = blocked[shape]
            continue
        if shape not in shapes:
            shapes[shape] = _feasible(job, clusters)
        feasible, reason = shapes[shape]
        if not feasible:
            decision.rejections[job.job_id] = reason
            continue
        open_clusters = [c for c in feasible if c.name not in held]
        fitting = [c for c in open_clusters if _fits(job.demand, free[c.name])]
        if fitting:
            chosen = _choose(job, fitting, free, home)
            _subtract(free[chosen], job.demand)
            decision.assignments.append((job.job_id, chosen))
            continue
        if job.priority == Priority.PRODUCTION:
            if not preemptible:
                preemptible = _preemptible(running, clusters)
            plan = _preemption_plan(job, open_clusters, free, stopping, preemptible)
            if plan is not None:
                cluster, victims = plan
                for victim in victims:
                    decision.preemptions.append(victim.job_id)
                    preemptible[cluster].remove(victim)
                    _add(stopping[cluster], victim.demand)
                held.add(cluster)
                decision.waiting[job.job_id] = f"preempting batch work on {cluster}"
                continue
        blocked[shape] = _waiting_reason(job, feasible, free, held)
        decision.waiting[job.job_id] = blocked[shape]
    return decision


def _preemptible(
    running: Sequence[RunningJob], clusters: Sequence[ClusterView]
) -> dict[str, list[RunningJob]]:
    """Per cluster, the batch jobs a production job may stop, newest first."""
    preemptible: dict[str, list[RunningJob]] = {c.name: [] for c in clusters}
    for job in sorted(running, key=lambda j: -j.sequence):
        if job.priority == Priority.BATCH and not job.stopping and job.cluster in preemptible:
            preemptible[job.cluster].append(job)
    return preemptible


def _feasible(job: PendingJob, clusters: Sequence[ClusterView]) -> tuple[list[ClusterView], str]:
    """Clusters that could run the whole gang if empty, or the reason there are none."""
    named = [c for c in clusters if not job.cluster or c.name == job.cluster]
    if not named:
        return [], f"no cluster named {job.cluster!r}"
    in_region = [c for c in named if not job.region or c.region == job.region]
    if not in_region:
        return [], f"no cluster in region {job.region!r}"
    for kind, amount in job.demand.items():
        having = [c for c in in_region if c.total.get(kind, 0.0) > 0]
        if not having:
            return [], f"no cluster has device type {kind!r}"
        largest = max(c.total.get(kind, 0.0) for c in having)
        if largest + EPSILON < amount:
            return [], (
                f"needs {amount:g} {kind} on one cluster; the largest has {largest:g} "
                "(a gang is never split across clusters)"
            )
    feasible = [c for c in in_region if _fits(job.demand, c.total)]
    if not feasible:
        return [], "no single cluster has every resource the gang needs at once"
    return feasible, ""


def _fits(demand: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(kind, 0.0) + EPSILON >= amount for kind, amount in demand.items())


def _scarcest(demand: Mapping[str, float]) -> str:
    """The device type that decides placement: any accelerator before cpus."""
    accelerators = [kind for kind in demand if kind != "cpu"]
    return accelerators[0] if accelerators else "cpu"


def _choose(
    job: PendingJob, fitting: list[ClusterView], free: dict[str, dict[str, float]], home: str | None
) -> str:
    if home is not None and any(c.name == home for c in fitting):
        return home
    kind = _scarcest(job.demand)
    return min(fitting, key=lambda c: (free[c.name].get(kind, 0.0) - job.demand[kind], c.name)).name


def _preemption_plan(
    job: PendingJob,
    clusters: list[ClusterView],
    free: dict[str, dict[str, float]],
    stopping: dict[str, dict[str, float]],
    preemptible: dict[str, list[RunningJob]],
) -> tuple[str, list[RunningJob]] | None:
    """The cluster where stopping the fewest (newest first) batch jobs frees room for `job`."""
    best: tuple[str, list[RunningJob]] | None = None
    for cluster in clusters:
        room = dict(free[cluster.name])
        _add(room, stopping[cluster.name])
        victims: list[RunningJob] = []
        for candidate in preemptible[cluster.name]:
            if _fits(job.demand, room):
                break
            victims.append(candidate)
            _add(room, candidate.demand)
        if not _fits(job.demand, room):
            continue
        if best is None or len(victims) < len(best[1]):
            best = (cluster.name, victims)
    return best


def _waiting_reason(
    job: PendingJob, feasible: list[ClusterView], free: dict[str, dict[str, float]], held: set[str]
) -> str:
    kind = _scarcest(job.demand)
    best = max(feasible, key=lambda c: free[c.name].get(kind, 0.0))
    note = " (held for production work)" if best.name in held else ""
    return (
        f"waiting for capacity: needs {job.demand[kind]:g} {kind}, "
        f"most free is {free[best.name].get(kind, 0.0):g} on {best.name}{note}"
    )


def _zero() -> dict[str, float]:
    return {}


def _add(into: dict[str, float], amounts: Mapping[str, float]) -> None:
    for kind, amount in amounts.items():
        into[kind] = into.get(kind, 0.0) + amount


def _subtract(into: dict[str, float], amounts: Mapping[str, float]) -> None:
    for kind, amount in amounts.items():
        into[kind] = into.get(kind, 0.0) - amount
