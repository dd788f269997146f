"""The Ray backend against a real local Ray head (ray start --head, 2 cpus, token auth on)."""

import time
from pathlib import Path

import pytest
from ray_head import RayHead, ray_head  # noqa: F401  (ray_head is a fixture)

from keel.cluster import ray_backend
from keel.cluster.backend import TaskLaunch, TaskState, TaskStatus
from keel.cluster.ray_backend import (
    RayBackend,
    RayUnreachableError,
    _camel,
    _capacity_of,
    _catalog,
)
from keel.core.errors import UsageError

pytestmark = pytest.mark.ray

ENDED = (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED, TaskState.LOST)


@pytest.fixture
def backend(ray_head: RayHead, tmp_path: Path):  # noqa: F811
    ray = RayBackend(ray_head.address, str(tmp_path / "logs"), token=ray_head.token)
    yield ray
    ray.close()


def _task(name: str, *command: str, **fields) -> TaskLaunch:
    return TaskLaunch(task_id=f"{name}-{time.monotonic_ns()}", attempt=1, command=command, **fields)


def _wait(backend: RayBackend, handle: str, states=ENDED, seconds: float = 60.0) -> TaskStatus:
    deadline = time.monotonic() + seconds
    while True:
        status = backend.poll([handle])[handle]
        if status.state in states or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def _read(path: str) -> str:
    return Path(path).read_text() if Path(path).exists() else ""


def test_a_job_succeeds_and_its_output_reaches_the_log_file(backend):
    handle = backend.launch(_task("hello", "echo", "hello from ray"))
    assert handle.startswith("keel-hello-") and handle.endswith("-1")
    status = _wait(backend, handle)
    assert (status.state, status.exit_code) == (TaskState.SUCCEEDED, 0)
    stdout, stderr = backend.log_files(handle)
    assert "hello from ray" in Path(stdout).read_text()
    assert Path(stdout).parent == backend.log_root / handle
    assert not Path(stderr).exists()  # Ray merges both streams into stdout
    # a restarted controller's backend finds the job by its handle
    again = RayBackend(backend.address, str(backend.log_root), token=backend._token)
    assert again.poll([handle])[handle] == status


def test_a_job_that_exits_3_failed_with_code_and_reason(backend):
    handle = backend.launch(_task("three", "sh", "-c", "echo about to fail; exit 3"))
    status = _wait(backend, handle)
    assert (status.state, status.exit_code) == (TaskState.FAILED, 3)
    assert "exit code 3" in status.reason and "\n" not in status.reason
    # poll saved the final log once the job ended
    assert "about to fail" in (backend.log_root / handle / "stdout").read_text()


def test_env_vars_and_workdir_reach_the_job(backend, tmp_path):
    value = "two words and 'quotes'"
    task = _task(
        "env", "sh", "-c", 'echo "value=$KEEL_VALUE task=$KEEL_TASK_ID"; pwd',
        env={"KEEL_VALUE": value}, workdir=str(tmp_path),
    )  # fmt: skip
    handle = backend.launch(task)
    assert _wait(backend, handle).state is TaskState.SUCCEEDED
    text = Path(backend.log_files(handle)[0]).read_text()
    assert f"value={value} task={task.task_id}" in text
    assert str(tmp_path) in text.splitlines()


