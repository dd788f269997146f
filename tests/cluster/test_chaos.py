"""Chaos: a short pipeline of jobs while the controller and workers are SIGKILLed at seeded
random moments. Nothing may be lost or done twice.

Each job holds an flock on its own file for its whole life (a second attempt running at the same
time writes "overlap" and exits), appends "start" to a journal, writes three batches of rows to a
telemetry store through its own short-lived store handle (skipping a batch an earlier, killed
attempt already committed), then appends "end" (or "again", if an earlier attempt ended the job
and was killed before it could report so). Killed attempts are retried by the controller. Every
controller (re)start launches two at once, as racing job commands would: one must run, the
other give up.

The seed is printed (`pytest -s`, and in every failure message); set KEEL_CHAOS_SEED to replay one.
"""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from keel.cluster import state
from keel.cluster.daemon import running_controller
from keel.cluster.spec import JobSpec, Resources
from keel.core.process import process_alive
from keel.telemetry import TelemetryStore

JOBS = 20
BATCHES = 3
ROWS = 4  # per batch
NAMESPACE = "chaos.rows"
DEADLINE_SECONDS = 80.0

JOB = textwrap.dedent(
    f"""
    import fcntl, os, sys, time
    from keel.telemetry import TelemetryStore
    from keel.telemetry.schema import StoreBusyError

    journal, store_root, locks = sys.argv[1:4]
    job, attempt = os.environ["KEEL_JOB_ID"], os.environ["KEEL_ATTEMPT"]

    def log(word):
        with open(journal, "a") as handle:
            handle.write(f"{{word}} {{job}} {{attempt}}\\n")

    held = os.open(os.path.join(locks, job), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log("overlap")
        sys.exit(1)
    log("start")
    for batch in range({BATCHES}):
        while True:
            try:
                store = TelemetryStore(store_root)
                try:
                    done = "{NAMESPACE}" in store.namespaces() and store.query(
                        f"SELECT count(*) AS n FROM \\"{NAMESPACE}\\" "
                        f"WHERE job_id = '{{job}}' AND batch = {{batch}}"
                    ).to_pylist()[0]["n"]
                    if not done:
                        rows = [{{"job_id": job, "batch": batch, "row": n}} for n in range({ROWS})]
                        store.write("{NAMESPACE}", rows)
                finally:
                    store.close()
                break
            except StoreBusyError:  # another job holds the writer lock: wait for it
                time.sleep(0.02)
        time.sleep(0.1)
    # Ending is idempotent too: an attempt killed after its "end" (before its exit code was
    # written) is retried, and the retry finds the job done.
    with open(journal) as handle:
        ended = any(line.split()[:2] == ["end", job] for line in handle)
    log("again" if ended else "end")
    """
)


