"""`keel runs report RUN`: a tiny-moe run of two phases (seq_len 32, then 64) at capacities low
enough to drop, reported per phase and context length; its numbers are the means of
metrics.jsonl's lines. One MoE run and one dense run are trained once for the file."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest
from mesh_support import metrics, small_dense

from keel.core.config import apply_overrides
from keel.core.errors import UsageError
from keel.model.sharding import MeshConfig
from keel.train.presets import preset
from keel.train.run_report import run_report
from keel.train.trainer import train

KEEL = [sys.executable, "-m", "keel"]
SHORT, LONG = 32, 64
EXPERT_PARALLEL = MeshConfig(data=1, fsdp=1, expert=4)
"""Capacities drop only under expert parallelism: 4 of the tests' 8 simulated devices."""


def two_phase_moe(cache: str):
    """tiny-moe, 1 dense + 1 MoE layer, 4 steps at 32 tokens then 3 at 64, expert parallel over
    4 devices at send capacity 1.5 and receive capacity 1.0, so that an untrained router drops
    on both sides; no evaluation."""
    config = apply_overrides(
        preset("tiny-moe"),
        [
            "model.vocab_size=512",
            "model.n_layers=2",
            "batch_size=4",
            "eval_fraction=0",
            "model.send_capacity=1.5",
            "model.receive_capacity=1.0",
        ],
    )
    first = replace(config.phases[0], name="short", seq_len=SHORT, tokens=4 * 4 * SHORT)
    first = replace(first, schedule=replace(first.schedule, warmup_steps=1))
    second = replace(first, name="long", seq_len=LONG, tokens=3 * 4 * LONG)
    config = replace(
        config,
        phases=(first, second),
        steps=0,
        mesh=EXPERT_PARALLEL,
        eval_every=1000,
        checkpoint_every=1000,
    )
    return config.with_data((cache,))


@pytest.fixture(scope="module")
def moe_run(wikitext_cache, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("report") / "moe"
    train(two_phase_moe(wikitext_cache), str(output), devices=jax.devices()[:4])
    return output


@pytest.fixture(scope="module")
def dense_run(wikitext_cache, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("report") / "dense"
    config = small_dense("steps=1", "eval_fraction=0", "checkpoint_every=1000")
    train(config.with_data((wikitext_cache,)), str(output))
    return output


def keel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KEEL, *args], capture_output=True, text=True, timeout=120)


def test_the_report_holds_each_phases_means_of_the_metrics_lines(moe_run):
    lines = metrics(moe_run)
    report = run_report(str(moe_run))
    assert report.router
    assert [(p.name, p.seq_len, p.steps) for p in report.phases] == [
        ("short", SHORT, 4),
        ("long", LONG, 3),
    ]
    for phase in report.phases:
        mine = [line for line in lines if line["phase"] == phase.name]
        for name in ("drop_rate", "drop_rate_send", "drop_rate_recv", "load_max_over_mean"):
            expected = np.mean([line[name] for line in mine])
            assert getattr(phase.router, name) == pytest.approx(expected, rel=1e-9)
        (layer,) = phase.layers  # one MoE layer
        expected = np.mean([line["router"]["drop_rate_recv"][0] for line in mine])
        assert layer.drop_rate_recv == pytest.approx(expected, rel=1e-9)
    for side in ("drop_rate_send", "drop_rate_recv"):  # both capacities drop
        assert sum(getattr(phase.router, side) for phase in report.phases) > 0
    context = {row.seq_len: row for row in report.by_seq_len}
    assert sorted(context) == [SHORT, LONG]
    assert context[LONG].drop_rate == pytest.approx(report.phases[1].router.drop_rate)


def test_the_cli_prints_tables_json_and_a_plot(moe_run, tmp_path):
    text = keel("runs", "report", str(moe_run))
    assert text.returncode == 0, text.stderr
    for heading in ("router per phase", "per MoE layer", "drops by context length", "short"):
        assert heading in text.stdout

    plot = tmp_path / "report.png"
    answer = keel("runs", "report", str(moe_run), "--json", "--plot", str(plot))
    assert answer.returncode == 0, answer.stderr
    data = json.loads(answer.stdout)  # one object, nothing else on stdout
    assert data["router"] is True
    assert [row["seq_len"] for row in data["by_seq_len"]] == [SHORT, LONG]
    expected = run_report(str(moe_run)).phases[1].router.drop_rate_send
    assert data["phases"][1]["router"]["drop_rate_send"] == pytest.approx(expected)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_dense_run_says_it_has_no_router_and_shows_its_phases(dense_run):
    text = keel("runs", "report", str(dense_run))
    assert text.returncode == 0, text.stderr
    assert "dense run: no router" in text.stdout
    report = run_report(str(dense_run))
    assert not report.router and report.by_seq_len == ()
    assert [(phase.steps, phase.router) for phase in report.phases] == [(1, None)]


def test_a_missing_or_empty_run_is_one_error_line(tmp_path):
    missing = keel("runs", "report", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert missing.stderr.strip().startswith("error:") and "not a run directory" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    (tmp_path / "config.yaml").write_text("steps: 3\n")  # a run that has not finished a step
    with pytest.raises(UsageError, match=r"has no metrics\.jsonl"):
        run_report(str(tmp_path))
