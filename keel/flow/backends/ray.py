"""The Ray backend: each task is a Ray task, on a local Ray instance or a cluster.

`RayBackend()` starts a local Ray instance (or joins the one already initialised); with `address`
it connects to a cluster (`"auto"`, or `"ray://host:10001"`). At most `workers` tasks are in flight
at once, so the coordinator hands the next task to whichever slot frees first, as the local
backend does. Tasks travel pickled by keel (not by Ray's own pickler), so functions of
experiment files go by value, as they do to local workers. Ray's own retries are off
(max_retries=0): keel retries, so both backends count and report retries the same way. On a
multi-machine cluster, give the run a `work_dir` that every node can reach (a shared filesystem
or an fsspec URL such as s3://), since shuffle files live there.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable, Sequence

from keel.core.errors import UsageError
from keel.flow import memory
from keel.flow.backends import Attempts, pickle_task, run_pickled_task
from keel.flow.tasks import Task, TaskResult

logger = logging.getLogger(__name__)


class RayBackend:
    name = "ray"

    def __init__(self, workers: int | None = None, address: str | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise UsageError("the ray backend needs Ray: pip install 'keel[ray]'") from None
        self._ray = ray
        self._remote = _CONNECTION.acquire(ray, workers, address)
        self._closed = False
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.workers = max(1, workers or cpus)

    def run(
        self,
        tasks: Sequence[Task],
        *,
        retries: int,
        on_done: Callable[[Task, TaskResult, int], None],
    ) -> list[TaskResult]:
        ray = self._ray
        attempts = Attempts(tasks, retries, on_done)
        in_flight: dict[object, int] = {}
        try:
            while attempts.waiting or in_flight:
                while attempts.waiting and len(in_flight) < self.workers:
                    index, attempt = attempts.next()
                    payload = pickle_task(tasks[index], attempt)
                    with _CONNECTION.submitting:
                        in_flight[self._remote.remote(payload)] = index
                done, _ = ray.wait(list(in_flight), num_returns=1)
                for reference in done:
                    index = in_flight.pop(reference)
                    try:
                        outcome = ray.get(reference)
                    except ray.exceptions.RayError as error:  # the worker died or was lost
                        outcome = ("error", f"{type(error).__name__}: {error}", True)
                    attempts.finished(index, outcome)
        except BaseException:
            for reference in in_flight:
                ray.cancel(reference, force=True)
            raise
        return attempts.ordered_results()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _CONNECTION.release(self._ray)


class _RayConnection:
    """This process's connection to Ray, shared by every RayBackend in it.

    Ray allows one `ray.init` per process, and steps run in threads: two steps that each open a
    RayBackend at once must share one connection, and the first to close must not shut Ray down
    under the other. The connection is counted; keel shuts Ray down when its last backend
    closes, and only if keel started it (a caller's own `ray.init` is left alone), unless
    `keep_until_exit` was called: a command that runs many steps (`keel run --backend ray`)
    keeps one Ray for all of them. Starting Ray again for each step after the previous one
    closed it made Ray's driver abort in the quickstart on Ray ("Tried to create an owned object
    that already exists", a check in its reference counter) while two steps' threads submitted
    tasks. For the same reason the task function is made remote once per Ray, and tasks are
    submitted one thread at a time (`submitting`; waiting for them is not serialised).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.submitting = threading.Lock()
        self._users = 0
        self._started_here = False
        self._keep = False
        self._remote = None

    def acquire(self, ray, workers: int | None, address: str | None):
        """Join (or start) Ray; returns the remote task function."""
        with self._lock:
            if not ray.is_initialized():
                ray.init(
                    address=address,
                    num_cpus=workers if address is None else None,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                    runtime_env={"env_vars": memory.worker_environment()},
                )
                self._started_here = True
                self._remote = None
            if self._remote is None:
                self._remote = ray.remote(num_cpus=1, max_retries=0)(run_pickled_task)
            self._users += 1
            return self._remote

    def release(self, ray) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._started_here and not self._keep:
                self._shutdown(ray)

    def keep_until_exit(self) -> None:
        """Leave a Ray keel starts up when its last backend closes; shut it down at exit."""
        with self._lock:
            if not self._keep:
                self._keep = True
                atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if self._started_here:
            import ray

            with self._lock:
                self._shutdown(ray)

    def _shutdown(self, ray) -> None:
        if ray.is_initialized():
            ray.shutdown()
        self._started_here = False
        self._remote = None


_CONNECTION = _RayConnection()


def keep_ray_until_exit() -> None:
    """For a command that runs many steps on Ray: one Ray for all of them (_RayConnection)."""
    _CONNECTION.keep_until_exit()
