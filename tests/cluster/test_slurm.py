"""The Slurm backend against a real single-node Slurm (slurmctld + slurmd, see slurm_cluster.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, free_port

from keel.cluster.backend import TaskLaunch, TaskState, TaskStatus
from keel.cluster.controller import Controller
from keel.cluster.slurm import SlurmBackend, SlurmError
from keel.cluster.spec import JobSpec, Priority, Resources
from keel.cluster.state import job_status, submit
from keel.core.errors import UsageError

ENDED = (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED, TaskState.LOST)


@pytest.fixture
def backend(slurm_cluster: SlurmCluster, tmp_path: Path) -> SlurmBackend:
    return SlurmBackend(str(tmp_path / "logs"), partition=slurm_cluster.partition)


def _task(name: str, *command: str, **fields) -> TaskLaunch:
    return TaskLaunch(task_id=f"{name}-{time.monotonic_ns()}", attempt=1, command=command, **fields)


def _wait(backend: SlurmBackend, handle: str, states=ENDED, seconds: float = 60.0) -> TaskStatus:
    deadline = time.monotonic() + seconds
    while True:
        status = backend.poll([handle])[handle]
        if status.state in states:
            return status
        assert time.monotonic() < deadline, f"job {handle} still {status} after {seconds} s"
        time.sleep(0.3)


@pytest.mark.slurm
def test_a_job_that_exits_0_succeeds_and_a_new_backend_finds_its_log(
    backend, slurm_cluster, tmp_path
):
    task = _task("ok", "bash", "-c", "echo hello from slurm; echo to stderr >&2")
    handle = backend.launch(task)
    assert handle.isdigit()
    status = _wait(backend, handle)
    assert (status.state, status.exit_code) == (TaskState.SUCCEEDED, 0)
    stdout, stderr = backend.log_files(handle)
    assert Path(stdout).parent == tmp_path / "logs" / task.task_id / "1"
    assert Path(stdout).read_text() == "hello from slurm\n"
    assert Path(stderr).read_text() == "to stderr\n"
    # a restarted controller has only the handle
    again = SlurmBackend(str(tmp_path / "logs"))
    assert again.poll([handle])[handle].state == TaskState.SUCCEEDED
    assert again.log_files(handle) == (stdout, stderr)
    assert again.capacity().total["cpu"] == slurm_cluster.cpus  # the default partition


@pytest.mark.slurm
def test_exit_3_fails_with_its_code_and_a_signal_is_reported(backend):
    three = backend.launch(_task("three", "bash", "-c", "exit 3"))
    killed = backend.launch(_task("killed", "bash", "-c", "kill -KILL $$"))
    status = _wait(backend, three)
    assert (status.state, status.exit_code) == (TaskState.FAILED, 3)
    assert status.reason == "exited with code 3"
    status = _wait(backend, killed)
    assert (status.state, status.exit_code) == (TaskState.FAILED, 128 + 9)
    assert status.reason == "killed by signal 9"


@pytest.mark.slurm
def test_cancel_stops_a_sleeping_job_and_capacity_sees_it(backend, slurm_cluster):
    capacity = backend.capacity()
    assert capacity.total["cpu"] == capacity.free["cpu"] == slurm_cluster.cpus
    assert capacity.total["fake"] == capacity.total["gpu"] == slurm_cluster.gpus
    assert capacity.region == ""
    task = _task("sleep", "sleep", "300", device_type="fake", device_count=1)
    handle = backend.launch(task)
    assert _wait(backend, handle, states=(TaskState.RUNNING,)).state == TaskState.RUNNING
    busy = backend.capacity()
    assert busy.free["cpu"] == slurm_cluster.cpus - 1
    assert busy.free["fake"] == busy.free["gpu"] == slurm_cluster.gpus - 1
    # a job Slurm has not started yet counts as taken
    waiting = backend.launch(_task("wait", "true", cpus=slurm_cluster.cpus))
    assert backend.poll([waiting])[waiting].state == TaskState.PENDING
    assert backend.capacity().free["cpu"] == 0
    # launching the same attempt again adopts its job, also when only Slurm remembers it
    assert backend.launch(task) == handle
    marker = Path(backend.log_files(handle)[0]).parent / "slurm_job_id"
    marker.unlink()
    assert backend.launch(task) == handle and marker.read_text() == f"{handle}\n"
    backend.cancel(handle)
    assert _wait(backend, handle).state == TaskState.CANCELLED
    backend.cancel(handle)  # already ended: a no-op
    assert _wait(backend, waiting).state == TaskState.SUCCEEDED


@pytest.mark.slurm
def test_handles_slurm_does_not_know_are_lost(backend):
    statuses = backend.poll(["987654321", "not-a-job"])
    assert {s.state for s in statuses.values()} == {TaskState.LOST}
    assert "accounting is disabled" in statuses["987654321"].reason
    backend.cancel("987654321")  # unknown: a no-op


@pytest.mark.slurm
def test_env_vars_workdir_and_gpus_reach_the_job(backend, tmp_path):
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    value = "a value with spaces, commas, $dollars and 'quotes'"
    command = ("bash", "-c", 'echo "$KEEL_VALUE"; pwd; echo "gpus=$SLURM_GPUS_ON_NODE"')
    task = _task("env", *command, env={"KEEL_VALUE": value}, workdir=str(workdir))
    handle = backend.launch(
        TaskLaunch(**{**task.__dict__, "device_type": "fake", "device_count": 2, "cpus": 0.5})
    )
    assert _wait(backend, handle).state == TaskState.SUCCEEDED
    assert Path(backend.log_files(handle)[0]).read_text() == f"{value}\n{workdir}\ngpus=2\n"


@pytest.mark.slurm
def test_what_the_cluster_cannot_give_is_refused(backend, slurm_cluster):
    with pytest.raises(UsageError, match="has no 'h100' gpus"):
        backend.launch(_task("h100", "true", device_type="h100", device_count=1))
    too_big = slurm_cluster.memory_mb * 2
    with pytest.raises(UsageError, match=r"Slurm refused task .*Memory specification"):
        backend.launch(_task("memory", "true", memory_mb=too_big))
    with pytest.raises(UsageError, match="Invalid partition"):
        SlurmBackend(str(slurm_cluster.root / "x"), partition="nope").launch(_task("p", "true"))


@pytest.mark.slurm
def test_a_slurmctld_that_does_not_answer_is_an_error_not_lost_jobs(
    slurm_cluster, tmp_path, monkeypatch
):
    conf = Path(slurm_cluster.conf).read_text().splitlines()
    dead = [f"SlurmctldPort={free_port()}" if c.startswith("SlurmctldPort=") else c for c in conf]
    (tmp_path / "slurm.conf").write_text("\n".join(dead) + "\n")
    (tmp_path / "gres.conf").write_text((Path(slurm_cluster.conf).parent / "gres.conf").read_text())
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    with pytest.raises(SlurmError, match="squeue did not answer within 1 s"):
        SlurmBackend(str(tmp_path / "logs"), timeout_s=1).poll(["1"])


def test_without_slurm_commands_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UsageError, match="sbatch not found: install Slurm or use the local"):
        SlurmBackend(str(tmp_path / "logs")).launch(_task("x", "true"))
    with pytest.raises(UsageError, match="squeue not found"):
        SlurmBackend(str(tmp_path / "logs")).poll(["1"])


@pytest.mark.slurm
def test_the_controller_preempts_slurm_batch_work_for_production_and_requeues_it(
    slurm_cluster, tmp_path
):
    """A batch job holding every cpu is scancelled when production work arrives, requeued, and
    completes after it; Slurm itself records the first attempt as cancelled."""
    backend = SlurmBackend(str(tmp_path / "slurm-logs"), partition=slurm_cluster.partition)
    control = Controller(tmp_path / "control", {"slurm": backend})
    journal, marker = tmp_path / "journal", tmp_path / "preempted-once"
    everything = Resources(cpus=slurm_cluster.cpus)
    # The first attempt never reaches "batch end": scancel's SIGTERM can reach `sleep` before the
    # shell, and a shell that outlived its child would otherwise write the line (a flaky journal).
    batch_script = (
        f"echo batch start >> {journal}; "
        f"if [ ! -e {marker} ]; then touch {marker}; sleep 300; exit 0; fi; "
        f"echo batch end >> {journal}"
    )
    batch = submit(control.database, JobSpec(("sh", "-c", batch_script), resources=everything))

    def run_until(done, seconds: float = 60.0) -> None:
        deadline = time.monotonic() + seconds
        while not done():
            assert time.monotonic() < deadline, [job_status(control.database, j) for j in jobs]
            control.tick()
            time.sleep(0.2)

    def states() -> list[str]:
        return [job_status(control.database, job)["state"] for job in jobs]

    jobs = [batch]
    run_until(marker.exists)  # the batch job runs in Slurm
    urgent_script = f"echo urgent start >> {journal}; sleep 1; echo urgent end >> {journal}"
    urgent = submit(
        control.database,
        JobSpec(("sh", "-c", urgent_script), resources=everything, priority=Priority.PRODUCTION),
    )
    jobs = [batch, urgent]
    run_until(lambda: states() == ["succeeded", "succeeded"])
    lines = journal.read_text().splitlines()
    assert lines == ["batch start", "urgent start", "urgent end", "batch start", "batch end"]
    status = job_status(control.database, batch)
    assert status["preemptions"] == 1 and status["tasks"][0]["attempt"] == 2
    first = control.database.execute(
        "SELECT handle, state FROM attempts WHERE job_id = ? AND attempt = 1", (batch,)
    ).fetchone()
    assert first["state"] == "cancelled"
    assert backend.poll([first["handle"]])[first["handle"]].state == TaskState.CANCELLED
    control.close()
