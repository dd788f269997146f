"""A run directory on object storage, against a real S3 server on localhost (moto,
tests/s3_support.py): a train step of `keel run --prefix s3://...` SIGKILLed after its checkpoint
at step 10 reached the bucket resumes from that checkpoint when run again, and every later loss
equals the uninterrupted run's exactly; the finished run's files are all in the bucket and
nothing was written to a local folder named after the URL. Another run starts from it with
`keel train --set init_from=s3://...`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import fsspec
from mesh_support import assert_same_losses, tiny_moe, write_config

from keel.core import paths
from keel.train.checkpoint import CHECKPOINTS_DIR
from keel.train.run_dir import RunMirror
from keel.train.trainer import METRICS_FILE

KEEL = [sys.executable, "-m", "keel"]
CHECKPOINT = 10  # tiny_moe checkpoints every 10 steps of 20


def _committed(fs, url: str) -> list[int]:
    """The checkpoint steps the run has uploaded completely ([] before the first)."""
    try:
        return json.loads(fs.cat_file(f"{url}/checkpoints/committed.json"))["steps"]
    except FileNotFoundError:
        return []


def _metrics(fs, url: str) -> list[dict]:
    text = fs.cat_file(f"{url}/metrics.jsonl").decode()
    return [json.loads(line) for line in text.splitlines()]


EXPERIMENT = """
from keel.core.config import load_config
from keel.train.config import TrainConfig
from keel.train.steps import train_step

STEPS = [train_step("train", load_config({config!r}, TrainConfig))]
"""


def _one(fs, pattern: str) -> str | None:
    """The one s3:// URL matching `pattern` (None: none yet), listed afresh."""
    fs.invalidate_cache()
    found = fs.glob(pattern)
    assert len(found) <= 1, found
    return f"s3://{found[0]}" if found else None


def test_a_killed_train_step_on_s3_resumes_from_its_uploaded_checkpoint(
    s3, one_device_run, wikitext_cache, tmp_path
):
    """`keel run --prefix s3://...`: the train step's run directory (its work directory) is in
    the bucket; SIGKILLed after checkpoint 10 was uploaded, the rerun resumes from it."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    prefix = s3.url("prefix")
    config = write_config(tiny_moe(wikitext_cache), tmp_path / "run.yaml")
    experiment = tmp_path / "experiment.py"
    experiment.write_text(EXPERIMENT.format(config=str(config)))
    command = [*KEEL, "run", str(experiment), "--prefix", prefix]

    first = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while (work := _one(fs, f"{prefix}/.keel/steps/train-*/work")) is None or (
        CHECKPOINT not in _committed(fs, work)
    ):
        assert first.poll() is None, first.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint reached the bucket in 240 s"
        time.sleep(0.05)
    first.kill()
    first.communicate(timeout=60)
    assert _committed(fs, work) == [CHECKPOINT], "the run ended before the kill"
    assert [row["step"] for row in _metrics(fs, work)] == list(range(1, CHECKPOINT + 1))

    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"from step {CHECKPOINT}" in again.stderr  # resumed, not restarted from step 0
    url = _one(fs, f"{prefix}/train-*")
    assert_same_losses(_metrics(fs, url), one_device_run)
    result = json.loads(fs.cat_file(f"{url}/result.json"))
    assert result["step"] == one_device_run[-1]["step"]
    assert fs.exists(f"{url}/config.yaml") and _committed(fs, url) == [10, 20]
    assert _one(fs, f"{prefix}/.keel/steps/train-*/work") is None  # removed after the commit
    assert not list(tmp_path.glob("s3*")), "wrote to a local folder named after the URL"

    # A new run starts from the remote run's parameters (init_from), leaving it untouched.
    before = {path: fs.info(path)["ETag"] for path in fs.find(url)}
    child = tmp_path / "child"
    one_step = ["--steps", "1", "--set", "phases.0.schedule.warmup_steps=1"]
    started = subprocess.run(
        [*KEEL, "train", str(config), *one_step, "--set", f"init_from={url}", "--output", child],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    lines = (child / "metrics.jsonl").read_text().splitlines()
    (first_line,) = [json.loads(line) for line in lines]
    # trained parameters: far below a fresh model's first loss (about ln 512 = 6.2)
    assert first_line["loss"] < one_device_run[0]["loss"] - 1.0, first_line
    assert {path: fs.info(path)["ETag"] for path in fs.find(url)} == before


def test_a_partial_upload_is_never_resumed_from_and_is_replaced(tmp_path):
    """A run killed while uploading checkpoint 20: the bucket holds part of checkpoints/20 but
    committed.json still names 10, so a start downloads 10; the next upload of 20 replaces the
    partial files instead of mixing with them."""
    run_dir = f"memory://keel-test/{tmp_path.name}/run"
    mirror = RunMirror(run_dir, CHECKPOINTS_DIR)
    for step, files in ((10, ["a", "b"]), (20, ["c", "d"])):
        for name in files:
            (mirror.local / CHECKPOINTS_DIR / str(step) / name).parent.mkdir(
                parents=True, exist_ok=True
            )
            (mirror.local / CHECKPOINTS_DIR / str(step) / name).write_text(f"{step} {name}")
    (mirror.local / METRICS_FILE).write_text('{"step": 10}\n')
    mirror.commit([METRICS_FILE], 10, [10])
    paths.write_text(paths.join(run_dir, CHECKPOINTS_DIR, "20", "stale"), "partial upload")

    again = RunMirror(run_dir, CHECKPOINTS_DIR)
    assert again.committed_steps() == [10]
    again.fetch([METRICS_FILE], 10)
    assert (again.local / METRICS_FILE).read_text() == '{"step": 10}\n'
    assert (again.local / CHECKPOINTS_DIR / "10" / "b").read_text() == "10 b"
    mirror.commit([METRICS_FILE], 20, [20])  # keep_checkpoints=1: 10 is dropped remotely too
    assert again.committed_steps() == [20]
    assert paths.list_dir(paths.join(run_dir, CHECKPOINTS_DIR)) == ["20", "committed.json"]
    assert paths.list_dir(paths.join(run_dir, CHECKPOINTS_DIR, "20")) == ["c", "d"]
    mirror.close()
    again.close()
    assert not mirror.local.exists() and not again.local.exists()
