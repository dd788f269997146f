"""Run a DAG of steps: skip what is committed, run the rest in parallel, commit each atomically.

Independent steps run in threads, up to `max_parallel` at once (heavy work inside a step uses its
own processes: keel.flow's pool, JAX). Every step goes through the same path:

1. committed and not forced -> cached;
2. take its lock (or wait while a live runner holds it: when that runner commits, the step is
   cached here too; when it fails, the failure is reported here without a second attempt);
3. write a RUNNING attempt record, call `fn(config, staging)`, then commit staging as the output
   with a SUCCESS record, or record FAILED with the error and traceback.

A failed step fails its descendants, which are not run. The run as a whole goes on with every
step that does not depend on a failure.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from keel.core import paths
from keel.core.errors import UsageError
from keel.steps.context import running_step
from keel.steps.diff import StepDiff, committed_by_name, diff_step
from keel.steps.lock import LockSettings, StepLock
from keel.steps.record import Status, StepRecord, host_name, keel_version, utc_now
from keel.steps.step import Step, all_steps, resolve_config
from keel.steps.store import StepStore

logger = logging.getLogger(__name__)
Execute = Callable[[Step, Any, str], None]


class Outcome(StrEnum):
    EXECUTED = "executed"
    CACHED = "cached"
    FAILED = "failed"


@dataclass(frozen=True)
class PlannedStep:
    """What a run would do with one step: `action` is "cached" or "run"; `reason` says why.

    For a step to run, `diff` says what differs from its nearest cached output (keel.steps.diff);
    `reason` is then that diff in one line (`value: 1 -> 5`, `upstream changed: a`)."""

    step: Step
    output: str
    action: str
    reason: str
    diff: StepDiff | None = None


@dataclass
class RunReport:
    """Step names by outcome, plus one error line per failed step (keyed by `name-hash8`)."""

    executed: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> dict[str, list[str]]:
        """The `keel run --json` object."""
        return {"executed": self.executed, "cached": self.cached, "failed": self.failed}

    def add(self, step: Step, outcome: Outcome, output: str, error: str | None = None) -> None:
        getattr(self, outcome.value).append(step.name)
        self.outputs[step.name] = output
        if error is not None:
            self.errors[step.dir_name] = error


def plan(roots: list[Step], prefix: str, force: str | None = None) -> list[PlannedStep]:
    """The run's plan, dependencies first, without running or locking anything."""
    store = StepStore(prefix)
    forced = _force_pattern(force)
    ordered = all_steps(roots)
    names = {step.identity: step.name for step in ordered}
    cached = {step.identity for step in ordered if store.is_committed(step)}
    committed = committed_by_name(
        store, {step.name for step in ordered if step.identity not in cached}
    )
    planned = []
    for step in ordered:
        output = store.output(step)
        if forced is not None and forced.search(step.name):
            planned.append(PlannedStep(step, output, "run", "forced"))
        elif step.identity in cached:
            planned.append(PlannedStep(step, output, "cached", "output committed"))
        else:
            diff = diff_step(step, committed.get(step.name, []), names)
            attempt = store.attempt_record(step.dir_name)
            reason = diff.describe()
            if attempt and attempt.status is Status.FAILED:
                reason = "failed before" if diff.nearest is None else f"failed before; {reason}"
            planned.append(PlannedStep(step, output, "run", reason, diff))
    return planned


def run(
    roots: list[Step],
    prefix: str,
    *,
    force: str | None = None,
    max_parallel: int = 1,
    lock_settings: LockSettings | None = None,
    git_commit: str | None = None,
    execute: Execute | None = None,
    experiment: str | None = None,
) -> RunReport:
    """Run `roots` and their dependencies under `prefix`; see the module docstring.

    `execute(step, config, staging)` runs one step's function with its resolved config into its
    staging directory; by default in this process. keel/cluster passes one that runs it as a job
    (locks, caching and the commit stay here either way). `experiment` is the id of the
    experiment record the run is for: written into each attempt's record, not its identity."""
    if max_parallel < 1:
        raise UsageError(f"--max-parallel must be at least 1, got {max_parallel}")
    runner = _Runner(
        StepStore(prefix),
        _force_pattern(force),
        lock_settings or LockSettings(),
        git_commit,
        execute or _in_process,
        experiment,
    )
    return runner.run_all(all_steps(roots), max_parallel)


def _in_process(step: Step, config: Any, staging: str) -> None:
    step.fn(config, staging)


def _force_pattern(force: str | None) -> re.Pattern[str] | None:
    if force is None:
        return None
    try:
        return re.compile(force)
    except re.error as error:
        raise UsageError(f"--force {force!r} is not a valid regular expression: {error}") from None


