"""A prefix with two tiny training runs, the quickstart's data stages and one finished job, and
beside it experiments/ with two records (one reported), built once per session; the dashboard
served over it by `keel dashboard`; headless Chromium."""

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from browser import chromium
from dashboard_support import JOB_OUTPUT, KEEL, RECORDS, RUNS, keel
from quickstart_support import copy_quickstart_outputs, earlier_quickstart


@pytest.fixture(scope="session")
def prefix(tmp_path_factory) -> Path:
    """keel-out/ with train-a and train-b (3 steps of tiny-dense each, metrics in
    keel-out/telemetry), the data stages they trained on and a job run through the controller."""
    work = tmp_path_factory.mktemp("dashboard")
    prefix = work / "keel-out"
    prefix.mkdir()
    _copy_quickstart_data(prefix)
    cluster = str(prefix / "cluster")
    job = keel("job", "run", "--root", cluster, "--", "sh", "-c", f"echo {JOB_OUTPUT}", cwd=work)
    telemetry = {"KEEL_TELEMETRY": str(prefix / "telemetry")}
    for name, extra in RUNS.items():  # one after the other: a telemetry store has one writer
        keel(
            "train", "--preset", "tiny-dense", "--steps", "3", "--prefix", str(prefix),
            "--output", str(prefix / name), *extra, cwd=work, env=telemetry,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while (
        "succeeded"
        not in keel("job", "status", job.stdout.strip(), "--root", cluster, cwd=work).stdout
    ):
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.3)
    keel("cluster", "stop", "--root", cluster, cwd=work)
    for name, hypothesis in RECORDS.items():
        keel("experiment", "new", name, "--hypothesis", hypothesis, cwd=work)
    reported = keel("experiment", "list", "--json", cwd=work)
    keel("experiment", "report", json.loads(reported.stdout)["experiments"][0]["id"], cwd=work)
    return prefix


def _copy_quickstart_data(prefix: Path) -> None:
    """With a quickstart prefix at hand (CI), its committed data stages: the training's data
    steps are then cache hits."""
    if source := earlier_quickstart(checkout_fallback=False):
        copy_quickstart_outputs(source, prefix, keep=lambda out: (out / "stage.json").is_file())


@pytest.fixture(scope="session")
def dashboard(prefix):
    """`keel dashboard --root PREFIX --port 0` in a subprocess: its URL."""
    log = prefix.parent / "dashboard.log"
    records = str(prefix.parent / "experiments")
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [*KEEL, "dashboard", "--root", str(prefix), "--port", "0", "--experiments", records],
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 60
        while not (match := re.search(r"at (http://\S+?)/? ", log.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="session")
def browser():
    with chromium() as driver:
        yield driver
