"""The controller: a tick that reconciles, reports capacity, schedules and autoscales.

    controller = Controller(root, {"local": LocalBackend(root / "tasks")})
    job_id = submit(controller.database, JobSpec(("python", "train.py")))
    controller.tick()          # or controller.run() until stopped

One tick:
1. read: the jobs submitted and cancelled since the last tick (keel.cluster.feed).
2. poll: every active attempt on its backend; then, every `report_every` ticks (and on the first
   after a start), each backend's capacity (taken after the poll: what ended is free in it).
3. one write transaction: the handles of the last tick's launches; the attempts' news; jobs moved
   on (a gang whose replicas all succeeded succeeds; a failed or lost replica stops the rest of
   its gang, then keel.cluster.outcome decides: retry, requeue, fail with the reason; a cancel
   request stops the gang); the capacity reports into the reservation ledger
   (keel.cluster.ledger) and the tick number; the scheduling round (keel.cluster.scheduler over
   pending jobs, running jobs and the ledger's view): its attempts recorded (state "launching")
   before any backend is asked, preemptions and rejections with their reasons.
4. after the commit: stopped gangs cancelled, the round launched, preempted work cancelled.
5. autoscale: backends with `scale_to` (the local pool) are sized to the work running and queued.
6. logs: new task output goes to the telemetry namespace cluster.task_log when configured.
All state is in SQLite (keel.cluster.state), so a controller killed at any point resumes: it
re-polls the attempts it had, adopts the ones still running and never launches one twice. Job
specs never change, so each is parsed once and kept with its demand, and the pending queue is kept
in memory (keel.cluster.pending): loaded once at start, then updated as jobs are assigned,
rejected or requeued here, and from the jobs table's new rows and the events table's new
cancellations for what other processes submit or cancel. So are the running jobs, their
replicas' latest attempts and the active attempts: only this controller writes those rows (one
controller per root, keel.cluster.lock); the one thing another process changes on them, a
cancel request, arrives as a "cancel requested" event. Memory is updated with the database, in
the same transaction, and nothing is launched or cancelled before that commits. The scheduler's
views of the running jobs are kept the same way (remade where a job starts or starts stopping).

Memory: a controller is a long-lived process with a big, stable heap (~100,000 objects at 10,000
queued jobs), so once its state is loaded it freezes that heap and collects the young generation
every 50,000 allocations instead of 700 (keel.cluster.heap): at 10,000 queued jobs the default
collector cost ~1-2 ms of a median tick and ~5 ms on average, with a full collection every few
dozen ticks (measured with gc.callbacks over the tick benchmark; docs/benchmarks.md).

Durability: one commit a tick. The state database runs in WAL mode with synchronous=NORMAL
(keel.cluster.state): a commit survives the controller's process being killed at any point; a
power loss or OS crash may roll back the last commits (not fsynced; not promised). A launched
attempt's handle is written in the next tick's transaction: a controller killed before then
finds the attempt without one on restart and launches it again, which its backend answers with
the task it already started (as it does for a controller killed mid-launch). Assignment takes
each job inside the transaction only if it is still pending (one UPDATE ... AND state =
'pending' RETURNING the ids taken; keel.cluster.launch), so no job starts twice.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.cluster import heap, state
from keel.cluster.backend import Capacity, ScaleGroup, TaskBackend, TaskState
from keel.cluster.capacity import take_capacities, write_capacities
from keel.cluster.checkpoint import BACKSTOP_PAGES, Checkpointer
from keel.cluster.feed import MAX_SHAPES, JobFeed
from keel.cluster.launch import KEY, UNSTARTED, JobInfo, Launcher, key, record_assignments
from keel.cluster.ledger import CapacityLedger
from keel.cluster.logs import LogStreamer
from keel.cluster.outcome import gang_outcome, resolve
from keel.cluster.pending import PendingQueue
from keel.cluster.scheduler import (
    ClusterView,
    Decision,
    RunningJob,
    schedule,
    shape_key,
)
from keel.cluster.spec import JobSpec
from keel.core.errors import KeelError

logger = logging.getLogger(__name__)
FINAL_ATTEMPT_STATES = {TaskState.SUCCEEDED, TaskState.FAILED, TaskState.LOST, TaskState.CANCELLED}
ACTIVE = state.ACTIVE_ATTEMPT_STATES


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
        # Checkpoints run from a thread of their own, not inside a tick's commit.
        self.database.execute(f"PRAGMA wal_autocheckpoint = {BACKSTOP_PAGES}")
        self.checkpointer = Checkpointer(self.root / "state.db")
        self.ledger = CapacityLedger()
        self.ticks = int(state.get_value(self.database, "tick", "0"))
        self._first_tick = self.ticks + 1
        self._jobs: dict[str, JobInfo] = {}  # active jobs (pending, running, preempted)
        # What the controller alone writes, kept in memory so a tick reads none of it back:
        # the active jobs' rows (JOB_COLUMNS; cancel_requested also follows other processes'
        # "cancel requested" events), the running and preempted ones among them, the latest
        # attempt of each of their replicas, and every active attempt (the same dicts).
        self._rows: dict[str, dict[str, Any]] = {}
        self._running: dict[str, dict[str, Any]] = {}
        self._latest: dict[str, dict[int, dict[str, Any]]] = {}
        self._attempts: dict[tuple[str, int, int], dict[str, Any]] = {}
        self._queue = PendingQueue()  # the pending ones, as the scheduler sees them
        self._running_views: dict[str, RunningJob] = {}  # running jobs as the scheduler sees them
        self._stopping: set[str] = set()  # running jobs being stopped (their views say so)
        self._now = 0.0  # the time of the current tick's transaction
        self._ends: list[tuple] = []  # job transitions and events of the current transaction
        self._events: list[tuple] = []
        self._requeued: list[str] = []  # jobs back in the queue once the transaction commits
        self._reasons: dict[str, str] = {}  # queued jobs' own waiting reasons, as written
        self._shape_reasons: dict[tuple, str] = {}  # the waiting table's, as written
        self._untried: set[str] = set()  # queued jobs submitted since the start: no attempts yet
        self._totals: dict[str, dict[str, float]] = {}
        # Jobs that left a cluster since its last capacity report: their capacity is coming back
        # (the scheduler counts it when planning preemptions, never when assigning).
        self._leaving: dict[str, list[RunningJob]] = {name: [] for name in self.backends}
        self._reporting: set[str] = set()  # clusters whose capacity this tick's report holds
        self.feed = JobFeed(self.database)
        self.logs = LogStreamer(self.database, self.backends, telemetry)
        self.launcher = Launcher(self.database, self.backends, str(self.root / "tasks"))

    # -- the tick ------------------------------------------------------------------------------

    def tick(self) -> TickReport:
        began = time.perf_counter()
        self.ticks += 1
        report = TickReport(self.ticks)
        self._load_new()
        changes = self._poll()
        capacities = self._capacity_reports()
        self._reporting = set(capacities)
        # One write transaction a tick for what the backends said and what the round decided;
        # nothing is launched or cancelled before it commits.
        self._now = time.time()  # when the jobs that end this tick ended
        with state.transaction(self.database):
            self.launcher.write_handles()  # the last tick's launches, before their news
            report.finished, to_cancel = self._reconcile(changes)
            self._apply_capacities(capacities)
            launches, preempted = self._schedule(report)
        self.checkpointer.committed(self.database)
        for cluster, active in to_cancel:
            self._cancel(cluster, active)
        self._launch(launches)
        for cluster, active in preempted:
            self._cancel(cluster, active)
        self._autoscale()
        self.logs.stream()
        report.seconds = time.perf_counter() - began
        return report

    def run(self, *, tick_seconds: float = 0.5, stop_when_idle: float | None = None) -> bool:
        """Tick until `stop()` is called from another thread, the stop flag is set in the
        database (`keel cluster stop`), or nothing was active for `stop_when_idle` seconds;
        return True in the last case. The caller holds the root's lock (keel.cluster.lock)."""
        state.set_value(self.database, "stop", "0")
        idle_since = time.monotonic()
        while state.get_value(self.database, "stop") != "1":
            self.tick()
            if self.active_jobs():
                idle_since = time.monotonic()
            elif stop_when_idle is not None and time.monotonic() - idle_since >= stop_when_idle:
                return True
            time.sleep(tick_seconds)
        return False

    def stop(self) -> None:
        state.set_value(self.database, "stop", "1")

    def active_jobs(self) -> int:
        """The jobs pending, running or preempted as of the last tick (kept in memory: the jobs
        table has no index on state to count them by)."""
        return len(self._jobs)

    def close(self) -> None:
        self.launcher.flush()
        self.checkpointer.close()
        for backend in self.backends.values():
            backend.close()
        self.database.close()

    # -- reconcile -----------------------------------------------------------------------------

    def _poll(self) -> list[tuple]:
        """Ask the backends about every active attempt (launching again those recorded before
        a crash whose launch was never confirmed); return the attempts' changes as rows for
        `UPDATE attempts`: (state, exit code, reason, ended at, *key)."""
        by_cluster: dict[str, list[Any]] = {}
        unlaunched = []
        for attempt in self._attempts.values():
            if attempt["handle"] is None:
                unlaunched.append(attempt)
                continue
            rows = by_cluster.get(attempt["cluster"])
            if rows is None:
                rows = by_cluster[attempt["cluster"]] = []
            rows.append(attempt)
        for attempt in unlaunched:
            self._relaunch(attempt)
            if attempt["handle"] is not None and self._attempts.get(key(attempt)) is attempt:
                # polled too: a backend counts what it adopted
                by_cluster.setdefault(attempt["cluster"], []).append(attempt)
        changes = []
        now = time.time()
        for cluster, rows in by_cluster.items():
            backend = self.backends.get(cluster)
            if backend is None:
                reason = f"cluster {cluster} is not configured any more"
                changes += [("lost", None, reason, now, *key(row)) for row in rows]
                continue
            handles = [row["handle"] for row in rows]
            try:
                statuses = backend.poll(handles)
            except KeelError as error:  # the engine is unreachable: its tasks are not lost
                logger.warning("cluster %s did not answer this tick: %s", cluster, error)
                continue
            get = statuses.get
            for row, handle in zip(rows, handles, strict=True):
                status = get(handle)
                if status is None:
                    continue
                new_state = status.state
                if new_state == row["state"]:  # a StrEnum: compares as str (most: no news)
                    continue
                ended = now if new_state in FINAL_ATTEMPT_STATES else None
                changes.append(
                    (
                        new_state.value,
                        status.exit_code,
                        status.reason,
                        ended,
                        row["job_id"],
                        row["replica"],
                        row["attempt"],
                    )
                )
        return changes

    def _reconcile(self, changes: list[tuple]) -> tuple[int, list[tuple[str, list]]]:
        """Record the attempts' `changes` and move their jobs on, inside the tick's transaction;
        return how many jobs ended and the attempts to cancel once it commits."""
        changed = dict.fromkeys(change[4] for change in changes)  # job ids, in poll order
        jobs = self._jobs_to_reconcile(None if self.ticks == self._first_tick else changed)
        if changes:
            self.database.executemany(
                "UPDATE attempts SET state = ?, exit_code = ?, reason = ?, ended_at = ? "
                f"WHERE {KEY}",
                changes,
            )
        attempts = self._attempts
        for new_state, _, reason, _, job_id, replica, number in changes:
            attempt = attempts[job_id, replica, number]
            attempt["state"], attempt["reason"] = new_state, reason or ""
            if new_state not in ACTIVE:
                del attempts[job_id, replica, number]
        finished, to_cancel = self._reconcile_jobs(jobs)
        self._requeue()
        return finished, to_cancel

    def _jobs_to_reconcile(self, changed: dict[str, None] | None) -> list[dict[str, Any]]:
        """The jobs that may move on: those whose attempts changed this tick (all of them when
        `changed` is None: the first tick after a start), then those being stopped (an outcome,
        a cancel request, a preemption), each once: looked up, not found among the ~1,000
        running."""
        running = self._running
        if changed is None:
            return list(running.values())
        moving = changed | dict.fromkeys(sorted(self._stopping))
        return [running[job_id] for job_id in moving if job_id in running]

    def _reconcile_jobs(self, jobs: list[dict[str, Any]]) -> tuple[int, list[tuple[str, list]]]:
        """Move `jobs` on from their latest attempts, inside the caller's transaction; return
        how many ended and the attempts to cancel once it commits."""
        finished = 0
        to_cancel: list[tuple[str, list[dict]]] = []
        if jobs:
            latest = self._latest
            for job in jobs:
                replicas = latest.get(job["id"])
                tasks = list(replicas.values()) if replicas else []
                outcome = job["outcome"]
                running = job["state"] == "running" and not outcome
                if running and tasks and all(t["state"] == "succeeded" for t in tasks):
                    self._end(job, "succeeded", "")  # most jobs that move on: no list made
                    finished += 1
                    continue
                active = [t for t in tasks if t["state"] in ACTIVE]
                if running:
                    outcome = gang_outcome(tasks, bool(job["cancel_requested"]))
                    if outcome:
                        self.database.execute(
                            "UPDATE jobs SET outcome = ? WHERE id = ?", (outcome, job["id"])
                        )
                        job["outcome"] = outcome
                        self._set_view(job["id"])
                        to_cancel.append((job["cluster"], active))
                if active:
                    continue
                if job["state"] == "preempted":
                    outcome = outcome or "preempted: for production work"
                if outcome:
                    spec = self._jobs[job["id"]].spec
                    result = resolve(outcome, spec, job["failures"], job["preemptions"])
                    self._end(job, result.state, result.reason, result.failures, result.preemptions)
                    finished += result.state != "pending"
            self._write_ends()
        return finished, to_cancel

    def _end(
        self,
        job: Any,
        final: str,
        reason: str,
        failures: int | None = None,
        preemptions: int | None = None,
    ) -> None:
        """Move a job out of its cluster: to a final state, or back to the queue ("pending").
        Written by `_write_ends`, batched, inside the caller's transaction."""
        now, job_id, cluster = self._now, job["id"], job["cluster"]
        failures = job["failures"] if failures is None else failures
        preemptions = job["preemptions"] if preemptions is None else preemptions
        requeued = final == "pending"
        self._ends.append(
            (
                final,
                reason,
                None if requeued else cluster,
                None if requeued else now,
                failures,
                preemptions,
                job_id,
            )
        )
        if final != "succeeded":  # a success is its job's row (state.job_events reads it)
            self._events.append((now, job_id, "requeued" if requeued else final, reason))
        if self._running.pop(job_id, None) is not None:  # it ran (or was being stopped)
            self._running_views.pop(job_id, None)
            self._stopping.discard(job_id)
            self._latest.pop(job_id, None)
        else:  # it was queued (a rejection)
            self._queue.remove(job_id)
            self._reasons.pop(job_id, None)
            self._untried.discard(job_id)
        if requeued:
            row = self._rows[job_id]
            row["state"], row["outcome"], row["cluster"] = final, "", None
            row["failures"], row["preemptions"] = failures, preemptions
            self._requeued.append(job_id)
            info = self._jobs.get(job_id)
        else:
            self._rows.pop(job_id, None)
            info = self._jobs.pop(job_id, None)
        # A cluster reported after this tick's poll has the capacity of what ended already.
        if info is not None and cluster in self._leaving and cluster not in self._reporting:
            self._leaving[cluster].append(
                RunningJob(
                    job_id,
                    cluster,
                    info.spec.priority,
                    info.pending.sequence,
                    info.pending.demand,
                    stopping=True,
                )
            )

    def _write_ends(self) -> None:
        """Write what `_end` recorded: one UPDATE per kind of end (most are successes, alike),
        and the events."""
        groups: dict[tuple, list[str]] = {}
        for end in self._ends:
            groups.setdefault(end[:-1], []).append(end[-1])
        for values, ids in groups.items():
            state.rows_for_ids(
                self.database,
                "UPDATE jobs SET state = ?, reason = ?, outcome = '', cluster = ?, ended_at = ?, "
                "failures = ?, preemptions = ? WHERE id IN ({ids})",
                ids,
                parameters=values,
            )
        self.database.executemany(
            "INSERT INTO events (at, job_id, kind, detail) VALUES (?, ?, ?, ?)", self._events
        )
        self._ends, self._events = [], []

    def _requeue(self) -> None:
        """Put the jobs `_end` sent back to the queue into it (their transaction committed)."""
        for job_id in self._requeued:
            self._queue.add(self._jobs[job_id].pending)
        self._requeued = []

    def _cancel(self, cluster: str, attempts: list) -> None:
        backend = self.backends.get(cluster)
        for attempt in attempts:
            if backend is not None and attempt["handle"] is not None:
                backend.cancel(attempt["handle"])

    # -- capacity, scheduling, autoscaling -----------------------------------------------------

    def _capacity_reports(self) -> dict[str, Capacity]:
        """Every `report_every` ticks (and on the first after a start) each backend's capacity
        (keel.cluster.capacity), taken after the poll: what ended by then is free in it."""
        if self.ticks != self._first_tick and self.ticks % self.report_every:
            return {}
        return take_capacities(self.backends)

    def _apply_capacities(self, capacities: dict[str, Capacity]) -> None:
        """Put the reports into the ledger (after reconciling: the jobs that ended then are
        not leaving any more, their capacity is in the report) and write them with the tick
        number, inside the tick's transaction."""
        for name, capacity in capacities.items():
            self.ledger.report(name, capacity.free, self.ticks)
            self._leaving[name] = []
            self._totals[name] = dict(capacity.total)
        if capacities:
            write_capacities(self.database, capacities, self.backends, self.regions, self.ticks)
        state.set_value(self.database, "tick", str(self.ticks))

    def _load_new(self) -> None:
        """Take in what job commands wrote since the last call (keel.cluster.feed): new jobs,
        queued or (at start) running with their attempts; cancellations, which leave the queue;
        cancel requests, which the next reconcile acts on."""
        news = self.feed.read()
        if news.first:
            self._attempts, self._latest = news.attempts, news.latest
        for job_id in news.cancel_requested:
            if job_id in self._running:
                self._running[job_id]["cancel_requested"] = 1
                self._set_view(job_id)
        for row, info in news.jobs:
            job_id = row["id"]
            self._jobs[job_id] = info
            self._rows[job_id] = row
            if row["state"] == "pending":
                self._queue.add(info.pending)
                if job_id not in news.tried:
                    self._untried.add(job_id)
            else:
                self._running[job_id] = row
                self._set_view(job_id)
        for job_id in news.cancelled:
            if job_id in self._queue:
                self._queue.remove(job_id)
                self._jobs.pop(job_id, None)
                self._rows.pop(job_id, None)
                self._reasons.pop(job_id, None)
                self._untried.discard(job_id)
        if news.first:  # the state is loaded: what is alive now stays (keel.cluster.heap)
            heap.settle()

    def _schedule(
        self, report: TickReport
    ) -> tuple[list[tuple[dict[str, Any], JobSpec]], list[tuple[str, list]]]:
        """Decide the round (when jobs are queued) and write it, inside the tick's transaction;
        return the attempts to launch and the preempted attempts to cancel once it commits."""
        if not self._queue:
            return [], []
        # Every running job, as the scheduler sees it (kept up to date by `_set_view`), and the
        # jobs that left a cluster since its last report.
        stopping = [job for jobs in self._leaving.values() for job in jobs]
        stopping += self._running_views.values()
        clusters = [
            ClusterView(
                name, self._totals.get(name, {}), self.ledger.free(name), self.regions.get(name, "")
            )
            for name in self.backends
        ]
        decision = schedule(
            self._queue.ordered(),
            stopping,
            clusters,
            self.home,
            in_order=True,
            shape_count=self._queue.shapes,
        )
        cancels: list[tuple[str, list]] = []
        for job_id, reason in decision.rejections.items():
            self._end(self._rows[job_id], "failed", f"rejected: {reason}")
            report.rejected += 1
        for job_id in decision.preemptions:
            outcome = "preempted: for production work"
            self.database.execute(
                "UPDATE jobs SET state = 'preempted', outcome = ? WHERE id = ?",
                (outcome, job_id),
            )
            state.event(self.database, job_id, "preempted")
            job = self._running[job_id]
            job.update(state="preempted", outcome=outcome)
            self._set_view(job_id)
            active = [t for t in self._latest.get(job_id, {}).values() if t["state"] in ACTIVE]
            cancels.append((job["cluster"], active))
            report.preempted += 1
        launches = self._record_assignments(decision.assignments)
        report.launched += len(decision.assignments)
        self._write_reasons(decision)
        self._write_ends()
        self._requeue()
        return launches, cancels

    def _write_reasons(self, decision: Decision) -> None:
        """Write why the queued jobs wait, where it changed: the jobs the round looked at, one
        by one; the tail of the queue it left waiting as a whole, by shape (the waiting table,
        keel.cluster.state), so a tick writes no row for the ~250 jobs that joined the tail."""
        reasons = self._reasons
        changed = [(r, j) for j, r in decision.waiting.items() if reasons.get(j) != r]
        by_reason: dict[str, list[str]] = {}
        for reason, job_id in changed:
            by_reason.setdefault(reason, []).append(job_id)
            reasons[job_id] = reason
        for reason, ids in by_reason.items():
            state.rows_for_ids(
                self.database,
                "UPDATE jobs SET reason = ? WHERE id IN ({ids})",
                ids,
                parameters=(reason,),
            )
        shapes = self._shape_reasons
        blocked = [(s, r) for s, r in decision.blocked.items() if shapes.get(s) != r]
        if blocked:
            self.database.executemany(
                "INSERT INTO waiting (shape, reason) VALUES (?, ?) "
                "ON CONFLICT (shape) DO UPDATE SET reason = excluded.reason",
                [(shape_key(shape), reason) for shape, reason in blocked],
            )
            if len(shapes) >= MAX_SHAPES:  # bounded: forget them all, the next round rewrites
                shapes.clear()
            shapes.update(blocked)

    def _launch(self, launches: list[tuple[dict[str, Any], JobSpec]]) -> None:
        """Launch recorded attempts (the dicts kept in memory, which the launcher updates);
        a refused launch gives its job an outcome and cancels its unstarted replicas, here as
        in the database."""
        refused = self.launcher.launch(launches)
        for job_id, outcome in refused.items():
            if job_id in self._running:
                self._running[job_id]["outcome"] = outcome
                self._set_view(job_id)
            for task in self._latest.get(job_id, {}).values():
                if task["state"] == "launching" and task["handle"] is None:
                    task["state"], task["reason"] = "cancelled", UNSTARTED
        for attempt, _ in launches:
            if attempt["state"] not in ACTIVE:
                self._attempts.pop(key(attempt), None)

    def _record_assignments(self, assignments: list[tuple[str, str]]) -> list[tuple[Any, JobSpec]]:
        launches, taken = record_assignments(self.database, assignments, self._jobs, self._untried)
        untried, queue = self._untried, self._queue
        for job_id, _ in assignments:  # taken, or no longer pending: out of the queue either way
            untried.discard(job_id)
            queue.remove(job_id)
        attempts, latest = self._attempts, self._latest
        for attempt, _ in launches:
            job_id, replica = attempt["job_id"], attempt["replica"]
            attempts[job_id, replica, attempt["attempt"]] = attempt
            replicas = latest.get(job_id)
            if replicas is None:
                replicas = latest[job_id] = {}
            replicas[replica] = attempt
        if len(taken) < len(assignments):
            gone = {job_id for job_id, _ in assignments} - {job_id for job_id, _ in taken}
            logger.warning("jobs %s were no longer pending when assigned", sorted(gone))
            for job_id in gone:  # cancelled meanwhile: nothing more to do for them
                self._jobs.pop(job_id, None)
                self._rows.pop(job_id, None)
                self._reasons.pop(job_id, None)
        jobs, rows, running, reasons = self._jobs, self._rows, self._running, self._reasons
        reserve, tick = self.ledger.reserve, self.ticks
        for job_id, cluster in taken:
            reserve(job_id, cluster, jobs[job_id].pending.demand, tick)
            job = running[job_id] = rows[job_id]
            job["state"], job["cluster"], job["outcome"] = "running", cluster, ""
            reasons.pop(job_id, None)
            self._set_view(job_id)
        return launches

    def _set_view(self, job_id: str) -> None:
        """Make the scheduler's view of a running job again from its row (it started, or it
        is being stopped: an outcome, a cancel request, a preemption)."""
        row, pending = self._running[job_id], self._jobs[job_id].pending
        leaving = row["state"] == "preempted" or bool(row["outcome"] or row["cancel_requested"])
        self._running_views[job_id] = RunningJob(
            job_id, row["cluster"], pending.priority, pending.sequence, pending.demand, leaving
        )
        if leaving:
            self._stopping.add(job_id)
        else:
            self._stopping.discard(job_id)

    def _relaunch(self, attempt: Any) -> None:
        """An attempt recorded before a crash, whose launch was never confirmed: launch it again
        (a backend adopts a task it already started), unless its job has moved on."""
        job = self._running.get(attempt["job_id"])
        if job is not None and job["state"] == "running" and not job["outcome"]:
            self._launch([(attempt, self._jobs[job["id"]].spec)])
        else:
            self.launcher.abandon(attempt)
            self._attempts.pop(key(attempt), None)

    def _autoscale(self) -> None:
        """Size each scale group (the local pool) to the cpus of its work and of the queue."""
        queued: float | None = None
        for name, backend in self.backends.items():
            if not isinstance(backend, ScaleGroup):
                continue
            if queued is None:
                queued = sum(job.demand.get("cpu", 0.0) for job in self._queue.ordered())
            wanted = queued + sum(
                self._jobs[row["id"]].pending.demand.get("cpu", 0.0)
                for row in self._running.values()
                if row["cluster"] == name
            )
            before = getattr(backend, "cpus", None)
            after = backend.scale_to(wanted)
            if before is not None and after != before:
                with state.transaction(self.database):
                    state.event(
                        self.database, None, "scaled", f"{name}: {before:g} -> {after:g} cpus"
                    )