class _Runner:
    def __init__(
        self,
        store: StepStore,
        forced: re.Pattern[str] | None,
        lock_settings: LockSettings,
        git_commit: str | None,
        execute: Execute,
        experiment: str | None = None,
    ) -> None:
        self.execute = execute
        self.experiment = experiment
        self.store = store
        self.forced = forced
        self.lock_settings = lock_settings
        self.git_commit = git_commit
        self.started = datetime.now().astimezone()

    def run_all(self, ordered: list[Step], max_parallel: int) -> RunReport:
        """Run `ordered` (dependencies first); the report lists steps in that order."""
        pending = {step.identity: step for step in ordered}
        results: dict[str, tuple[Outcome, str | None]] = {}
        running: dict[Future[tuple[Outcome, str | None]], Step] = {}
        with ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="keel-step") as pool:
            while pending or running:
                for step in list(pending.values()):
                    failed_upstream = [
                        dep.name
                        for dep in step.dependencies
                        if results.get(dep.identity, (None,))[0] is Outcome.FAILED
                    ]
                    if failed_upstream:
                        error = f"not run: upstream step {failed_upstream[0]} failed"
                        logger.error("%s: %s", step.name, error)
                        results[step.identity] = (Outcome.FAILED, error)
                        del pending[step.identity]
                    elif len(running) < max_parallel and all(
                        dep.identity in results for dep in step.dependencies
                    ):
                        running[pool.submit(self.run_one, step)] = step
                        del pending[step.identity]
                if running:
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in finished:
                        results[running.pop(future).identity] = future.result()
        report = RunReport()
        for step in ordered:
            outcome, error = results[step.identity]
            report.add(step, outcome, self.store.output(step), error)
        return report

    def run_one(self, step: Step) -> tuple[Outcome, str | None]:
        forced = self.forced is not None and self.forced.search(step.name) is not None
        if not forced and self.store.is_committed(step):
            logger.info("%s: cached at %s", step.name, self.store.output(step))
            return Outcome.CACHED, None
        lock = self.store.lock(step, self.lock_settings)
        waiting_since = datetime.now().astimezone()
        announced = False
        while not lock.try_acquire():
            if self._committed_for_us(step, forced):
                logger.info("%s: committed by another runner", step.name)
                return Outcome.CACHED, None
            attempt = self.store.attempt_record(step.dir_name)
            if attempt and attempt.status is Status.FAILED and attempt.ended_after(waiting_since):
                return Outcome.FAILED, f"failed in another runner: {attempt.error}"
            if not announced:
                holder = lock.holder()
                logger.info(
                    "%s: waiting for the runner that holds it (%s)",
                    step.name,
                    f"{holder.host} pid {holder.pid}" if holder else "starting",
                )
                announced = True
            time.sleep(self.lock_settings.poll_every)
        try:
            if self._committed_for_us(step, forced):
                return Outcome.CACHED, None
            return self._execute(step, lock)
        finally:
            lock.release()

    def _committed_for_us(self, step: Step, forced: bool) -> bool:
        """Committed, and (for a forced step) committed after this run began."""
        if not forced:
            return self.store.is_committed(step)
        record = self.store.output_record(step.dir_name)
        return record is not None and record.ended_after(self.started)

    def _execute(self, step: Step, lock: StepLock) -> tuple[Outcome, str | None]:
        attempt, staging = self.store.new_staging(step)
        record = self._record(step, attempt)
        self.store.write_attempt(step, record)
        logger.info("%s: running -> %s", step.name, record.output)
        began = time.monotonic()
        try:
            with running_step(record.output, self.store.work_dir(step)):
                self.execute(step, resolve_config(step.config, self.store.prefix), staging)
            lock.check_held()
            done = record.finished(Status.SUCCESS)
            self.store.commit(staging, done, step)
        except Exception as error:  # the step's own failure, recorded in full and reported
            message = f"{type(error).__name__}: {error}"
            self.store.write_attempt(
                step, record.finished(Status.FAILED, message, traceback.format_exc())
            )
            paths.remove_tree(staging)
            logger.error(
                "%s: FAILED after %.1f s: %s", step.name, time.monotonic() - began, message
            )
            return Outcome.FAILED, message
        self.store.write_attempt(step, done)
        logger.info("%s: done in %.1f s", step.name, time.monotonic() - began)
        return Outcome.EXECUTED, None

    def _record(self, step: Step, attempt: str) -> StepRecord:
        return StepRecord(
            name=step.name,
            identity=step.identity,
            status=Status.RUNNING,
            output=self.store.output(step),
            config=json.loads(step.canonical_config),
            dependencies=[
                {"name": dep.name, "identity": dep.identity, "output": self.store.output(dep)}
                for dep in step.dependencies
            ],
            version=step.version,
            attempt=attempt,
            host=host_name(),
            pid=os.getpid(),
            keel_version=keel_version(),
            git_commit=self.git_commit,
            start_time=utc_now(),
            experiment=self.experiment,
        )
