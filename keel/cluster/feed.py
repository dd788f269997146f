"""What the controller reads of the state database: once at start, then only what is new.

Job commands in other processes write to SQLite directly: new jobs (`state.submit`), and
cancellations and cancel requests (`state.request_cancel`, each with its event). The controller
writes everything else itself and keeps it in memory, so after one snapshot at start (every
active job and attempt) a tick reads only the jobs submitted since its last read (by submission
number) and the events since (by id): never the specs, or the ids, of the whole queue. Each job's
spec is parsed once, here, with its place in the queue (keel.cluster.launch.JobInfo).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import Any

from keel.cluster import state
from keel.cluster.launch import JobInfo, key
from keel.cluster.scheduler import PendingJob, job_shape
from keel.cluster.spec import JobSpec

ACTIVE = state.ACTIVE_ATTEMPT_STATES
ACTIVE_JOB_STATES = ("pending", "running", "preempted")
# What the controller keeps of a job (not its spec: that is parsed into a JobInfo).
JOB_COLUMNS = "id, state, cluster, outcome, cancel_requested, failures, preemptions"
JOB_KEYS = tuple(JOB_COLUMNS.split(", "))
# What the controller keeps of an attempt.
ATTEMPT_COLUMNS = "job_id, replica, attempt, cluster, handle, state, reason"
ATTEMPT_KEYS = tuple(ATTEMPT_COLUMNS.split(", "))
MAX_SHAPES = 10_000  # distinct (resources, replicas, region, cluster) remembered


@dataclass
class News:
    """What a read found. `jobs` are (row with JOB_KEYS, parsed job), active ones only, in
    submission order. At the first read (`first`) they are every active job, and `attempts`
    (by key) and `latest` (job -> replica -> attempt, the same dicts) are every active attempt
    and the latest attempt of each replica of the running and preempted jobs; later reads
    carry the jobs submitted since and the ids of jobs cancelled, or asked to stop, since."""

    first: bool
    jobs: list[tuple[dict[str, Any], JobInfo]] = field(default_factory=list)
    attempts: dict[tuple[str, int, int], dict[str, Any]] = field(default_factory=dict)
    latest: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    cancel_requested: list[str] = field(default_factory=list)
    # Queued jobs that have attempts already (requeued): at the first read, the ones among
    # `jobs`; later, none (a job submitted since has no attempts).
    tried: set[str] = field(default_factory=set)


class JobFeed:
    """Reads the state database incrementally: a snapshot first, then what is new."""

    def __init__(self, database: sqlite3.Connection) -> None:
        self.database = database
        self.seen_seq = -1  # jobs up to this submission number have been read
        self.seen_event = 0  # events up to this id have been read
        self.shapes = Shapes()

    def read(self) -> News:
        if self.seen_seq < 0:
            return self._snapshot()
        database = self.database
        rows = (
            _tuples(database)
            .execute(
                f"SELECT {JOB_COLUMNS}, seq, spec FROM jobs WHERE seq > ? ORDER BY seq",
                (self.seen_seq,),
            )
            .fetchall()
        )
        if rows:
            self.seen_seq = rows[-1][len(JOB_KEYS)]
        last, cancelled, cancel_requests = database.execute(  # one statement
            "SELECT max(id), group_concat(CASE WHEN kind = 'cancelled' THEN job_id END, ' '), "
            "group_concat(CASE WHEN kind = 'cancel requested' THEN job_id END, ' ') "
            "FROM events WHERE id > ?",
            (self.seen_event,),
        ).fetchone()
        self.seen_event = last or self.seen_event
        return News(
            first=False,
            jobs=_parsed(rows, self.shapes),
            cancelled=(cancelled or "").split(),
            cancel_requested=(cancel_requests or "").split(),
        )

    def _snapshot(self) -> News:
        database = self.database
        news = News(first=True)
        with state.transaction(database):  # one snapshot for the reads
            rows = (
                _tuples(database)
                .execute(
                    f"SELECT {JOB_COLUMNS}, seq, spec FROM jobs "
                    f"WHERE state IN {ACTIVE_JOB_STATES!r} ORDER BY seq"
                )
                .fetchall()
            )
            attempts = database.execute(
                f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE state IN {ACTIVE!r} OR job_id IN "
                "(SELECT id FROM jobs WHERE state IN ('running', 'preempted')) "
                "ORDER BY job_id, replica, attempt"
            ).fetchall()
            tried = database.execute(
                "SELECT DISTINCT a.job_id FROM jobs j JOIN attempts a ON a.job_id = j.id "
                "WHERE j.state = 'pending'"
            ).fetchall()
            self.seen_seq = database.execute("SELECT coalesce(max(seq), 0) FROM jobs").fetchone()[0]
            self.seen_event = database.execute(
                "SELECT coalesce(max(id), 0) FROM events"
            ).fetchone()[0]
        news.jobs = _parsed(rows, self.shapes)
        news.tried = {row[0] for row in tried}
        running = {row["id"] for row, _ in news.jobs if row["state"] != "pending"}
        for row in attempts:  # in attempt order: the latest comes last
            attempt = dict(zip(ATTEMPT_KEYS, row, strict=True))
            if attempt["state"] in ACTIVE:
                news.attempts[key(attempt)] = attempt
            if attempt["job_id"] in running:
                news.latest.setdefault(attempt["job_id"], {})[attempt["replica"]] = attempt
        return news


class Shapes:
    """Demand and shape (keel.cluster.scheduler.PendingJob) by what they depend on, made once
    and shared by the queued jobs alike (most of a queue is a few shapes): a job's entry costs
    no dicts or tuples of its own."""

    def __init__(self) -> None:
        self._known: dict[tuple, tuple[dict[str, float], tuple]] = {}

    def of(self, spec: JobSpec) -> tuple[dict[str, float], tuple]:
        resources = spec.resources
        what = (
            resources.cpus,
            resources.device_type,
            resources.device_count,
            spec.replicas,
            spec.region,
            spec.cluster,
        )
        known = self._known.get(what)
        if known is None:
            if len(self._known) >= MAX_SHAPES:  # bounded: forget them all, they are remade
                self._known.clear()
            demand = spec.demand()
            known = self._known[what] = (demand, job_shape(demand, spec.region, spec.cluster))
        return known


def _tuples(database: sqlite3.Connection) -> sqlite3.Cursor:
    """A cursor whose rows are plain tuples (a sqlite3.Row costs more to make than it saves)."""
    cursor = database.cursor()
    cursor.row_factory = None
    return cursor


def _parsed(rows: list[tuple], shapes: Shapes) -> list[tuple[dict[str, Any], JobInfo]]:
    """The active jobs among `rows` (JOB_COLUMNS, seq, spec), each spec parsed once."""
    width = len(JOB_KEYS)
    jobs = []
    decode = state.decode_stored_spec
    for row in rows:
        if row[1] not in ACTIVE_JOB_STATES:
            continue  # ended already (cancelled before the controller saw it)
        spec = decode(row[width + 1])
        demand, shape = shapes.of(spec)
        pending = PendingJob(
            row[0], spec.priority, row[width], demand, spec.region, spec.cluster, shape
        )
        # zip stops after JOB_KEYS: the row's seq and spec follow them (no slice made)
        jobs.append((dict(zip(JOB_KEYS, row, strict=False)), JobInfo(spec, pending)))
    return jobs
