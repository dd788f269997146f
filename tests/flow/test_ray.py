"""The Ray backend, on a real local Ray instance: same output as local, retries on worker death."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_determinism import _run, write_inputs

from keel.flow import LocalBackend, from_items

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_backend():
    from keel.flow.backends.ray import RayBackend

    backend = RayBackend(workers=2)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("inputs"))


def test_ray_backend_writes_the_same_files_as_local(inputs, tmp_path, ray_backend):
    with LocalBackend(workers=2) as backend:
        local = _run(inputs, tmp_path / "local", backend)
    assert _run(inputs, tmp_path / "ray", ray_backend) == local


def test_a_killed_ray_worker_task_is_retried(tmp_path, ray_backend):
    marker = tmp_path / "killed"

    def die_once(row):
        if row["n"] == 123 and not marker.exists():
            marker.write_text("x")
            os.kill(os.getpid(), signal.SIGKILL)
        return row

    rows = [{"n": i, "id": i % 10} for i in range(1000)]
    result = (
        from_items(rows, 4)
        .map(die_once)
        .deduplicate("id", 2)
        .write_parquet(tmp_path / "out", backend=ray_backend)
    )
    assert marker.exists() and result.retries == 1
    assert result.rows == 10 and result.stages[0].rows_out == 1000
    assert sorted(Path(f).name for f in result.files) == [
        "part-00000-of-00002.parquet",
        "part-00001-of-00002.parquet",
    ]


def test_backends_opened_at_once_in_threads_share_one_ray_connection(ray_backend):
    """Steps run in threads: each may open a RayBackend; none may close Ray under another."""
    import threading

    from keel.flow.backends.ray import RayBackend

    counts, errors = [], []

    def job():
        try:
            backend = RayBackend(workers=2)
            try:
                counts.append(from_items([{"n": i} for i in range(50)], 2).count(backend=backend))
            finally:
                backend.close()
        except Exception as error:  # collected and asserted below
            errors.append(repr(error))

    threads = [threading.Thread(target=job) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and counts == [50, 50, 50]
    assert from_items([{"n": 1}]).count(backend=ray_backend) == 1  # still connected


def test_a_command_running_many_steps_starts_ray_once():
    """`keel run --backend ray` keeps one Ray for all its steps: closing one step's backend and
    opening the next one's neither shuts Ray down nor starts it again (starting it again for a
    later step made Ray's driver abort, "Tried to create an owned object that already exists")."""
    script = """
import ray
from keel.flow import from_items
from keel.flow.backends.ray import RayBackend, keep_ray_until_exit

keep_ray_until_exit()
first = RayBackend(workers=1)
assert from_items([{"n": 1}]).count(backend=first) == 1
first.close()
assert ray.is_initialized()
node = ray.get_runtime_context().get_node_id()
second = RayBackend(workers=1)
assert from_items([{"n": 2}]).count(backend=second) == 1
second.close()
assert ray.get_runtime_context().get_node_id() == node
print("one ray")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "one ray" in done.stdout
