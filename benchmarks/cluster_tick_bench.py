"""Controller.tick() latency with 10,000 queued jobs and 1,000 busy workers.

What it measures: the wall time of one `Controller.tick()` (keel/cluster/controller.py: reconcile,
capacity report, schedule, autoscale, log streaming) in steady state: every worker slot busy,
--queued jobs waiting, a few hundred tasks ending and as many starting per tick. Target: <= 15 ms.

How:
- The engine is `MemoryBackend`, defined here: an in-memory TaskBackend with a number of cpu
  slots. `launch` takes a slot and returns a handle (a slot is never handed out twice: an
  over-commit is counted and reported), `poll` says running until the task's random duration
  (2..6 ticks of the benchmark's clock) has passed, then succeeded; `capacity` reports the free
  slots. --workers slots are split over --clusters clusters (default 2 x 500 cpus).
- --queued one-cpu jobs are submitted with keel.cluster.state.submit into a fresh state database
  (in a temporary directory), then the controller ticks: --warmup ticks (the first launches
  every slot at once) are not measured, then --ticks ticks are. After each tick, outside the
  timing, the queue is topped up with new jobs back to --queued, so every measured tick sees the
  same load.
- Reported: median, p95 and max tick wall time (TickReport.seconds), the median cpu time of this
  process per tick (it does not grow when other processes share the machine), and a per-phase
  breakdown (the controller's steps, the pure scheduler call and the launches inside
  `_schedule`, the per-job reconcile inside `_reconcile`), measured by wrapping those methods,
  and the garbage collector's time per tick (gc.callbacks). The controller sets the process's
  collector up itself once its state is loaded (keel/cluster/heap.py), as in production.
  When the median exceeds the target (or with --profile) a cProfile of --profile-ticks further
  ticks is printed: the functions with the most own time, then keel.cluster's by total time.

    python benchmarks/cluster_tick_bench.py [--queued 10000] [--workers 1000] [--ticks 40]
    python benchmarks/cluster_tick_bench.py --smoke   # a tiny run (seconds): does it still work?
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import heapq
import io
import platform
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.cluster import controller as controller_module
from keel.cluster import state
from keel.cluster.backend import Capacity, TaskLaunch, TaskState, TaskStatus
from keel.cluster.controller import Controller
from keel.cluster.spec import JobSpec, Resources

TARGET_MS = 15.0
SEED = 20240807
PHASES = (
    "_load_new",
    "_poll",
    "_capacity_reports",
    "_reconcile",
    "_schedule",
    "_launch",
    "_autoscale",
)
# Parts of a phase, timed the same way: (the phase, the object's path from the controller, the
# method inside it): "" is the controller itself, "launcher" its Launcher (keel/cluster/launch.py).
PARTS = (("_reconcile", "", "_reconcile_jobs"), ("_launch", "launcher", "launch"))
PHASE_ROWS = (
    "_load_new",
    "_poll",
    "_capacity_reports",
    "_reconcile",
    "  _reconcile_jobs (jobs' states from their attempts)",
    "_schedule",
    "  schedule() (the pure decision)",
    "_launch",
    "  launcher.launch (backend launches, handles recorded)",
    "_autoscale",
    "logs.stream",
    "rest (the transaction's BEGIN and COMMIT, the tick's glue)",
)
REST = PHASE_ROWS[-1]


@dataclass
class Clock:
    """The benchmark's tick counter, shared by the backends (a task's duration is in ticks)."""

    now: int = 0


@dataclass
class Task:
    cpus: float
    ends: int  # clock tick at which it has succeeded
    cancelled: bool = False


class MemoryBackend:
    """A TaskBackend over `cpus` in-memory slots; tasks succeed after 2..6 ticks."""

    name = "memory"

    def __init__(self, cluster: str, cpus: float, clock: Clock, rng: random.Random) -> None:
        self.cluster = cluster
        self.cpus = cpus
        self.clock = clock
        self.rng = rng
        self.tasks: dict[str, Task] = {}  # every task ever launched: poll answers for all
        self.ending: list[tuple[int, str]] = []  # heap of (end tick, handle) of busy tasks
        self.busy: set[str] = set()
        self.used = 0.0
        self.overcommits = 0

    def _expire(self) -> None:
        """Give back the slots of tasks that have ended by now."""
        while self.ending and self.ending[0][0] <= self.clock.now:
            _, handle = heapq.heappop(self.ending)
            if handle in self.busy:
                self.busy.remove(handle)
                self.used -= self.tasks[handle].cpus

    def launch(self, task: TaskLaunch) -> str:
        handle = f"{self.cluster}/{task.task_id}/{task.attempt}"
        if handle in self.tasks:  # a relaunch after a restart adopts the task
            return handle
        self._expire()
        if self.used + task.cpus > self.cpus + 1e-9:
            self.overcommits += 1
        ends = self.clock.now + self.rng.randint(2, 6)
        self.tasks[handle] = Task(task.cpus, ends)
        heapq.heappush(self.ending, (ends, handle))
        self.busy.add(handle)
        self.used += task.cpus
        return handle

    def poll(self, handles: list[str]) -> dict[str, TaskStatus]:
        statuses = {}
        for handle in handles:
            task = self.tasks.get(handle)
            if task is None:
                statuses[handle] = TaskStatus(handle, TaskState.LOST, reason="unknown handle")
            elif task.cancelled:
                statuses[handle] = TaskStatus(handle, TaskState.CANCELLED)
            elif task.ends <= self.clock.now:
                statuses[handle] = TaskStatus(handle, TaskState.SUCCEEDED, exit_code=0)
            else:
                statuses[handle] = TaskStatus(handle, TaskState.RUNNING)
        return statuses

    def cancel(self, handle: str) -> None:
        self._expire()
        if handle in self.busy:  # a task that already ended stays succeeded
            self.tasks[handle].cancelled = True
            self.busy.remove(handle)
            self.used -= self.tasks[handle].cpus

    def log_files(self, handle: str) -> tuple[str, str]:
        return (f"/nonexistent/{handle}.out", f"/nonexistent/{handle}.err")

    def capacity(self) -> Capacity:
        self._expire()
        return Capacity(total={"cpu": self.cpus}, free={"cpu": self.cpus - self.used})

    def close(self) -> None:
        self.tasks.clear()


class PhaseTimer:
    """Wraps the controller's steps (and the pure scheduler) to add up, per tick, their wall
    time and this process's cpu time (the cpu time does not grow when the machine is shared)."""

    def __init__(self, control: Controller) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        for phase in PHASES:
            setattr(control, phase, self._timed(phase, getattr(control, phase)))
        for _, path, part in PARTS:
            owner = getattr(control, path) if path else control
            label = f"{path}.{part}" if path else part
            row = next(row for row in PHASE_ROWS if row.startswith(f"  {label} "))
            setattr(owner, part, self._timed(row, getattr(owner, part)))
        control.logs.stream = self._timed("logs.stream", control.logs.stream)
        decision = next(row for row in PHASE_ROWS if row.startswith("  schedule() "))
        controller_module.schedule = self._timed(decision, controller_module.schedule)

    def _timed(self, phase: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.wall[phase] += time.perf_counter() - wall
                self.cpu[phase] += time.process_time() - cpu

        return timed

    def take(self) -> dict[str, tuple[float, float]]:
        """{phase: (wall seconds, cpu seconds)} since the last take."""
        taken = {phase: (self.wall[phase], self.cpu[phase]) for phase in self.wall}
        self.wall.clear()
        self.cpu.clear()
        return taken


class CollectorTimer:
    """Adds up the garbage collector's wall time (and counts its collections) while on."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0
        self.collections = 0
        self._began = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began
            self.collections += 1

    def take(self) -> float:
        """Seconds collecting since the last take."""
        taken, self.seconds = self.seconds, 0.0
        return taken


def top_up(control: Controller, queued: int, spec: JobSpec) -> int:
    """Submit jobs until `queued` are pending; return how many were submitted."""
    pending = control.database.execute("SELECT count(*) FROM jobs WHERE state = 'pending'")
    missing = max(0, queued - pending.fetchone()[0])
    for _ in range(missing):
        state.submit(control.database, spec)
    return missing


def count(control: Controller, job_state: str) -> int:
    query = "SELECT count(*) FROM jobs WHERE state = ?"
    return control.database.execute(query, (job_state,)).fetchone()[0]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queued", type=int, default=10_000, help="pending jobs kept queued")
    parser.add_argument("--workers", type=int, default=1_000, help="cpu slots in all")
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=8, help="ticks before measuring")
    parser.add_argument("--ticks", type=int, default=40, help="ticks measured")
    parser.add_argument("--report-every", type=int, default=1, help="capacity report period")
    parser.add_argument("--profile", action="store_true", help="profile even when on target")
    parser.add_argument("--profile-ticks", type=int, default=5)
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny configuration, seconds: the script works"
    )
    args = parser.parse_args()
    if args.smoke:
        args.queued, args.workers, args.warmup, args.ticks, args.profile_ticks = 200, 20, 2, 3, 1

    rng = random.Random(SEED)
    clock = Clock()
    per_cluster = args.workers / args.clusters
    backends = {
        f"c{n}": MemoryBackend(f"c{n}", per_cluster, clock, rng) for n in range(args.clusters)
    }
    spec = JobSpec(("true",), resources=Resources(cpus=1.0))
    with tempfile.TemporaryDirectory(prefix="keel-tick-bench-") as root:
        control = Controller(Path(root), backends, report_every=args.report_every)
        began = time.perf_counter()
        top_up(control, args.queued, spec)
        submit_seconds = time.perf_counter() - began
        timer = PhaseTimer(control)
        for _ in range(args.warmup):
            clock.now += 1
            control.tick()
            top_up(control, args.queued, spec)
        timer.take()
        collector = CollectorTimer()
        collecting: list[float] = []  # the collector's seconds per measured tick
        ticks: list[float] = []
        cpu: list[float] = []  # this process's cpu time per tick: the machine may be shared
        phases: dict[str, list[tuple[float, float]]] = defaultdict(list)
        launched: list[int] = []
        for _ in range(args.ticks):
            clock.now += 1
            cpu_began = time.process_time()
            collector.on = True
            report = control.tick()
            collector.on = False
            cpu.append(time.process_time() - cpu_began)
            collecting.append(collector.take())
            ticks.append(report.seconds)
            launched.append(report.launched)
            taken = timer.take()
            for phase, seconds in taken.items():
                phases[phase].append(seconds)
            top = [taken.get(phase, (0.0, 0.0)) for phase in (*PHASES, "logs.stream")]
            rest_wall = report.seconds - sum(wall for wall, _ in top)
            phases[REST].append((rest_wall, cpu[-1] - sum(used for _, used in top)))
            top_up(control, args.queued, spec)
        running, pending = count(control, "running"), count(control, "pending")
        median_ms = statistics.median(ticks) * 1e3
        print_results(
            args, ticks, cpu, phases, launched, running, pending, submit_seconds, backends
        )
        print(
            f"Garbage collection during the measured ticks: {collector.collections} collections, "
            f"median {statistics.median(collecting) * 1e3:.1f} ms, mean "
            f"{statistics.mean(collecting) * 1e3:.1f} ms a tick (threshold {gc.get_threshold()})."
        )
        if args.profile or (median_ms > TARGET_MS and not args.smoke):
            print_profile(control, clock, args, spec)
        control.close()


def print_results(
    args: argparse.Namespace,
    ticks: list[float],
    cpu: list[float],
    phases: dict[str, list[tuple[float, float]]],
    launched: list[int],
    running: int,
    pending: int,
    submit_seconds: float,
    backends: dict[str, MemoryBackend],
) -> None:
    median_ms = statistics.median(ticks) * 1e3
    verdict = "on target" if median_ms <= TARGET_MS else "OVER TARGET"
    print(
        f"# Controller.tick() latency ({platform.python_implementation()} {sys.version.split()[0]})"
    )
    print()
    print(
        f"{args.queued} jobs queued, {args.workers} cpu slots on {args.clusters} clusters, "
        f"report every {args.report_every} tick(s); {len(ticks)} ticks measured after "
        f"{args.warmup} warm-up ticks; submitting the first {args.queued} jobs took "
        f"{submit_seconds:.1f} s."
    )
    print()
    print(
        "| median ms | p95 ms | max ms | median cpu ms | target ms "
        "| launches per tick (median) | verdict |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|")
    print(
        f"| {median_ms:.1f} | {percentile(ticks, 0.95) * 1e3:.1f} | {max(ticks) * 1e3:.1f} "
        f"| {statistics.median(cpu) * 1e3:.1f} | {TARGET_MS:.0f} "
        f"| {statistics.median(launched):.0f} | {verdict} |"
    )
    print()
    print("Per phase (indented rows are parts of the phase above them; medians over ticks):")
    print()
    cpu_ms = statistics.median(cpu) * 1e3
    print("| phase | median ms | median cpu ms | share of the median tick's cpu |")
    print("|---|---:|---:|---:|")
    for phase in PHASE_ROWS:
        values = phases.get(phase, [(0.0, 0.0)])
        phase_ms = statistics.median(wall for wall, _ in values) * 1e3
        phase_cpu_ms = statistics.median(used for _, used in values) * 1e3
        print(f"| {phase} | {phase_ms:.1f} | {phase_cpu_ms:.1f} | {phase_cpu_ms / cpu_ms:.0%} |")
    print()
    overcommits = sum(backend.overcommits for backend in backends.values())
    print(
        f"After the run: {running} jobs running, {pending} pending; "
        f"slot over-commits seen by the backends: {overcommits}."
    )


def print_profile(
    control: Controller, clock: Clock, args: argparse.Namespace, spec: JobSpec
) -> None:
    profile = cProfile.Profile()
    for _ in range(args.profile_ticks):
        clock.now += 1
        profile.enable()
        control.tick()
        profile.disable()
        top_up(control, args.queued, spec)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(18)
    stats.sort_stats("cumulative").print_stats(r"keel/cluster", 25)
    print()
    print(
        f"cProfile over {args.profile_ticks} more ticks: most own time first, then the "
        "keel.cluster functions by time including their callees:"
    )
    print()
    print("```")
    print(text.getvalue().strip())
    print("```")


if __name__ == "__main__":
    main()
