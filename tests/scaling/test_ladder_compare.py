"""`keel scaling ladder --compare RUN`: like with like, better is not a failure, worse is one line.

A ladder.json with a known L(N, D) and run directories whose losses sit a chosen factor from it:
no training, so each case is exact and fast (tests/scaling/test_ladder.py does it with real
runs)."""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from keel.cli import sweep_commands
from keel.core.config import dump_config
from keel.model.config import ModelConfig
from keel.scaling.budget import fit_size
from keel.scaling.family import ModelFamily
from keel.scaling.ladder import (
    LADDER_FILE,
    Ladder,
    LadderBudget,
    compare_to_ladder,
    ladder_step,
)
from keel.scaling.sweep import SweepConfig, sweep_steps
from keel.train.presets import preset
from keel.train.trainer import CONFIG_FILE, METRICS_FILE

LADDER = Ladder(
    budgets=(LadderBudget(1e12, 1e5, 1e6, 5.0),),
    a=0.5, b=0.5, G=1.0, H=1.0, a_interval=(0.45, 0.55), frontier=None,
    law=(2.0, 400.0, 20.0, 0.34, 0.28), runs=9,
    family=ModelFamily("dense", (1,), 4096),
)  # fmt: skip
TINY_DENSE = replace(preset("tiny-dense"), steps=400)
"""4 layers: not of the ladder's one-layer family."""
ONE_LAYER = replace(TINY_DENSE, model=replace(TINY_DENSE.model, n_layers=1))


def write_ladder(root: Path, ladder: Ladder = LADDER) -> str:
    root.mkdir()
    data = ladder.to_dict()
    if ladder.family is None:
        del data["family"]  # as an older keel wrote it
    (root / LADDER_FILE).write_text(json.dumps(data))
    return str(root)


def write_run(root: Path, config, eval_factor: float, train_factor: float) -> str:
    """A run directory whose held-out losses are eval_factor x the ladder's prediction and
    training losses train_factor x (evaluations every 50 of 400 steps)."""
    root.mkdir()
    dump_config(config, str(root / CONFIG_FILE))
    rows, params = [], fit_size(config)
    for step in range(1, config.steps + 1):
        tokens = step * config.batch_size * config.phases[0].seq_len
        predicted = float(LADDER.law_loss(params, tokens))
        row = {"step": step, "phase": "main", "loss": predicted * train_factor}
        row["cross_entropy"] = row["loss"]
        if step % 50 == 0:
            row["eval_loss"] = predicted * eval_factor
        rows.append(json.dumps(row))
    (root / METRICS_FILE).write_text("\n".join(rows) + "\n")
    return str(root)


def compare(run: str, ladder: str, *extra: str):
    app = typer.Typer()
    sweep_commands.register(app)
    return CliRunner().invoke(app, ["ladder", "--compare", run, "--ladder", ladder, *extra])


def test_a_run_that_beats_the_prediction_passes_as_better_and_a_family_mismatch_warns(tmp_path):
    ladder = write_ladder(tmp_path / "ladder")
    run = write_run(tmp_path / "train-tiny-dense", TINY_DENSE, eval_factor=0.943, train_factor=0.9)
    result = compare(run, ladder)
    assert result.exit_code == 0, result.output
    summary = (
        "better than the ladder predicts: -5.7% at step 400 (eval loss {}); no point more "
        "than 5% above it"
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("better than")]
    assert len(lines) == 1, result.stdout  # the summary, once
    assert lines[0].startswith(summary.split("{}")[0]) and lines[0].endswith(summary.split("{}")[1])
    assert "error" not in result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: the run's model (4 layers, not 1) is not of the ladder's family (dense, 1 "
        "layer, 4,096 ids): its prediction is for another kind of model; compare with a ladder "
        "of this run's family (keel scaling sweep) for a like-with-like check"
    ]


def test_a_run_worse_than_the_tolerance_fails_in_one_line(tmp_path):
    ladder = write_ladder(tmp_path / "ladder")
    run = write_run(tmp_path / "run", ONE_LAYER, eval_factor=1.08, train_factor=1.08)
    result = compare(run, ladder)
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"error: {run}: 300 of 300 points are worse than the ladder")
    assert re.search(r"predicts by more than 5%; worst \+8\.\d% at step \d+ \(", errors[0])
    assert "worse than the ladder" not in result.stdout  # the summary is the error line only
    assert "warning" not in result.stderr  # one layer, dense, 4,096 ids: the ladder's family

    as_json = compare(run, ladder, "--json")
    data = json.loads(as_json.stdout)
    assert (as_json.exit_code, data["ok"], data["verdict"]) == (1, False, "worse")


@pytest.mark.parametrize(
    ("eval_factor", "train_factor", "verdict"),
    [(1.03, 1.03, "within"), (0.97, 0.85, "within"), (0.9, 1.02, "better"), (1.0, 1.06, "worse")],
)
def test_only_losses_above_the_prediction_fail(tmp_path, eval_factor, train_factor, verdict):
    run = write_run(tmp_path / "run", ONE_LAYER, eval_factor, train_factor)
    comparison = compare_to_ladder(run, ONE_LAYER, LADDER)
    assert comparison.verdict == verdict, comparison.summary()
    assert comparison.ok == (verdict != "worse")
    starts = {"within": "within 5% of the ladder", "better": "better than the ladder predicts",
              "worse": "294 of 300 points are worse than the ladder"}  # fmt: skip
    assert comparison.summary().startswith(starts[verdict]), comparison.summary()


def test_a_ladder_without_a_recorded_family_says_to_rebuild_it(tmp_path):
    ladder = write_ladder(tmp_path / "ladder", replace(LADDER, family=None))
    run = write_run(tmp_path / "run", ONE_LAYER, eval_factor=1.0, train_factor=1.0)
    result = compare(run, ladder)
    assert result.exit_code == 0, result.output
    assert "does not record its model family" in result.stderr


def test_the_ladder_step_records_its_sweeps_model_family():
    base = replace(
        preset("tiny-dense"),
        model=ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=8, n_kv_heads=4,
                          head_dim=4, ffn_dim=96),
        phases=(replace(preset("tiny-dense").phases[0], seq_len=64),),
        batch_size=8,
    )  # fmt: skip
    sweep = SweepConfig(base=base, budgets=(1.5e10, 4e10, 1e11), widths=(8, 16, 24, 32, 48, 64),
                        depths=(1,), points_per_budget=3, spacing=2.5)  # fmt: skip
    family = ladder_step("ladder", sweep_steps(sweep)[-1]).config.family
    assert family == ModelFamily("dense", (1,), 512)
    assert family.differences(base.model) == []
    moe = replace(base.model, n_routed_experts=4, top_k=2, n_layers=3, vocab_size=4096)
    assert family.differences(moe) == ["moe, not dense", "3 layers, not 1", "4,096 ids, not 512"]
