"""The Ray backend, on a real local Ray instance: same output as local, retries on worker death."""

import os
import signal
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
