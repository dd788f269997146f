"""The local backend: a pool of worker processes on this machine that pull tasks.

Why not concurrent.futures.ProcessPoolExecutor: when one of its workers is killed, the whole pool
breaks and every pending task fails without saying which one was running where. Here each worker
has its own pipe, the coordinator knows which task each worker holds, and a dead worker (SIGKILL,
out of memory) costs exactly one attempt of exactly one task; a fresh worker replaces it.

Each worker is a fresh interpreter running keel.flow.backends.worker, started with subprocess
rather than multiprocessing: a clean process is safe beside threads in the parent (the step
executor's), and, unlike multiprocessing's spawn, it does not re-import the caller's __main__, so a
script without an `if __name__ == "__main__"` guard works. Tasks travel pickled with cloudpickle,
so lambdas and functions defined in scripts and experiment files go along.

Workers allocate Arrow memory as keel.flow.memory says (jemalloc, freed pages kept ~10 s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait

from keel.flow import memory
from keel.flow.backends import Attempts, pickle_task
from keel.flow.tasks import Task, TaskResult

logger = logging.getLogger(__name__)


class LocalBackend:
    """`workers` processes (default: the number of cores), started on first use, reused across
    stages and runs until `close()`."""

    name = "local"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = max(1, workers or os.cpu_count() or 1)
        self._pool: list[_Worker] = []

    def run(
        self,
        tasks: Sequence[Task],
        *,
        retries: int,
        on_done: Callable[[Task, TaskResult, int], None],
    ) -> list[TaskResult]:
        attempts = Attempts(tasks, retries, on_done)
        while len(self._pool) < min(self.workers, len(tasks)):
            self._pool.append(_Worker(self.workers))
        idle = list(self._pool)
        busy: dict[_Worker, int] = {}

        def start_next(worker: _Worker) -> None:
            index, attempt = attempts.next()
            worker.send(tasks[index], attempt)
            busy[worker] = index

        try:
            while attempts.waiting or busy:
                while idle and attempts.waiting:
                    start_next(idle.pop())
                for worker in _ready(busy):
                    index = busy.pop(worker)
                    outcome = worker.receive()
                    if outcome[0] == "died":
                        self._pool.remove(worker)
                        worker = _Worker(self.workers)
                        self._pool.append(worker)
                        outcome = ("error", outcome[1], True)
                    if outcome[0] == "ok" and attempts.waiting:
                        # the next task first: recording a result may take a while (on_done
                        # hands set-aside rows over); a failure is recorded first instead, so
                        # that its retry starts before any new task
                        start_next(worker)
                    else:
                        idle.append(worker)
                    attempts.finished(index, outcome)
        except BaseException:
            self.close()  # workers may hold half-done tasks: never reuse them
            raise
        return attempts.ordered_results()

    def close(self) -> None:
        for worker in self._pool:  # all are told first, so they wind down side by side
            worker.ask_to_stop()
        for worker in self._pool:
            worker.stop()
        self._pool.clear()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Worker:
    """One `python -m keel.flow.backends.worker` process (of a pool of `workers`) and the two
    pipes to talk to it."""

    def __init__(self, workers: int) -> None:
        to_child_read, to_child_write = os.pipe()
        from_child_read, from_child_write = os.pipe()
        environment = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            **memory.worker_environment(),
            **_blas_threads(workers),
        }
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-P",  # no working directory first on sys.path: the coordinator's path, as is
                "-m",
                "keel.flow.backends.worker",
                str(to_child_read),
                str(from_child_write),
            ],
            pass_fds=(to_child_read, from_child_write),
            stdin=subprocess.DEVNULL,
            env=environment,
        )
        os.close(to_child_read)
        os.close(from_child_write)
        self.sender = Connection(to_child_write, readable=False)
        self.connection = Connection(from_child_read, writable=False)
        self.asked_to_stop = False

    def send(self, task: Task, attempt: int) -> None:
        self.sender.send_bytes(pickle_task(task, attempt))

    def receive(self) -> tuple:
        """("ok", result) | ("error", message, retryable) | ("died", message, True)."""
        try:
            return pickle.loads(self.connection.recv_bytes())
        except (EOFError, ConnectionError, OSError):
            try:
                code = self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                code = self.process.wait()
            return ("died", f"worker process died ({_exit_reason(code)})", True)

    def ask_to_stop(self) -> None:
        """Send the empty message that ends the worker's loop, once (stop waits for the exit)."""
        if self.process.poll() is None and not self.asked_to_stop:
            self.asked_to_stop = True
            with contextlib.suppress(OSError):  # it may die between the check and the send
                self.sender.send_bytes(b"")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.ask_to_stop()
            # the pipe's end of file says the process is exiting: waited on as an event, where
            # Popen.wait(timeout) polls in sleeps of up to 50 ms (~30 ms a pool at each close)
            if not wait([self.connection], timeout=2):
                self.process.kill()
            self.process.wait()
        self.sender.close()
        self.connection.close()


def _blas_threads(workers: int) -> dict[str, str]:
    """OpenBLAS's threads for a worker: this machine's cores shared among the pool's workers, at
    least one, unless the environment says. numpy's OpenBLAS otherwise starts a thread per core
    in every worker, and they spin for a while after start-up: on 2 cores, 0.1-0.2 s of CPU
    taken from the workers per run (exact dedup of 2M documents)."""
    if BLAS_THREADS in os.environ:
        return {}
    return {BLAS_THREADS: str(max(1, (os.cpu_count() or 1) // workers))}


BLAS_THREADS = "OPENBLAS_NUM_THREADS"


def _ready(busy: dict[_Worker, int]) -> list[_Worker]:
    """Busy workers that finished a task or died, in a stable order."""
    ready = {id(connection) for connection in wait([worker.connection for worker in busy])}
    return [worker for worker in busy if id(worker.connection) in ready]


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
