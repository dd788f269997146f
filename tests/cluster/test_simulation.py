"""A randomized federation: 10,000 jobs over three clusters whose engines report their free
capacity only every k ticks, scheduled by keel.cluster.scheduler.schedule through the ledger.

Each cluster's engine is simulated here in plain Python: it holds the tasks (job replicas) that
truly run on it and their demand, ends each attempt after a random number of ticks and fails some
at random. One tick, as the controller does it:
  1. the engines' completions and failures (a failure is retried up to max_retries);
  2. each cluster that is due reports its free capacity into the ledger (cluster i when
     (tick + i) % k == 0, and all of them on tick 1);
  3. schedule(pending, running, views with free = ledger.free);
  4. assignments start at once on the engine and are reserved in the ledger, preempted jobs are
     stopped and requeued, rejected jobs end with their reason.
After the assignments of EVERY tick: no cluster runs more than its total of any device type, and
no job has replicas on two clusters. At the end: every job that some cluster could run finished
(succeeded, or failed through its own random failures with its retries used up) and every job no
cluster could run was rejected with a reason, without ever starting.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from keel.cluster.ledger import CapacityLedger
from keel.cluster.scheduler import ClusterView, PendingJob, RunningJob, schedule
from keel.cluster.spec import Priority

CLUSTERS: dict[str, tuple[dict[str, float], str]] = {  # name: (total, region)
    "a": ({"cpu": 64.0, "h100": 16.0}, "us"),
    "b": ({"cpu": 128.0, "tpu-v5e": 32.0}, "eu"),
    "c": ({"cpu": 256.0}, "us"),
}
JOBS = 10_000
ARRIVAL_TICKS = 2_000  # jobs arrive uniformly over this many ticks
MAX_TICKS = 50_000  # a simulation still running here has stopped making progress
FAILURE_RATE = 0.08  # per attempt
EPSILON = 1e-9


@dataclass
class Job:
    job_id: str
    sequence: int
    priority: Priority
    per_replica: dict[str, float]
    replicas: int
    region: str
    arrival: int
    max_retries: int
    state: str = "future"  # future pending running succeeded failed rejected
    cluster: str = ""
    failures: int = 0
    preemptions: int = 0
    attempts: int = 0
    reason: str = ""
    demand: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        self.demand = {kind: amount * self.replicas for kind, amount in self.per_replica.items()}

    def satisfiable(self) -> bool:
        """Could one cluster in the job's region hold the whole gang when empty? (Worked out
        here, independently of the scheduler.)"""
        return any(
            (not self.region or region == self.region)
            and all(total.get(kind, 0.0) >= amount for kind, amount in self.demand.items())
            for total, region in CLUSTERS.values()
        )


class Engine:
    """One cluster's engine: the tasks truly running on it, each attempt's end and outcome."""

    def __init__(self, name: str, total: dict[str, float], rng: random.Random) -> None:
        self.name = name
        self.total = total
        self.rng = rng
        self.tasks: dict[tuple[str, int], dict[str, float]] = {}  # (job, replica): demand
        self.ends: dict[str, tuple[int, bool]] = {}  # job: (tick its attempt ends, succeeds)

    def start(self, job: Job, tick: int) -> None:
        for replica in range(job.replicas):
            assert (job.job_id, replica) not in self.tasks, f"{job.job_id} started twice"
            self.tasks[(job.job_id, replica)] = dict(job.per_replica)
        duration = self.rng.randint(1, 12)
        fails = self.rng.random() < FAILURE_RATE
        self.ends[job.job_id] = (
            tick + (self.rng.randint(1, duration) if fails else duration),
            not fails,
        )

    def stop(self, job: Job) -> None:
        for replica in range(job.replicas):
            del self.tasks[(job.job_id, replica)]
        del self.ends[job.job_id]

    def step(self, tick: int) -> list[tuple[str, bool]]:
        """Attempts that end at this tick, with whether they succeeded."""
        done = [(job, ok) for job, (end, ok) in self.ends.items() if end <= tick]
        for job, _ in done:
            for key in [key for key in self.tasks if key[0] == job]:
                del self.tasks[key]
            del self.ends[job]
        return done

    def used(self) -> dict[str, float]:
        used: dict[str, float] = {}
        for demand in self.tasks.values():
            for kind, amount in demand.items():
                used[kind] = used.get(kind, 0.0) + amount
        return used

    def free(self) -> dict[str, float]:
        used = self.used()
        return {kind: amount - used.get(kind, 0.0) for kind, amount in self.total.items()}


def make_jobs(rng: random.Random) -> list[Job]:
    jobs = []
    for sequence in range(1, JOBS + 1):
        priority = rng.choices(list(Priority), weights=(5, 20, 75))[0]
        region = rng.choices(["", "us", "eu"], weights=(70, 20, 10))[0]
        shape = rng.random()
        if shape < 0.80:
            per_replica = {"cpu": float(rng.choice((1, 2, 4, 8)))}
            replicas = rng.randint(1, 4)
        elif shape < 0.875:
            per_replica = {"cpu": float(rng.randint(1, 4)), "h100": float(rng.choice((1, 2, 4)))}
            replicas = rng.randint(1, 2)
            region = rng.choice(("", "us"))
        elif shape < 0.95:
            per_replica = {"cpu": float(rng.randint(1, 2)), "tpu-v5e": float(rng.choice((1, 4, 8)))}
            replicas = rng.randint(1, 2)
            region = rng.choice(("", "eu"))
        else:  # some no cluster can ever run
            per_replica, replicas, region = rng.choice(
                (
                    ({"cpu": 1.0, "mi300": 1.0}, 1, ""),  # a device no cluster has
                    ({"cpu": 8.0}, 40, ""),  # 320 cpus: more than any one cluster
                    ({"cpu": 1.0, "h100": 8.0}, 3, ""),  # 24 h100: a has 16, never split
                    ({"cpu": 1.0}, 1, "ap"),  # a region none is in
                    ({"cpu": 1.0, "h100": 1.0}, 1, "eu"),  # h100 exists, but not in eu
                    ({"cpu": 100.0, "h100": 1.0}, 1, ""),  # cpus and h100 on different clusters
                )
            )
        arrival = 1 + (sequence - 1) * ARRIVAL_TICKS // JOBS
        jobs.append(
            Job(
                f"j{sequence:05d}",
                sequence,
                priority,
                per_replica,
                replicas,
                region,
                arrival,
                max_retries=rng.randint(0, 2),
            )
        )
    return jobs


def simulate(seed: int, report_every: int) -> dict[str, int]:
    """Run the federation to the end, asserting the invariants at every tick; return counts."""
    rng = random.Random(seed)
    jobs = make_jobs(rng)
    by_id = {job.job_id: job for job in jobs}
    engines = {name: Engine(name, total, rng) for name, (total, _) in CLUSTERS.items()}
    ledger = CapacityLedger()
    pending: dict[str, PendingJob] = {}
    running: dict[str, RunningJob] = {}
    arrivals = iter(jobs)
    upcoming = next(arrivals, None)
    counts = {"ticks": 0, "preemptions": 0, "failures": 0, "assignments": 0}
    unfinished = len(jobs)

    def requeue(job: Job) -> None:
        job.state, job.cluster = "pending", ""
        running.pop(job.job_id)
        pending[job.job_id] = PendingJob(
            job.job_id, job.priority, job.sequence, job.demand, job.region
        )

    for tick in range(1, MAX_TICKS + 1):
        counts["ticks"] = tick
        while upcoming is not None and upcoming.arrival <= tick:
            upcoming.state = "pending"
            pending[upcoming.job_id] = PendingJob(
                upcoming.job_id,
                upcoming.priority,
                upcoming.sequence,
                upcoming.demand,
                upcoming.region,
            )
            upcoming = next(arrivals, None)

        for engine in engines.values():
            for job_id, succeeded in engine.step(tick):
                job = by_id[job_id]
                if succeeded:
                    job.state = "succeeded"
                    running.pop(job_id)
                    unfinished -= 1
                    continue
                job.failures += 1
                counts["failures"] += 1
                if job.failures > job.max_retries:
                    job.state = "failed"
                    running.pop(job_id)
                    unfinished -= 1
                else:
                    requeue(job)

        for index, (name, engine) in enumerate(engines.items()):
            if tick == 1 or (tick + index) % report_every == 0:
                ledger.report(name, engine.free(), tick)

        views = [
            ClusterView(name, total, ledger.free(name), region)
            for name, (total, region) in CLUSTERS.items()
        ]
        decision = schedule(list(pending.values()), list(running.values()), views)

        for job_id, cluster in decision.assignments:
            job = by_id[job_id]
            assert job.state == "pending", f"tick {tick}: {job_id} assigned while {job.state}"
            del pending[job_id]
            engines[cluster].start(job, tick)
            ledger.reserve(job_id, cluster, job.demand, tick)
            job.state, job.cluster = "running", cluster
            job.attempts += 1
            running[job_id] = RunningJob(job_id, cluster, job.priority, job.sequence, job.demand)
            counts["assignments"] += 1
        check_invariants(tick, engines, by_id)

        for job_id in decision.preemptions:
            job = by_id[job_id]
            assert job.state == "running" and job.priority == Priority.BATCH, job_id
            engines[job.cluster].stop(job)
            job.preemptions += 1
            counts["preemptions"] += 1
            requeue(job)
        for job_id, reason in decision.rejections.items():
            job = by_id[job_id]
            del pending[job_id]
            job.state, job.reason = "rejected", reason
            unfinished -= 1

        if unfinished == 0:
            break
    else:
        pytest.fail(f"{unfinished} jobs still unfinished after {MAX_TICKS} ticks")

    for job in jobs:
        if job.satisfiable():
            assert job.state in ("succeeded", "failed"), (job.job_id, job.state, job.reason)
            if job.state == "failed":
                assert job.failures == job.max_retries + 1, job
            else:
                assert job.failures <= job.max_retries, job
        else:
            assert job.state == "rejected", (job.job_id, job.state)
            assert job.reason and job.attempts == 0, job
    return counts


def check_invariants(tick: int, engines: dict[str, Engine], jobs: dict[str, Job]) -> None:
    where: dict[str, str] = {}
    for name, engine in engines.items():
        used = engine.used()
        for kind, amount in used.items():
            assert amount <= engine.total.get(kind, 0.0) + EPSILON, (
                f"tick {tick}: cluster {name} runs {amount:g} {kind}, "
                f"its total is {engine.total.get(kind, 0.0):g}"
            )
        for job_id, _ in engine.tasks:
            other = where.setdefault(job_id, name)
            assert other == name, f"tick {tick}: {job_id} has replicas on {other} and {name}"
            assert jobs[job_id].state == "running" and jobs[job_id].cluster == name


@pytest.mark.parametrize("report_every", [1, 3, 7])
@pytest.mark.parametrize("seed", [11, 12])
def test_federation_never_over_assigns_and_finishes_every_runnable_job(seed, report_every):
    counts = simulate(seed, report_every)
    # The run exercised what it claims to: retries, preemptions, and full load for a while.
    assert counts["failures"] > 0 and counts["preemptions"] > 0
    assert counts["assignments"] > JOBS * 0.9
