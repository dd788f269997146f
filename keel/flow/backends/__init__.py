"""Backends run a stage's tasks on workers: `local` (processes on this machine) or `ray`.

A backend takes a list of tasks and returns one TaskResult per task, in task order. Workers pull
the next task when they finish one (no static assignment). Tasks start in index order, and a
failed task is tried again before any task not yet started: a mark_later_copies task waits for
the earlier ones (keel/flow/later_copies.py), so an earlier task must never queue behind it. A
task that raises or whose worker dies is run again, up to `retries` more times; then the run
fails with TaskFailedError naming the task.
Errors that would repeat on every attempt (malformed input, a user function returning the wrong
type) fail at once.
"""

from __future__ import annotations

import logging
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import cloudpickle

from keel.core.errors import KeelError, UsageError
from keel.flow.ops import StageError
from keel.flow.readers import MalformedInputError
from keel.flow.tasks import Task, TaskResult

logger = logging.getLogger(__name__)

NOT_RETRIED = (MalformedInputError, StageError, UsageError)
"""Errors that are facts about the data or the pipeline: another attempt would fail the same way."""


class TaskFailedError(KeelError):
    """A task failed on every attempt (or with an error not worth retrying)."""


class Backend(Protocol):
    name: str
    workers: int

    def run(
        self,
        tasks: Sequence[Task],
        *,
        retries: int,
        on_done: Callable[[Task, TaskResult, int], None],
    ) -> list[TaskResult]:
        """Run every task; call on_done(task, result, attempts) as each succeeds."""
        ...

    def close(self) -> None: ...


def pickle_task(task: Task, attempt: int) -> bytes:
    """A task for a worker process, pickled by cloudpickle (lambdas and functions of experiment
    files included: those modules are registered for pickling by value)."""
    return cloudpickle.dumps((task, attempt))


def run_pickled_task(payload: bytes) -> tuple:
    """Unpickle and run a task from `pickle_task`; ("ok", result) or ("error", message, retryable).
    Both backends run this in their workers."""
    try:
        task, attempt = cloudpickle.loads(payload)
    except Exception as error:  # e.g. a function whose module this process cannot import
        return (
            "error",
            f"cannot load the task in a worker: {type(error).__name__}: {error}",
            False,
        )
    return run_task_safely(task, attempt)


def run_task_safely(task: Task, attempt: int) -> tuple:
    """Run a task in a worker: ("ok", result) or ("error", message, retryable)."""
    try:
        return ("ok", task.run(attempt))
    except NOT_RETRIED as error:
        return ("error", str(error), False)
    except Exception as error:
        logger.debug("task %s failed:\n%s", task.describe(), traceback.format_exc())
        return ("error", f"{type(error).__name__}: {error}", True)


class Attempts:
    """The bookkeeping both backends share: which tasks wait, how often each was tried, what each
    returned, and whether a failure is retried or ends the run."""

    def __init__(
        self,
        tasks: Sequence[Task],
        retries: int,
        on_done: Callable[[Task, TaskResult, int], None],
    ) -> None:
        self.tasks = tasks
        self.retries = retries
        self.on_done = on_done
        self.waiting = deque(range(len(tasks)))
        self.tries = [0] * len(tasks)
        self.results: list[TaskResult | None] = [None] * len(tasks)

    def next(self) -> tuple[int, int]:
        """The next task to run and its attempt number (0 for the first)."""
        index = self.waiting.popleft()
        self.tries[index] += 1
        return index, self.tries[index] - 1

    def finished(self, index: int, outcome: tuple) -> None:
        """Record ("ok", result) or ("error", message, retryable); retry, or raise
        TaskFailedError."""
        if outcome[0] == "ok":
            self.results[index] = outcome[1]
            self.on_done(self.tasks[index], outcome[1], self.tries[index])
            return
        _, message, retryable = outcome
        task = self.tasks[index]
        if not retryable or self.tries[index] > self.retries:
            tries = f"after {self.tries[index]} attempt{'s' * (self.tries[index] != 1)}"
            raise TaskFailedError(f"{task.describe()} failed {tries}: {message}")
        logger.warning("retrying %s: %s", task.describe(), message)
        self.waiting.appendleft(index)

    def ordered_results(self) -> list[TaskResult]:
        return [result for result in self.results if result is not None]


def make_backend(name: str, workers: int | None = None, address: str | None = None) -> Backend:
    """A backend by name: "local" (the default) or "ray" (needs the `ray` extra)."""
    if name == "local":
        from keel.flow.backends.local import LocalBackend

        return LocalBackend(workers)
    if name == "ray":
        from keel.flow.backends.ray import RayBackend

        return RayBackend(workers, address)
    raise UsageError(f"unknown flow backend {name!r}: use 'local' or 'ray'")
