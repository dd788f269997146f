"""Starting the attempts a scheduling round decided: recorded first, then launched.

`record_assignments` writes a round's attempts (state "launching") and job states in a
few statements, inside the controller's transaction, before any backend is asked;
`Launcher.launch` then asks the backends; a refusal is recorded at once (a refused replica fails
its gang; its unstarted siblings are cancelled), the handles in the controller's next transaction
(a controller killed before that launches the attempts again on restart: backends adopt them).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Container, Mapping
from typing import Any, NamedTuple

from keel.cluster import state
from keel.cluster.backend import TaskBackend, TaskLaunch
from keel.cluster.scheduler import PendingJob
from keel.cluster.secrets import private_dir
from keel.cluster.spec import JobSpec
from keel.core import paths
from keel.core.errors import UsageError
from keel.core.gang import COORDINATOR, free_port

logger = logging.getLogger(__name__)
KEY = "job_id = ? AND replica = ? AND attempt = ?"
UNSTARTED = "not started: a replica failed to start"


class JobInfo(NamedTuple):
    """What never changes about a job, parsed once: its spec and its place in the queue (a
    named tuple: the controller makes ~250 a tick)."""

    spec: JobSpec
    pending: PendingJob


def key(attempt: Any) -> tuple[str, int, int]:
    return attempt["job_id"], attempt["replica"], attempt["attempt"]


def record_assignments(
    database: sqlite3.Connection,
    assignments: list[tuple[str, str]],
    jobs: Mapping[str, JobInfo],
    untried: Container[str] = (),
) -> tuple[list[tuple[dict[str, Any], JobSpec]], list[tuple[str, str]]]:
    """Write down the round's new attempts and job states (the caller
    holds the write transaction); return the attempts to launch with their specs, and the
    assignments that were taken (a job still pending when the transaction began). Jobs in
    `untried` have no attempts yet (their first is number 1 without asking the database).

    Each job is taken by an UPDATE that sets it running only if it is still pending, inside the
    transaction, and says which it took (RETURNING): one that is no longer pending (cancelled by
    a job command, or assigned by another controller) is left alone and gets no attempt, so no
    job is ever assigned twice."""
    if not assignments:
        return [], []
    now = time.time()
    by_cluster: dict[str, list[str]] = {}
    for job_id, cluster in assignments:
        by_cluster.setdefault(cluster, []).append(job_id)
    taken_ids: set[str] = set()
    for cluster, ids in by_cluster.items():
        taken_ids.update(
            row[0]
            for row in state.rows_for_ids(
                database,
                # "+state": find the ids by key; on state, SQLite would scan the whole queue
                "UPDATE jobs SET state = 'running', cluster = ?, reason = '', started_at = ? "
                "WHERE id IN ({ids}) AND +state = 'pending' RETURNING id",
                ids,
                parameters=(cluster, now),
            )
        )
    if len(taken_ids) < len(assignments):
        assignments = [(job_id, cluster) for job_id, cluster in assignments if job_id in taken_ids]
        if not assignments:
            return [], []
    tried = [job_id for job_id, _ in assignments if job_id not in untried]
    previous = {
        (job_id, replica): attempt
        for job_id, replica, attempt in state.rows_for_ids(
            database,
            "SELECT job_id, replica, max(attempt) FROM attempts "
            "WHERE job_id IN ({ids}) GROUP BY job_id, replica",
            tried,
        )
    }
    attempts, launches = [], []
    for job_id, cluster in assignments:
        spec = jobs[job_id].spec
        for replica in range(spec.replicas):
            number = previous.get((job_id, replica), 0) + 1 if previous else 1
            attempts.append((job_id, replica, number, cluster, now))
            attempt = {
                "job_id": job_id,
                "replica": replica,
                "attempt": number,
                "cluster": cluster,
                "handle": None,
                "state": "launching",
                "reason": "",
            }
            launches.append((attempt, spec))
    database.executemany(
        "INSERT INTO attempts (job_id, replica, attempt, cluster, state, started_at) "
        "VALUES (?, ?, ?, ?, 'launching', ?)",
        attempts,
    )
    # No "assigned" event: the attempts' rows say it (state.job_events reads them as one).
    return launches, assignments


def gang_coordinator(gang_dir: str) -> str:
    """KEEL_COORDINATOR of one gang attempt: `127.0.0.1:<a free port>`, chosen when its first
    replica is launched and kept in `<gang_dir>/coordinator`, so every replica of the attempt
    gets the same address (also one launched again by a restarted controller) and each attempt
    a fresh port. Backends whose replicas run on other hosts replace the host (Slurm: replica
    0's node, through the gang directory)."""
    path = f"{gang_dir}/coordinator"
    if os.path.exists(path):
        return paths.read_text(path).strip()
    private_dir(gang_dir)
    coordinator = f"127.0.0.1:{free_port()}"
    paths.write_text(path, coordinator + "\n")
    return coordinator


class Launcher:
    """Asks backends to start recorded attempts and records what they answer."""

    def __init__(
        self, database: sqlite3.Connection, backends: Mapping[str, TaskBackend], tasks_root: str
    ) -> None:
        self.database = database
        self.backends = backends
        self.tasks_root = tasks_root  # attempts' output: <tasks_root>/<job>/<replica>/<attempt>
        # Handles of started attempts not written yet: (handle, *key). The controller writes them
        # in its next transaction (`write_handles`); one killed before that launches those
        # attempts again on restart, and their backends answer with the tasks they started.
        self.unrecorded: list[tuple] = []

    def launch(self, attempts: list[tuple[dict[str, Any], JobSpec]]) -> dict[str, str]:
        """Start each attempt (dicts as `record_assignments` returns them, updated here as the
        database will be: "handle" and "state"); return the outcome of each job that a backend
        refused. A refusal is recorded at once, with the handles started so far (its job's
        unstarted replicas are cancelled in the database); other handles wait in `unrecorded`."""
        failed: set[str] = set()
        refusals: list[tuple[dict[str, Any], Exception]] = []
        backends, unrecorded, task = self.backends, self.unrecorded, self.task
        for attempt, spec in attempts:
            job_id = attempt["job_id"]
            if job_id in failed:
                continue
            backend = backends.get(attempt["cluster"])
            try:
                if backend is None:
                    raise UsageError(f"cluster {attempt['cluster']} is not configured any more")
                handle = backend.launch(task(spec, attempt))
            except Exception as error:  # recorded as the job's outcome; the tick goes on
                logger.warning("launching %s.%s failed: %s", job_id, attempt["replica"], error)
                refusals.append((attempt, error))
                failed.add(job_id)
                continue
            unrecorded.append((handle, job_id, attempt["replica"], attempt["attempt"]))
            attempt["handle"] = handle
            if attempt["state"] == "launching":
                attempt["state"] = "running"
        refused = {}
        if refusals:
            with state.transaction(self.database):
                self.write_handles()
                for attempt, error in refusals:
                    refused[attempt["job_id"]] = self._refuse(attempt, error)
        return refused

    def write_handles(self) -> None:
        """Record the started attempts' handles (inside the caller's transaction)."""
        if self.unrecorded:
            self.database.executemany(
                f"UPDATE attempts SET handle = ?, state = 'running' WHERE {KEY}", self.unrecorded
            )
            self.unrecorded = []

    def flush(self) -> None:
        """Record the handles still unrecorded, in a transaction of their own."""
        if self.unrecorded:
            with state.transaction(self.database):
                self.write_handles()

    def abandon(self, attempt: dict[str, Any]) -> None:
        """A recorded attempt that will not be started (its job moved on)."""
        with state.transaction(self.database):
            self.database.execute(
                "UPDATE attempts SET state = 'cancelled', reason = 'not started', ended_at = ? "
                f"WHERE {KEY}",
                (time.time(), *key(attempt)),
            )
        attempt["state"], attempt["reason"] = "cancelled", "not started"

    def task(self, spec: JobSpec, attempt: Any) -> TaskLaunch:
        """The TaskLaunch of one recorded attempt (built unchecked: ~250 a tick, from a spec
        validated when submitted)."""
        job_id, replica, number = attempt["job_id"], attempt["replica"], attempt["attempt"]
        resources = spec.resources
        gang_dir, gang_env = "", {}
        if spec.replicas > 1:  # a gang: its replicas find process 0 at one address per attempt
            gang_dir = f"{self.tasks_root}/{job_id}/gang/{number}"
            gang_env = {COORDINATOR: gang_coordinator(gang_dir)}
        return state.unchecked(
            TaskLaunch,
            {
                "task_id": f"{job_id}.{replica}",
                "attempt": number,
                "command": spec.command,
                "env": {
                    **spec.env,
                    "KEEL_JOB_ID": job_id,
                    "KEEL_REPLICA": str(replica),
                    "KEEL_REPLICAS": str(spec.replicas),
                    **gang_env,
                },
                "cpus": resources.cpus,
                "memory_mb": resources.memory_mb,
                "device_type": resources.device_type,
                "device_count": resources.device_count,
                "log_dir": f"{self.tasks_root}/{job_id}/{replica}/{number}",
                "workdir": spec.workdir,
                "gang_dir": gang_dir,
            },
        )

    def _refuse(self, attempt: dict[str, Any], error: Exception) -> str:
        """Record a refused launch (inside the caller's transaction): the attempt failed, its
        job's unstarted replicas cancelled, the job's outcome; return the outcome."""
        reason = f"could not start replica {attempt['replica']}: {error}"
        kind = "refused" if isinstance(error, UsageError) else "failed"
        outcome = f"{kind}: {reason}"
        self.database.execute(
            f"UPDATE attempts SET state = 'failed', reason = ?, ended_at = ? WHERE {KEY}",
            (reason, time.time(), *key(attempt)),
        )
        self.database.execute(
            "UPDATE attempts SET state = 'cancelled', ended_at = ?, "
            "reason = ? WHERE job_id = ? AND state = 'launching' AND handle IS NULL",
            (time.time(), UNSTARTED, attempt["job_id"]),
        )
        self.database.execute(
            "UPDATE jobs SET outcome = ? WHERE id = ?", (outcome, attempt["job_id"])
        )
        attempt["state"], attempt["reason"] = "failed", reason
        return outcome
