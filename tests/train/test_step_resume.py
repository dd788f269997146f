"""A training run inside a step (`keel run`) SIGKILLed after a checkpoint resumes from that
checkpoint when the experiment runs again; SIGTERMed, it first checkpoints the step it is at and
the rerun resumes from there. Either way the losses equal the uninterrupted run's exactly, the
committed output holds the whole run (metrics and checkpoints) and the step's work directory is
gone once the output is committed."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mesh_support import assert_same_losses, metrics, tiny_moe, write_config

KEEL = [sys.executable, "-m", "keel"]
KILL_AFTER_STEP = 12  # past the checkpoint at step 10 (tiny_moe checkpoints every 10 steps)

EXPERIMENT = """
from keel.core.config import load_config
from keel.train.config import TrainConfig
from keel.train.steps import train_step

STEPS = [train_step("train", load_config({config!r}, TrainConfig))]
"""


def _steps_written(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def _work_dirs(prefix: Path) -> list[Path]:
    return sorted((prefix / ".keel" / "steps").glob("train-*/work"))


@pytest.mark.parametrize("sent", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_train_step_resumes_from_its_checkpoint(
    sent, one_device_run, wikitext_cache, tmp_path
):
    config = write_config(tiny_moe(wikitext_cache), tmp_path / "run.yaml")
    experiment = tmp_path / "experiment.py"
    experiment.write_text(EXPERIMENT.format(config=str(config)))
    prefix = tmp_path / "out"
    command = [*KEEL, "run", str(experiment), "--prefix", str(prefix)]

    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (work := _work_dirs(prefix)) or _steps_written(work[0]) < KILL_AFTER_STEP:
        assert first.poll() is None, first.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the step did not reach step 12 in 240 s"
        time.sleep(0.2)
    first.send_signal(sent)
    _, said = first.communicate(timeout=120)
    resumes_from = 10  # the last checkpoint before the kill
    if sent == signal.SIGTERM:  # the step checkpoints where it is and fails; keel run exits 1
        assert first.returncode == 1, said[-3000:]
        stopped = re.search(r"stopped by SIGTERM after step (\d+)", said)
        assert stopped, said[-3000:]
        resumes_from = int(stopped[1])
        assert KILL_AFTER_STEP <= resumes_from < 20

    again = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"from step {resumes_from}" in again.stderr  # resumed, not restarted from step 0
    (output,) = [path for path in prefix.glob("train-*") if path.is_dir()]
    assert_same_losses(metrics(output), one_device_run)
    assert (output / "checkpoints").is_dir()  # committed with the run, for init_from
    assert _work_dirs(prefix) == []