def test_a_cancelled_job_is_cancelled_and_its_cpu_shows_as_used(backend):
    assert backend.capacity().total["cpu"] == 2.0
    handle = backend.launch(_task("sleeper", "sh", "-c", "echo started; sleep 120", cpus=1.0))
    assert _wait(backend, handle, (TaskState.RUNNING, *ENDED)).state is TaskState.RUNNING
    deadline = time.monotonic() + 20  # log_files copies the log of a running job on each call
    while "started" not in _read(backend.log_files(handle)[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "started" in _read(backend.log_files(handle)[0])
    deadline = time.monotonic() + 20  # the autoscaler's report is a few seconds old
    while backend.capacity().free["cpu"] != 1.0 and time.monotonic() < deadline:
        time.sleep(0.5)
    capacity = backend.capacity()
    assert (capacity.total["cpu"], capacity.free["cpu"]) == (2.0, 1.0)
    assert backend._totals_and_job_usage() == ({"cpu": 2.0}, {"cpu": 1.0})
    backend.cancel(handle)
    status = _wait(backend, handle)
    assert status.state is TaskState.CANCELLED
    backend.cancel(handle)  # a no-op once it ended


def test_capacity_shows_the_heads_two_cpus(backend):
    capacity = backend.capacity()
    assert capacity.total == {"cpu": 2.0}
    assert 0.0 <= capacity.free["cpu"] <= 2.0


def test_an_unknown_handle_is_lost(backend):
    status = backend.poll(["keel-never-launched-1"])["keel-never-launched-1"]
    assert status.state is TaskState.LOST and "no job" in status.reason


def test_a_repeated_launch_adopts_the_job_and_a_clash_is_refused(backend):
    task = _task("twice", "echo", "once")
    handle = backend.launch(task)
    assert backend.launch(task) == handle  # e.g. the controller died before recording it
    with pytest.raises(UsageError, match="refused task"):
        backend.launch(TaskLaunch(task.task_id, 1, ("echo", "another command")))
    assert _wait(backend, handle).state is TaskState.SUCCEEDED


def test_a_gpu_ask_the_cluster_cannot_meet_stays_pending(backend):
    handle = backend.launch(_task("gpu", "true", device_type="gpu", device_count=1))
    time.sleep(2)
    assert backend.poll([handle])[handle].state is TaskState.PENDING
    # Ray queues the stop until the job is scheduled (here: never); cancel must not fail
    backend.cancel(handle)
    assert (backend.log_root / handle / "cancelled").exists()
    assert backend.poll([handle])[handle].state in (TaskState.PENDING, TaskState.CANCELLED)


def test_without_a_token_the_backend_says_how_to_give_one(ray_head, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(UsageError, match="requires a token"):
        RayBackend(ray_head.address, str(tmp_path)).launch(_task("x", "true"))


def test_an_unreachable_cluster_raises_rather_than_losing_tasks(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_backend, "RETRY_DELAYS_SECONDS", (0.05,))
    backend = RayBackend("127.0.0.1:9", str(tmp_path))  # nothing listens on the discard port
    with pytest.raises(RayUnreachableError, match="cannot reach ray"):
        backend.launch(_task("x", "true"))
    with pytest.raises(RayUnreachableError, match="did not answer"):
        backend.poll(["keel-x-1"])
    with pytest.raises(RayUnreachableError, match="no capacity"):
        backend.capacity()


# Ray's resources as a mixed cluster reports them (no cluster needed: plain data).
NODES = [
    {"CPU": (1.0, 8.0), "GPU": (4.0, 8.0), "accelerator_type:H100": (0.0, 1.0),
     "memory": (0.0, 1e9), "object_store_memory": (0.0, 1e9), "node:10.0.0.1": (0.0, 1.0)},
    {"CPU": (0.0, 4.0), "TPU": (0.0, 4.0), "accelerator_type:TPU-V4": (0.0, 1.0)},
    {"CPU": (0.0, 2.0), "scratch_disk": (1.0, 3.0)},
]  # fmt: skip


def test_ray_resources_become_keel_device_types():
    assert _capacity_of(NODES) == {
        "cpu": 14.0, "gpu": 8.0, "h100": 8.0, "tpu": 4.0, "tpu-v4": 4.0, "scratch_disk": 3.0
    }  # fmt: skip
    assert _capacity_of(NODES, used=True) == {
        "cpu": 1.0, "gpu": 4.0, "h100": 4.0, "tpu": 0.0, "tpu-v4": 0.0, "scratch_disk": 1.0
    }  # fmt: skip
    # the dashboard's camel-casing of keys, undone through the names it leaves alone
    assert _camel("object_store_memory") == "objectStoreMemory"
    assert _camel("node:__internal_head__") == "node:InternalHead"


def test_a_device_type_asks_for_the_matching_ray_resource(tmp_path):
    backend = RayBackend("127.0.0.1:9", str(tmp_path))
    backend._catalog = _catalog(NODES)
    assert backend._device_asks("h100", 8) == (
        {"entrypoint_num_gpus": 8, "entrypoint_resources": {"accelerator_type:H100": 0.001}},
        "gpu",
    )
    assert backend._device_asks("tpu-v4", 4) == (
        {"entrypoint_resources": {"TPU": 4.0, "accelerator_type:TPU-V4": 0.001}},
        "tpu",
    )
    assert backend._device_asks("gpu", 2) == ({"entrypoint_num_gpus": 2}, "")
    assert backend._device_asks("scratch_disk", 1) == (
        {"entrypoint_resources": {"scratch_disk": 1.0}},
        "",
    )
