"""Gangs through keel's launchers: every replica of an attempt gets one KEEL_COORDINATOR, the
replicas form one JAX runtime (tests/train/gang_probe.py: a sum over 2 processes x 4 devices).
Local backend (through `keel job run`) and Slurm. A member killed mid-run is
tests/cluster/test_training_gang.py's: a training gang, retried as a unit on a fresh port."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from controller_support import tick_until

from keel.cluster.backend import TaskLaunch, TaskState
from keel.cluster.controller import Controller
from keel.cluster.slurm import SlurmBackend
from keel.cluster.spec import JobSpec
from keel.cluster.state import connect, job_status, submit

PROBE = str(Path(__file__).parents[1] / "train" / "gang_probe.py")
FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
KEEL = [sys.executable, "-m", "keel"]
ENDED = {TaskState.SUCCEEDED, TaskState.FAILED, TaskState.LOST, TaskState.CANCELLED}


def _probe(out: Path, *options: str, **changes) -> JobSpec:
    return JobSpec(
        (sys.executable, PROBE, str(out), *options), replicas=2, env=FOUR_DEVICES, **changes
    )


def _seen(out: Path) -> list[dict]:
    return [json.loads((out / f"{i}.json").read_text()) for i in range(2)]


def _coordinator(root: Path, job: str, attempt: int) -> str:
    return (root / "tasks" / job / "gang" / str(attempt) / "coordinator").read_text().strip()


@pytest.mark.slow
def test_keel_job_run_replicas_2_forms_one_runtime_on_the_local_backend(tmp_path):
    out = tmp_path / "out"

    def keel(*args: str) -> str:
        done = subprocess.run([*KEEL, *args], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    flags = f"XLA_FLAGS={FOUR_DEVICES['XLA_FLAGS']}"
    command = ("--replicas", "2", "--env", flags, "--", sys.executable, PROBE, str(out))
    job = keel("job", "run", *command).strip()
    root = tmp_path / "keel-out" / "cluster"
    database = connect(root / "state.db")  # read here: a `keel job status` per poll costs 1 s
    try:
        deadline = time.monotonic() + 120
        while (status := job_status(database, job))["state"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status["state"] == "succeeded", status
    finally:
        database.close()
        keel("cluster", "stop")
    seen = _seen(out)
    assert [(s["sum"], s["devices"], s["processes"]) for s in seen] == [(36.0, 8, 2)] * 2
    assert {s["coordinator"] for s in seen} == {_coordinator(root, job, 1)}
    assert _coordinator(root, job, 1).startswith("127.0.0.1:")


@pytest.mark.slurm
@pytest.mark.slow
def test_a_slurm_gang_finds_replica_0s_node_and_sums_over_both(slurm_cluster, tmp_path):
    out, root = tmp_path / "out", tmp_path / "control"
    backend = SlurmBackend(str(tmp_path / "slurm-logs"), partition=slurm_cluster.partition)
    control = Controller(root, {"slurm": backend})
    job = submit(control.database, _probe(out, workdir=str(tmp_path)))
    status = tick_until(control, job, lambda s: s["state"] in ("succeeded", "failed"))
    assert status["state"] == "succeeded", (status, slurm_cluster.log_tail())
    seen = _seen(out)
    assert [(s["sum"], s["devices"], s["processes"]) for s in seen] == [(36.0, 8, 2)] * 2
    port = _coordinator(root, job, 1).rsplit(":", 1)[1]
    host = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    assert {s["coordinator"] for s in seen} == {f"{host}:{port}"}  # replica 0's node
    control.close()


@pytest.mark.slurm
def test_a_slurm_replica_whose_siblings_never_start_fails_in_one_line(slurm_cluster, tmp_path):
    """Replica 0 of a gang of 2 alone: its batch script gives up waiting after gang_start_s."""
    backend = SlurmBackend(
        str(tmp_path / "logs"), partition=slurm_cluster.partition, gang_start_s=2
    )
    gang_dir = tmp_path / "gang"
    gang_dir.mkdir()
    env = {"KEEL_REPLICA": "0", "KEEL_REPLICAS": "2", "KEEL_COORDINATOR": "127.0.0.1:12345"}
    task = TaskLaunch("j-1.0", 1, ("true",), env=env, gang_dir=str(gang_dir))
    handle = backend.launch(task)
    deadline = time.monotonic() + 60
    while (status := backend.poll([handle])[handle]).state not in ENDED:
        assert time.monotonic() < deadline, status
        time.sleep(0.3)
    assert status.state == TaskState.FAILED and status.exit_code == 2
    stderr = Path(backend.log_files(handle)[1]).read_text().strip().splitlines()
    assert stderr == [
        "error: keel task j-1.0: not all 2 replicas of the gang started within 2 s (see squeue); "
        "the gang fails and keel retries it"
    ]
    assert (gang_dir / "slurm-coordinator").read_text().strip().endswith(":12345")
