"""Failures during a run: killed workers and flaky functions are retried without losing rows."""

import os
import signal
from pathlib import Path

import pytest

from keel.flow import LocalBackend, TaskFailedError, from_items

ROWS = [{"id": i % 97, "n": i, "text": f"document {i}"} for i in range(5000)]


def _pipeline(marker: Path | None):
    def maybe_die(row):
        # On the first attempt, the worker running row 2600 (mid-way through shard 1) is killed.
        if marker is not None and row["n"] == 2600 and not marker.exists():
            marker.write_text("killed once")
            os.kill(os.getpid(), signal.SIGKILL)
        return {**row, "length": len(row["text"])}

    return (
        from_items(ROWS, num_shards=4)
        .map(maybe_die)
        .group_by(
            "id",
            lambda key, rows: {"id": key, "count": len(rows), "total": sum(r["n"] for r in rows)},
            3,
        )
    )


def test_sigkilled_worker_task_is_retried_and_output_equals_an_undisturbed_run(tmp_path):
    marker = tmp_path / "killed"
    with LocalBackend(workers=2) as backend:
        disturbed = _pipeline(marker).write_parquet(
            tmp_path / "disturbed", backend=backend, chunk_rows=100
        )
    assert marker.exists()  # the kill happened
    assert disturbed.retries == 1
    with LocalBackend(workers=2) as backend:
        clean = _pipeline(None).write_parquet(tmp_path / "clean", backend=backend, chunk_rows=100)
    assert clean.retries == 0
    assert [Path(f).name for f in disturbed.files] == [Path(f).name for f in clean.files]
    for left, right in zip(disturbed.files, clean.files, strict=True):
        assert Path(left).read_bytes() == Path(right).read_bytes()
    assert (
        disturbed.stages[0].rows_out == clean.stages[0].rows_out == 5000
    )  # nothing lost or doubled


def test_a_worker_killed_on_every_attempt_fails_the_run_naming_the_task(tmp_path):
    def always_die(row):
        if row["n"] == 10:
            os.kill(os.getpid(), signal.SIGKILL)
        return row

    with LocalBackend(workers=2) as backend, pytest.raises(TaskFailedError) as caught:
        from_items(ROWS, 4).map(always_die).count(backend=backend, retries=2)
    message = str(caught.value)
    assert "task 0 (items shard 0 of 4)" in message
    assert "after 3 attempts" in message and "killed by SIGKILL" in message


def test_a_flaky_function_succeeds_on_retry(tmp_path):
    marker = tmp_path / "failed-once"

    def flaky(row):
        if row["n"] == 7 and not marker.exists():
            marker.write_text("x")
            raise ConnectionError("transient")
        return row

    with LocalBackend(workers=2) as backend:
        result = from_items(ROWS, 4).map(flaky).write_parquet(tmp_path / "o", backend=backend)
    assert result.retries == 1 and result.rows == 5000
