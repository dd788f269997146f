"""A training gang whose member is SIGKILLed mid-run: the survivor exits within 60 s, the
controller retries the gang as a unit on a fresh coordinator port (one line saying why), and
the run resumes from its last checkpoint to the uninterrupted run's final loss exactly
(tests/mesh_support.py's gang run, the same mesh). On the local backend, killing process 1 (the
survivor, process 0, learns it from the missed heartbeats), and on Slurm, killing process 0 (the
survivor loses the coordination service it holds on to): both ways a member can die."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from controller_support import tick_until
from mesh_support import FOUR_DEVICES, GANG_MESH, tiny_moe, write_config

from keel.cluster.backend import TaskBackend
from keel.cluster.controller import Controller
from keel.cluster.local import LocalBackend
from keel.cluster.slurm import SlurmBackend
from keel.cluster.spec import JobSpec
from keel.cluster.state import submit

KILL_AFTER_STEP = 12  # past the checkpoint at step 10


def _steps_written(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def _member(config_file: Path, replica: int) -> psutil.Process:
    """The `keel train` process of gang member `replica` (whichever engine started it)."""
    for process in psutil.process_iter(["cmdline"]):
        try:
            if str(config_file) not in (process.info["cmdline"] or []):
                continue
            if process.environ().get("KEEL_REPLICA") == str(replica):
                return process
        except psutil.Error:  # ended meanwhile, or not ours
            continue
    raise AssertionError(f"no member {replica} training {config_file}")


def _coordinator(root: Path, job: str, attempt: int) -> str:
    """The KEEL_COORDINATOR the controller chose for `attempt` of gang `job`."""
    return (root / "tasks" / job / "gang" / str(attempt) / "coordinator").read_text().strip()


def _kill_one_and_finish(
    backend: TaskBackend, tmp_path: Path, cache: str, want_loss: float, victim: int
):
    run_dir = tmp_path / "run"
    config_file = write_config(tiny_moe(cache, GANG_MESH), tmp_path / "run.yaml")
    command = (sys.executable, "-m", "keel", "train", str(config_file), "--output", str(run_dir))
    # All four devices, both processes, with the session's compilation cache: process 0 loads
    # the programs the reference gang compiled while process 1 compiles them afresh (JAX writes
    # cache entries from process 0 only, and process 1's keys differ), and waits for it at the
    # compile barrier (keel.train.gang_programs), not inside a gloo collective, which gives up
    # after 30 s: on a loaded machine that failed the attempt before anything was killed.
    env = {"XLA_FLAGS": FOUR_DEVICES, "KEEL_DEVICES": ""}
    spec = JobSpec(command, replicas=2, env=env, max_retries=1, workdir=str(tmp_path))
    control = Controller(tmp_path / "control", {backend.name: backend})
    try:
        job = submit(control.database, spec)
        tick_until(control, job, lambda _: _steps_written(run_dir) >= KILL_AFTER_STEP, 280)
        killed_member, survivor = _member(config_file, victim), _member(config_file, 1 - victim)
        killed_member.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        status = tick_until(control, job, lambda _: not survivor.is_running(), seconds=60)
        assert time.monotonic() - killed < 60, status
        status = tick_until(control, job, lambda s: s["state"] in ("succeeded", "failed"), 280)
        assert status["state"] == "succeeded" and status["failures"] == 1, status
        events = control.database.execute(
            "SELECT detail FROM events WHERE job_id = ? AND kind = 'requeued'", (job,)
        ).fetchall()
        assert len(events) == 1, [tuple(e) for e in events]
        assert re.fullmatch(r"retry 1 of 1 after: replica [01]: .+", events[0]["detail"])
        coordinators = {_coordinator(tmp_path / "control", job, attempt) for attempt in (1, 2)}
        assert len(coordinators) == 2  # each attempt of the gang has its own coordinator port
    finally:
        control.close()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["step"] == 20 and result["loss"] == want_loss  # exactly


@pytest.mark.slow
@pytest.mark.timeout(900)  # the session's reference runs may be made here
def test_a_killed_member_of_a_local_training_gang(gang_run, wikitext_cache, tmp_path):
    backend = LocalBackend(tmp_path / "control" / "tasks", max_cpus=2)
    want = gang_run[0][-1]["loss"]
    _kill_one_and_finish(backend, tmp_path, wikitext_cache, want, victim=1)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)  # the session's reference runs may be made here
def test_a_killed_member_of_a_slurm_training_gang(
    slurm_cluster, gang_run, wikitext_cache, tmp_path
):
    backend = SlurmBackend(str(tmp_path / "slurm-logs"), partition=slurm_cluster.partition)
    want = gang_run[0][-1]["loss"]
    _kill_one_and_finish(backend, tmp_path, wikitext_cache, want, victim=0)
