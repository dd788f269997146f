"""A tiny scaling ladder of real training runs on CPU, fitted, and runs checked against it.

3 budgets (1.5e10, 4e10, 1e11 FLOPs) x 3 one-layer widths of a 512-id model on the Wikipedia
test cache, chosen by plan_sweep around N ≈ sqrt(C/120); 9 runs of 150 to 2,500 steps, run two
at a time with two more runs to compare. Measured on a 2-core CPU: the smallest and largest
size of each budget lose to the middle one, a = 0.60 (N* from 8.6e3 to 2.7e4 parameters), ~2
minutes in all; a run trained like the ladder stays within 4% of L(N, D) after its first
quarter, one with a learning rate 100x too small is ~50% above it.
"""

import csv
import json
from dataclasses import replace

import pytest
import typer
from typer.testing import CliRunner

from keel.cli import sweep_commands
from keel.model.config import ModelConfig
from keel.scaling.budget import at_budget
from keel.scaling.ladder import LADDER_FILE, compare_to_ladder, ladder_step, load_ladder
from keel.scaling.sweep import RUNS_COLUMNS, RUNS_FILE, SweepConfig, shaped_config, sweep_steps
from keel.steps import output_path, run
from keel.train.config import Phase, TrainConfig
from keel.train.schedule import ScheduleConfig
from keel.train.steps import train_step

pytestmark = pytest.mark.slow

BASE = TrainConfig(
    model=ModelConfig(
        vocab_size=512, d_model=32, n_layers=1, n_heads=8, n_kv_heads=4, head_dim=4, ffn_dim=96
    ),
    phases=(Phase(seq_len=64, schedule=ScheduleConfig(peak_lr=3e-3, warmup_steps=10)),),
    batch_size=8,
    eval_every=200,
    eval_batches=16,
    checkpoint_every=100_000,
    peak_flops=1e12,  # MFU against a nominal peak: skips timing a matmul in every run
)
SWEEP = SweepConfig(
    base=BASE,
    budgets=(1.5e10, 4e10, 1e11),
    widths=(8, 12, 16, 20, 24, 32, 40, 48, 64),
    depths=(1,),
    points_per_budget=3,
    spacing=2.5,
)
LIKE_THE_LADDER = at_budget(shaped_config(SWEEP, 24, 1), 6e10)
"""A size and budget between the ladder's, trained by the same rules."""
LR_TOO_SMALL = replace(
    LIKE_THE_LADDER,
    phases=(
        replace(
            LIKE_THE_LADDER.phases[0],
            schedule=replace(LIKE_THE_LADDER.phases[0].schedule, peak_lr=3e-3 * 32 / 24 / 100),
        ),
    ),
)


@pytest.fixture(scope="module")
def ladder(wikitext_cache, tmp_path_factory):
    """Train the ladder and the two runs to compare (all steps, two at a time); their outputs."""
    prefix = str(tmp_path_factory.mktemp("ladder"))
    sweep = sweep_steps(SWEEP, (wikitext_cache,))
    fit = ladder_step("ladder", sweep[-1], extrapolate_to=1e13)
    good = train_step("good", replace(LIKE_THE_LADDER, data=sweep[0].config.data))
    bad = train_step("bad", replace(LR_TOO_SMALL, data=sweep[0].config.data))
    report = run([fit, good, bad], prefix, max_parallel=2)
    assert report.ok, report.errors
    return {
        "ladder": output_path(prefix, fit),
        "runs": output_path(prefix, sweep[-1]),
        "good": output_path(prefix, good),
        "bad": output_path(prefix, bad),
    }


def test_the_ladder_has_interior_minima_and_a_plausible_exponent(ladder):
    with open(f"{ladder['runs']}/{RUNS_FILE}") as file:
        rows = list(csv.DictReader(file))
    assert tuple(rows[0]) == RUNS_COLUMNS and len(rows) == 9
    for budget in SWEEP.budgets:
        curve = sorted((int(r["params"]), float(r["loss"])) for r in rows if
                       float(r["budget"]) == budget)  # fmt: skip
        losses = [loss for _, loss in curve]
        assert losses[1] < min(losses[0], losses[2]), (budget, curve)  # the middle size wins
    stored = load_ladder(ladder["ladder"])  # fit_isoflop succeeded: every minimum is interior
    assert 0.2 < stored.a < 0.9, stored.a  # 0.60 measured
    n_opt = [budget.n_opt for budget in stored.budgets]
    assert n_opt == sorted(n_opt)  # bigger budgets want bigger models
    assert stored.frontier is not None and len(stored.law) == 5
    for name in ("isoflops.png", "optimal.png", "predicted_vs_actual.png"):
        with open(f"{ladder['ladder']}/{name}", "rb") as file:
            assert file.read(4) == b"\x89PNG"


def test_a_run_trained_like_the_ladder_passes(ladder):
    comparison = compare_to_ladder(ladder["good"], LIKE_THE_LADDER, ladder["ladder"])
    assert comparison.ok, comparison.summary()
    assert comparison.prediction == "L(N, D)"
    assert abs(comparison.worst.deviation) < 0.05
    final = comparison.points[-1]
    assert final.kind == "eval" and final.step == LIKE_THE_LADDER.steps
    assert abs(final.deviation) < 0.03
    assert not any(p.checked for p in comparison.points if p.step <= 0.25 * final.step)


def test_a_run_with_a_learning_rate_100x_too_small_is_flagged(ladder):
    comparison = compare_to_ladder(ladder["bad"], LR_TOO_SMALL, ladder["ladder"])
    assert not comparison.ok
    assert comparison.worst.deviation > 0.2
    assert all(p.flagged for p in comparison.points if p.checked)
    assert "worse than the ladder predicts by more than 5%" in comparison.summary()
    frontier = compare_to_ladder(ladder["bad"], LR_TOO_SMALL, ladder["ladder"], use="frontier")
    assert not frontier.ok and frontier.prediction == "L*(C)"


def cli():
    app = typer.Typer()
    sweep_commands.register(app)
    return app


def test_the_cli_compares_a_run_against_a_ladder(ladder):
    good = CliRunner().invoke(
        cli(), ["ladder", "--compare", ladder["good"], "--ladder", ladder["ladder"]]
    )
    assert good.exit_code == 0, good.output
    assert "within 5% of the ladder" in good.output
    bad = CliRunner().invoke(
        cli(), ["ladder", "--compare", ladder["bad"], "--ladder", ladder["ladder"], "--json"]
    )
    assert bad.exit_code == 1
    first_line, error = bad.output.splitlines()[0], bad.output.splitlines()[-1]
    assert json.loads(first_line)["ok"] is False
    assert error.startswith("error: ") and "worse than the ladder predicts by more than 5%" in error
    missing = CliRunner().invoke(
        cli(), ["ladder", "--compare", ladder["good"], "--ladder", "/nope"]
    )
    assert missing.exit_code == 2 and missing.output.startswith("error: no ladder at /nope")
    assert (LADDER_FILE, RUNS_FILE) == ("ladder.json", "runs.csv")