class Chaos:
    def __init__(self, root: Path, config: Path, seed: int) -> None:
        self.root, self.config, self.seed = root, config, seed
        self.rng = random.Random(seed)
        self.controllers: list[subprocess.Popen] = []
        self.kills = {"controller": 0, "worker": 0}

    def start_controllers(self) -> None:
        """Start two controllers at once, as two job commands finding none would, and wait
        until one runs (holds the lock, has announced itself), so each kill hits a working
        controller, not one still importing. The other must give up (exit 3)."""
        command = [sys.executable, "-m", "keel.cluster.daemon", str(self.root), str(self.config)]
        pair = [subprocess.Popen(command, stdin=subprocess.DEVNULL) for _ in range(2)]
        self.controllers += pair
        deadline = time.monotonic() + 60
        while (running_controller(self.root) or {}).get("pid") not in {p.pid for p in pair}:
            assert time.monotonic() < deadline, f"seed {self.seed}: no controller started"
            time.sleep(0.05)
        winner = running_controller(self.root)["pid"]
        loser = next(p for p in pair if p.pid != winner)
        assert loser.wait(timeout=60) == 3, f"seed {self.seed}: a second controller ran"

    def kill_controllers(self) -> None:
        for controller in self.controllers:
            if controller.poll() is None:
                os.kill(controller.pid, signal.SIGKILL)
                controller.wait()
                self.kills["controller"] += 1

    def restart_controllers(self) -> None:
        self.kill_controllers()
        self.start_controllers()

    def kill_worker(self) -> bool:
        alive = []
        for pid_file in sorted((self.root / "tasks").glob("*/*/*/pid")):
            pid, started, _ = pid_file.read_text().split()
            if process_alive(int(pid), int(started)):
                alive.append(int(pid))
        if not alive:
            return False
        try:
            os.killpg(self.rng.choice(alive), signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.kills["worker"] += 1
        return True

    def strike(self) -> None:
        """One random kill: the controller now and then, a worker more often."""
        if self.rng.random() < 0.3 and self.kills["controller"] < 4:
            self.restart_controllers()
        elif self.kills["worker"] < 8:
            self.kill_worker()


@pytest.mark.slow
def test_killing_the_controller_and_workers_loses_nothing_and_does_nothing_twice(tmp_path):
    seed = int(os.environ.get("KEEL_CHAOS_SEED") or random.randrange(1 << 31))
    print(f"chaos seed {seed} (replay: KEEL_CHAOS_SEED={seed})")
    root, store_root, locks = tmp_path / "cluster", tmp_path / "telemetry", tmp_path / "locks"
    locks.mkdir()
    journal = tmp_path / "journal"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    config = tmp_path / "clusters.yaml"
    config.write_text("tick_seconds: 0.1\nclusters: [{name: local, max_cpus: 4}]\n")
    database = state.connect(root / "state.db")
    spec = JobSpec(
        (sys.executable, str(script), str(journal), str(store_root), str(locks)),
        resources=Resources(cpus=1),
        max_preemptions=50,
    )
    jobs = [state.submit(database, spec) for _ in range(JOBS)]
    chaos = Chaos(root, config, seed)
    chaos.start_controllers()
    deadline = time.monotonic() + DEADLINE_SECONDS
    try:
        while True:
            states = dict(database.execute("SELECT id, state FROM jobs").fetchall())
            if all(s in state.FINAL_JOB_STATES for s in states.values()):
                break
            assert time.monotonic() < deadline, f"seed {seed}: not done: {states}"
            time.sleep(chaos.rng.uniform(0.2, 1.0))
            chaos.strike()
    finally:
        chaos.kill_controllers()
    print(f"kills: {chaos.kills}")
    context = f"seed {seed}, kills {chaos.kills}"
    assert set(states.values()) == {"succeeded"}, f"{context}: {states}"
    lines = [line.split() for line in journal.read_text().splitlines()]
    assert not [line for line in lines if line[0] == "overlap"], f"{context}: two attempts at once"
    attempts = database.execute(
        "SELECT job_id, attempt, state FROM attempts ORDER BY job_id, attempt"
    ).fetchall()
    for job in jobs:
        ends = [line for line in lines if line[0] == "end" and line[1] == job]
        assert len(ends) == 1, f"{context}: {job} ended {len(ends)} times"
        tried = {number: result for job_id, number, result in attempts if job_id == job}
        assert [r for r in tried.values() if r == "succeeded"] == ["succeeded"], (context, tried)
        assert tried[max(tried)] == "succeeded", f"{context}: {job} ran after it succeeded"
        ender = int(ends[0][2])  # the attempt that wrote "end": it succeeded, or was killed
        assert tried[ender] in ("succeeded", "lost"), (context, job, tried)
    store = TelemetryStore(store_root)
    rows = store.query(
        f'SELECT job_id, batch, "row", count(*) AS n FROM "{NAMESPACE}" GROUP BY ALL'
    ).to_pylist()
    store.close()
    counts = {(r["job_id"], r["batch"], r["row"]): r["n"] for r in rows}
    expected = {(j, b, n) for j in jobs for b in range(BATCHES) for n in range(ROWS)}
    assert set(counts) == expected, f"{context}: rows missing or extra"
    assert all(n == 1 for n in counts.values()), f"{context}: rows written twice"
    starts = database.execute("SELECT count(*) FROM events WHERE kind = 'controller started'")
    assert starts.fetchone()[0] == len(chaos.controllers) // 2, context
