"""What the dashboard tests share besides fixtures (a module named conftest would clash with
tests/cli's when both directories run): the keel command, the job's output, the store's loss."""

import os
import subprocess
import sys

from keel.telemetry import TelemetryStore
from keel.telemetry.sink import METRICS_NAMESPACE

KEEL = [sys.executable, "-m", "keel"]
RUNS = {"train-a": [], "train-b": ["--set", "optimizer.clip_norm=0.5"]}
"""Two runs whose configs differ in one key (and in the output path)."""
JOB_OUTPUT = "hello from the job"
RECORDS = {
    "clip-norm": "clipping gradients at 0.5 changes nothing in 3 steps",
    "longer-warmup": "a longer warmup lowers the loss spike",
}
"""Two experiment records; the first has a report (`keel experiment report`)."""


def keel(*args, cwd, env=None, timeout=300):
    result = subprocess.run(
        [*KEEL, *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def store_loss(prefix, run):
    """[steps, losses] of `run` in the prefix's telemetry store, ascending."""
    with TelemetryStore(prefix / "telemetry") as store:
        rows = store.query(
            f"SELECT step, value FROM \"{METRICS_NAMESPACE}\" WHERE run = '{run}' "
            "AND name = 'loss' ORDER BY step"
        ).to_pydict()
    return [rows["step"], rows["value"]]
