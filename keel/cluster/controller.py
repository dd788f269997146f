"""The controller: a tick that reconciles, reports capacity, schedules and autoscales.

    controller = Controller(root, {"local": LocalBackend(root / "tasks")})
    job_id = submit(controller.database, JobSpec(("python", "train.py")))
    controller.tick()          # or controller.run() until stopped

One tick:
1. reconcile: poll every active attempt on its backend; a gang whose replicas all succeeded
   succeeds; a failed or lost replica stops the rest of its gang, then the job is retried (failures
   up to max_retries, lost workers and preemptions up to max_preemptions) or fails with the reason;
   a cancel request stops the gang and the job ends cancelled.
2. capacity: every `report_every` ticks (and on the first tick after a start) each backend reports
   its free capacity into the reservation ledger (keel.cluster.ledger).
3. schedule: keel.cluster.scheduler.schedule over pending jobs, running jobs and the ledger's view;
   assignments are recorded (attempt rows first) and launched, preemptions cancelled, rejections
   failed with their reason, waiting jobs keep theirs.
4. autoscale: backends with `scale_to` (the local pool) are sized to the work running and queued.
5. logs: new lines of task stdout/stderr go to the telemetry namespace cluster.task_log when a
   telemetry target is configured (the files stay either way).
All state is in SQLite (keel.cluster.state), so a controller killed at any point resumes: it
re-polls the attempts it had, adopts the ones still running and never launches one twice.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from keel.cluster import state
from keel.cluster.backend import TaskBackend, TaskLaunch, TaskState
from keel.cluster.ledger import CapacityLedger
from keel.cluster.logs import LogStreamer
from keel.cluster.scheduler import ClusterView, PendingJob, RunningJob, schedule
from keel.cluster.spec import JobSpec
from keel.core.errors import KeelError, UsageError

logger = logging.getLogger(__name__)
FINAL_ATTEMPT_STATES = {TaskState.SUCCEEDED, TaskState.FAILED, TaskState.LOST, TaskState.CANCELLED}


@dataclass
class TickReport:
    tick: int
    launched: int = 0
    preempted: int = 0
    rejected: int = 0
    finished: int = 0
    seconds: float = 0.0


class Controller:
    """Jobs over named clusters, each a TaskBackend; `home` is preferred when a job fits there."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        backends: Mapping[str, TaskBackend],
        *,
        regions: Mapping[str, str] | None = None,
        report_every: int = 1,
        home: str | None = None,
        telemetry: str = "",
    ) -> None:
        self.root = Path(root).resolve()
        self.backends = dict(backends)
        self.regions = dict(regions or {})
        self.report_every = max(1, report_every)
        self.home = home if home is not None else next(iter(self.backends), None)
        self.database = state.connect(self.root / "state.db")
        self.ledger = CapacityLedger()
        self.ticks = int(state.get_value(self.database, "tick", "0"))
        self._started_tick = self.ticks + 1
        self._specs: dict[str, JobSpec] = {}
        self._totals: dict[str, dict[str, float]] = {}
        self.logs = LogStreamer(self.database, self.backends, telemetry)

    # -- the tick ------------------------------------------------------------------------------

    def tick(self) -> TickReport:
        began = time.perf_counter()
        self.ticks += 1
        report = TickReport(self.ticks)
        report.finished = self._reconcile()
        if self.ticks == self._started_tick or self.ticks % self.report_every == 0:
            self._report_capacity()
        self._schedule(report)
        self._autoscale()
        self.logs.stream()
        state.set_value(self.database, "tick", str(self.ticks))
        report.seconds = time.perf_counter() - began
        return report

    def run(self, *, tick_seconds: float = 0.5, stop_when_idle: float | None = None) -> None:
        """Tick until `stop()` is called from another thread, the stop flag is set in the
        database (`keel cluster stop`), or nothing was active for `stop_when_idle` seconds."""
        state.set_value(self.database, "stop", "0")
        idle_since = time.monotonic()
        while state.get_value(self.database, "stop") != "1":
            self.tick()
            if self.active_jobs():
                idle_since = time.monotonic()
            elif stop_when_idle is not None and time.monotonic() - idle_since >= stop_when_idle:
                return
            time.sleep(tick_seconds)

    def stop(self) -> None:
        state.set_value(self.database, "stop", "1")

    def active_jobs(self) -> int:
        query = "SELECT count(*) FROM jobs WHERE state IN ('pending', 'running', 'preempted')"
        return self.database.execute(query).fetchone()[0]

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.database.close()

    # -- reconcile -----------------------------------------------------------------------------

    def _reconcile(self) -> int:
        """Bring attempts and jobs up to date with the backends; return jobs that ended."""
        attempts = self.database.execute(
            "SELECT * FROM attempts WHERE state IN ('launching', 'pending', 'running')"
        ).fetchall()
        by_cluster: dict[str, list[Any]] = {}
        for attempt in attempts:
            if attempt["handle"] is None:
                # Recorded, then the controller died before the backend answered: launch it
                # again (a backend adopts a task it already started), unless the job moved on.
                owner = state.job(self.database, attempt["job_id"])
                if owner["state"] == "running" and not owner["outcome"]:
                    self._launch_attempt(attempt)
                else:
                    self._end_attempt(attempt, TaskState.CANCELLED, None, "not started")
                continue
            by_cluster.setdefault(attempt["cluster"], []).append(attempt)
        for cluster, rows in by_cluster.items():
            backend = self.backends.get(cluster)
            if backend is None:
                for row in rows:
                    self._end_attempt(row, TaskState.LOST, None, f"cluster {cluster} is gone")
                continue
            try:
                statuses = backend.poll([row["handle"] for row in rows])
            except KeelError as error:  # the engine is unreachable: its tasks are not lost
                logger.warning("cluster %s did not answer this tick: %s", cluster, error)
                continue
            for row in rows:
                status = statuses.get(row["handle"])
                if status is None:
                    continue
                if status.state in FINAL_ATTEMPT_STATES:
                    self._end_attempt(row, status.state, status.exit_code, status.reason)
                elif status.state.value != row["state"]:
                    self.database.execute(
                        "UPDATE attempts SET state = ? "
                        "WHERE job_id = ? AND replica = ? AND attempt = ?",
                        (status.state.value, row["job_id"], row["replica"], row["attempt"]),
                    )
        finished = 0
        for job in self.database.execute(
            "SELECT * FROM jobs WHERE state IN ('running', 'preempted')"
        ).fetchall():
            finished += self._reconcile_job(job)
        return finished

    def _end_attempt(
        self, row: Any, outcome: TaskState, exit_code: int | None, reason: str
    ) -> None:
        self.database.execute(
            "UPDATE attempts SET state = ?, exit_code = ?, reason = ?, ended_at = ? "
            "WHERE job_id = ? AND replica = ? AND attempt = ?",
            (
                outcome.value,
                exit_code,
                reason,
                time.time(),
                row["job_id"],
                row["replica"],
                row["attempt"],
            ),
        )

    def _reconcile_job(self, job: Any) -> int:
        tasks = self.database.execute(
            "SELECT * FROM tasks WHERE job_id = ? ORDER BY replica", (job["id"],)
        ).fetchall()
        active = [t for t in tasks if t["state"] in state.ACTIVE_ATTEMPT_STATES]
        outcome = job["outcome"]
        if job["state"] == "running" and not outcome:
            broken = next((t for t in tasks if t["state"] in ("failed", "lost", "cancelled")), None)
            if not active and broken is None:
                self._finish(job, "succeeded", "")
                return 1
            if broken is not None:
                kind = "lost" if broken["state"] in ("lost", "cancelled") else "failed"
                outcome = (
                    f"{kind}: replica {broken['replica']}: {broken['reason'] or broken['state']}"
                )
            elif job["cancel_requested"]:
                outcome = "cancelled: on request"
            if outcome:
                self.database.execute(
                    "UPDATE jobs SET outcome = ? WHERE id = ?", (outcome, job["id"])
                )
                self._cancel_attempts(job["cluster"], active)
        if active:
            return 0
        if job["state"] == "preempted":
            outcome = outcome or "preempted: for production work"
        if not outcome:
            return 0
        return self._resolve(job, outcome)

    def _resolve(self, job: Any, outcome: str) -> int:
        """The gang has stopped: retry, requeue or end the job, by why it stopped."""
        kind, _, reason = outcome.partition(": ")
        spec = self._spec(job)
        if kind == "cancelled":
            self._finish(job, "cancelled", reason)
            return 1
        if kind == "refused":  # the engine cannot run it as asked: retrying cannot help
            self._finish(job, "failed", reason)
            return 1
        if kind in ("preempted", "lost"):
            count = job["preemptions"] + 1
            if count > spec.max_preemptions:
                self._finish(
                    job,
                    "failed",
                    f"{kind} {count} times (max_preemptions {spec.max_preemptions}): {reason}",
                    preemptions=count,
                )
                return 1
            self._requeue(job, f"requeued after being {kind}: {reason}", preemptions=count)
            return 0
        count = job["failures"] + 1
        if count > spec.max_retries:
            self._finish(job, "failed", reason, failures=count)
            return 1
        self._requeue(job, f"retry {count} of {spec.max_retries} after: {reason}", failures=count)
        return 0

    def _finish(self, job: Any, final: str, reason: str, **counts: int) -> None:
        columns = "".join(f", {name} = {int(value)}" for name, value in counts.items())
        self.database.execute(
            f"UPDATE jobs SET state = ?, reason = ?, outcome = '', ended_at = ?{columns} "
            "WHERE id = ?",
            (final, reason, time.time(), job["id"]),
        )
        state.event(self.database, job["id"], final, reason)

    def _requeue(self, job: Any, reason: str, **counts: int) -> None:
        columns = "".join(f", {name} = {int(value)}" for name, value in counts.items())
        self.database.execute(
            f"UPDATE jobs SET state = 'pending', cluster = NULL, reason = ?, outcome = ''{columns} "
            "WHERE id = ?",
            (reason, job["id"]),
        )
        state.event(self.database, job["id"], "requeued", reason)

    def _cancel_attempts(self, cluster: str, attempts: list[Any]) -> None:
        backend = self.backends.get(cluster)
        for attempt in attempts:
            if backend is not None and attempt["handle"] is not None:
                backend.cancel(attempt["handle"])

    # -- capacity, scheduling, autoscaling -----------------------------------------------------

    def _report_capacity(self) -> None:
        for name, backend in self.backends.items():
            try:
                capacity = backend.capacity()
            except KeelError as error:  # keep the last report; retry next time
                logger.warning("cluster %s reported no capacity: %s", name, error)
                continue
            self.ledger.report(name, capacity.free, self.ticks)
            self._totals[name] = dict(capacity.total)
            region = self.regions.get(name, capacity.region)
            self.database.execute(
                "INSERT INTO clusters "
                "(name, backend, region, total, free, reported_at, reported_tick) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
                "backend = excluded.backend, region = excluded.region, "
                "total = excluded.total, free = excluded.free, "
                "reported_at = excluded.reported_at, reported_tick = excluded.reported_tick",
                (
                    name,
                    backend.name,
                    region,
                    orjson.dumps(dict(capacity.total)).decode(),
                    orjson.dumps(dict(capacity.free)).decode(),
                    time.time(),
                    self.ticks,
                ),
            )
            self.database.execute(
                "DELETE FROM reservations WHERE cluster = ? AND tick < ?", (name, self.ticks)
            )

    def _schedule(self, report: TickReport) -> None:
        pending_rows = self.database.execute(
            "SELECT id, seq, priority, spec, reason FROM jobs WHERE state = 'pending'"
        ).fetchall()
        if not pending_rows:
            return
        running_rows = self.database.execute(
            "SELECT id, seq, priority, spec, cluster, state, outcome, cancel_requested FROM jobs "
            "WHERE state IN ('running', 'preempted')"
        ).fetchall()
        pending = [
            PendingJob(
                r["id"],
                self._spec(r).priority,
                r["seq"],
                self._spec(r).demand(),
                self._spec(r).region,
            )
            for r in pending_rows
        ]
        running = [
            RunningJob(
                r["id"],
                r["cluster"],
                self._spec(r).priority,
                r["seq"],
                self._spec(r).demand(),
                stopping=r["state"] == "preempted"
                or bool(r["outcome"])
                or bool(r["cancel_requested"]),
            )
            for r in running_rows
        ]
        clusters = [
            ClusterView(
                name, self._totals.get(name, {}), self.ledger.free(name), self._region(name)
            )
            for name in self.backends
        ]
        decision = schedule(pending, running, clusters, self.home)
        rows = {r["id"]: r for r in pending_rows}
        for job_id, reason in decision.rejections.items():
            self._finish(rows[job_id], "failed", f"rejected: {reason}")
            report.rejected += 1
        for job_id in decision.preemptions:
            self.database.execute(
                "UPDATE jobs SET state = 'preempted', outcome = 'preempted: for production work' "
                "WHERE id = ?",
                (job_id,),
            )
            state.event(self.database, job_id, "preempted")
            running_job = self.database.execute(
                "SELECT cluster FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            active = self.database.execute(
                "SELECT * FROM tasks WHERE job_id = ? "
                "AND state IN ('launching', 'pending', 'running')",
                (job_id,),
            ).fetchall()
            self._cancel_attempts(running_job["cluster"], active)
            report.preempted += 1
        for job_id, cluster in decision.assignments:
            self._assign(rows[job_id], cluster)
            report.launched += 1
        for job_id, reason in decision.waiting.items():
            if rows[job_id]["reason"] != reason:
                self.database.execute("UPDATE jobs SET reason = ? WHERE id = ?", (reason, job_id))

    def _assign(self, job: Any, cluster: str) -> None:
        spec = self._spec(job)
        with state.transaction(self.database):
            for replica in range(spec.replicas):
                previous = self.database.execute(
                    "SELECT coalesce(max(attempt), 0) FROM attempts "
                    "WHERE job_id = ? AND replica = ?",
                    (job["id"], replica),
                ).fetchone()[0]
                self.database.execute(
                    "INSERT INTO attempts (job_id, replica, attempt, cluster, state, started_at) "
                    "VALUES (?, ?, ?, ?, 'launching', ?)",
                    (job["id"], replica, previous + 1, cluster, time.time()),
                )
            self.database.execute(
                "UPDATE jobs SET state = 'running', cluster = ?, reason = '', started_at = ? "
                "WHERE id = ?",
                (cluster, time.time(), job["id"]),
            )
            self.database.execute(
                "INSERT OR REPLACE INTO reservations (job_id, cluster, demand, tick) "
                "VALUES (?, ?, ?, ?)",
                (job["id"], cluster, orjson.dumps(spec.demand()).decode(), self.ticks),
            )
            state.event(self.database, job["id"], "assigned", cluster)
        self.ledger.reserve(job["id"], cluster, spec.demand(), self.ticks)
        for attempt in self.database.execute(
            "SELECT * FROM tasks WHERE job_id = ? ORDER BY replica", (job["id"],)
        ).fetchall():
            if not self._launch_attempt(attempt):
                break

    def _launch_attempt(self, attempt: Any) -> bool:
        """Start (or adopt) a recorded attempt; on a refusal fail the whole job at once."""
        job = state.job(self.database, attempt["job_id"])
        spec = self._spec(job)
        backend = self.backends.get(attempt["cluster"])
        task = self._task(job, spec, attempt)
        try:
            if backend is None:
                raise UsageError(f"cluster {attempt['cluster']} is not configured any more")
            handle = backend.launch(task)
        except Exception as error:  # recorded as the job's outcome; the tick goes on
            logger.warning("launching %s failed: %s", task.task_id, error)
            reason = f"could not start replica {attempt['replica']}: {error}"
            self._end_attempt(attempt, TaskState.FAILED, None, reason)
            self.database.execute(
                "UPDATE attempts SET state = 'cancelled', ended_at = ?, "
                "reason = 'not started: a replica failed to start' "
                "WHERE job_id = ? AND state = 'launching' AND handle IS NULL",
                (time.time(), job["id"]),
            )
            kind = "refused" if isinstance(error, UsageError) else "failed"
            self.database.execute(
                "UPDATE jobs SET outcome = ? WHERE id = ?", (f"{kind}: {reason}", job["id"])
            )
            return False
        self.database.execute(
            "UPDATE attempts SET handle = ?, state = 'running' "
            "WHERE job_id = ? AND replica = ? AND attempt = ?",
            (handle, attempt["job_id"], attempt["replica"], attempt["attempt"]),
        )
        return True

    def _task(self, job: Any, spec: JobSpec, attempt: Any) -> TaskLaunch:
        task_id = f"{job['id']}.{attempt['replica']}"
        resources = spec.resources
        return TaskLaunch(
            task_id=task_id,
            attempt=attempt["attempt"],
            command=spec.command,
            env={
                **spec.env,
                "KEEL_JOB_ID": job["id"],
                "KEEL_REPLICA": str(attempt["replica"]),
                "KEEL_REPLICAS": str(spec.replicas),
            },
            cpus=resources.cpus,
            memory_mb=resources.memory_mb,
            device_type=resources.device_type,
            device_count=resources.device_count,
            log_dir=str(
                self.root / "tasks" / job["id"] / str(attempt["replica"]) / str(attempt["attempt"])
            ),
            workdir=spec.workdir,
        )

    def _autoscale(self) -> None:
        for name, backend in self.backends.items():
            scale_to = getattr(backend, "scale_to", None)
            if scale_to is None:
                continue
            wanted = 0.0
            for row in self.database.execute(
                "SELECT id, spec, cluster, state FROM jobs "
                "WHERE state IN ('pending', 'running', 'preempted')"
            ):
                if row["state"] == "pending" or row["cluster"] == name:
                    wanted += self._spec(row).demand().get("cpu", 0.0)
            before = self._totals.get(name, {}).get("cpu")
            after = scale_to(wanted)
            if before is not None and after != before:
                state.event(self.database, None, "scaled", f"{name}: {before:g} -> {after:g} cpus")

    def _spec(self, row: Any) -> JobSpec:
        """The job's spec, parsed once per controller (specs never change)."""
        job_id = row["id"]
        spec = self._specs.get(job_id)
        if spec is None:
            spec = state.decode_spec(row["spec"])
            self._specs[job_id] = spec
        return spec

    def _region(self, name: str) -> str:
        return self.regions.get(name, "")
