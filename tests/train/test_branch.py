"""Branches: `keel train --from RUN:STEP` continues RUN's whole state at STEP under its own config
(with RUN's config: RUN's own losses, exactly), never writes to RUN, records its parent, and
refuses a run or step that does not exist in one line listing the steps that do."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from mesh_support import small_dense

from keel.core.config import dump_config
from keel.telemetry import TelemetryStore
from keel.train.branch import BranchPoint
from keel.train.trainer import train

KEEL = [sys.executable, "-m", "keel"]


def tiny(cache: str):
    config = replace(
        small_dense(),
        steps=30,
        eval_every=1000,
        checkpoint_every=10,
        keep_checkpoints=1,
        keep_every=10,
    )
    return config.with_data((cache,))


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def losses(run: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines}


@pytest.fixture(scope="module")
def parent(wikitext_cache, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("parent") / "run"
    train(tiny(wikitext_cache), str(run))
    return run


def test_keep_every_keeps_older_checkpoints_for_branches(parent):
    kept = sorted(int(p.name) for p in (parent / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [10, 20, 30]  # keep_checkpoints=1, and every 10th kept for good


def test_a_branch_with_the_parents_config_reproduces_its_losses(parent, wikitext_cache, tmp_path):
    before = tree_digest(parent)
    branch = tmp_path / "branch"
    telemetry = tmp_path / "telemetry"
    reported = replace(tiny(wikitext_cache), telemetry=str(telemetry))  # not part of identity
    train(reported, str(branch), branch=BranchPoint(str(parent), 20))
    got, want = losses(branch), losses(parent)
    assert sorted(got) == list(range(21, 31))
    assert [got[step] for step in range(21, 31)] == [want[step] for step in range(21, 31)]
    assert tree_digest(parent) == before  # the parent is only read

    lineage = subprocess.run(
        [*KEEL, "runs", "lineage", str(branch), "--json"], capture_output=True, text=True
    )
    assert lineage.returncode == 0, lineage.stderr
    (link,) = json.loads(lineage.stdout)["lineage"]
    assert (link["run"], link["parent"], link["step"]) == (str(branch), str(parent), 20)
    with TelemetryStore(telemetry) as store:
        rows = store.query('SELECT run, event, parent, step FROM "train.events"').to_pylist()
    assert rows == [{"run": str(branch), "event": "branch", "parent": str(parent), "step": 20}]
    alone = subprocess.run([*KEEL, "runs", "lineage", str(parent)], capture_output=True, text=True)
    assert "started from scratch" in alone.stdout


@pytest.mark.parametrize(
    ("point", "message"),
    [
        ("{parent}:15", "has no checkpoint at step 15; its checkpoints: 10, 20, 30"),
        ("{parent}-missing:10", "holds no keel run"),
        ("{parent}", "expected RUN:STEP"),
    ],
)
def test_a_branch_point_that_does_not_exist_is_one_line(
    parent, wikitext_cache, tmp_path, point, message
):
    config = tmp_path / "run.yaml"
    dump_config(tiny(wikitext_cache), str(config))
    done = subprocess.run(
        [*KEEL, "train", str(config), "--from", point.format(parent=parent), "--output", "b"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert message in line
    assert not (tmp_path / "b").exists()  # refused before anything is written
