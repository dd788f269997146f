"""Screening variants by their effective compute multiplier: the math on synthetic runs, the
config, and one real screen of tiny training runs through the library and the CLI."""

import csv
import io
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from keel.cli.screen_commands import EXAMPLE, load_screen, register
from keel.core.config import to_dict
from keel.core.errors import ConfigError, UsageError
from keel.model.config import ModelConfig
from keel.model.size import flops_per_token
from keel.scaling.budget import RunPoint
from keel.scaling.screen import (
    BASELINE,
    ScreenConfig,
    fit_baseline,
    read_screen,
    screen,
    screen_steps,
)
from keel.steps import output_path, run
from keel.train.config import DataSource, Phase, TrainConfig
from keel.train.schedule import ScheduleConfig

# ---- the multiplier math on synthetic runs --------------------------------------------------

BUDGETS = (1e12, 2e12, 4e12)


def law(flops: float) -> float:
    """The synthetic baseline: L(C) = 2 + 10·(C/1e12)^-0.3 nats."""
    return 2.0 + 10.0 * (flops / 1e12) ** -0.3


def point(
    flops: float, loss: float, tokens_per_s: float = 1000.0, per_token: float = 6e6
) -> RunPoint:
    """A run that spent `flops` FLOPs at `per_token` FLOPs per token (N = per_token / 6)."""
    tokens = flops / per_token  # not rounded, so that FLOPs per token stay exact
    return RunPoint(int(per_token / 6), tokens, flops, loss, tokens_per_s)  # type: ignore[arg-type]


def baseline(budgets=BUDGETS, speed: float = 1000.0) -> dict[float, RunPoint]:
    return {b: point(b, law(b), speed) for b in budgets}


def one_row(result, name):
    (variant,) = [v for v in result.variants if v.name == name]
    return variant, variant.rows


def test_a_variant_reaching_the_baselines_loss_at_twice_its_compute_is_worth_2x():
    variants = {
        "twice": {1e12: point(1e12, law(2e12))},
        "twice-at-half-speed": {1e12: point(1e12, law(2e12), tokens_per_s=500.0)},
        "worse": {1e12: point(1e12, law(0.5e12))},
    }
    result = screen(baseline(), variants, tolerance=0.05)
    assert result.fit.c == pytest.approx(0.3)
    asymptote = result.fit.E
    assert asymptote == pytest.approx(2.0, abs=1e-4)
    twice, (row,) = one_row(result, "twice")
    assert row.multiplier == pytest.approx(2.0, rel=1e-6) and row.status == "ok"
    assert row.baseline_flops == pytest.approx(2e12, rel=1e-6)
    assert row.throughput_ratio == 1.0 and twice.verdict == "effective"
    slow, (row,) = one_row(result, "twice-at-half-speed")
    assert row.compute_ratio == pytest.approx(2.0, rel=1e-6)
    assert row.throughput_ratio == 0.5 and row.multiplier == pytest.approx(1.0, rel=1e-6)
    assert row.verdict == "neutral" and slow.verdict == "mixed"
    worse, (row,) = one_row(result, "worse")
    assert row.multiplier == pytest.approx(0.5, rel=1e-6) and worse.verdict == "ineffective"
    # the table is sorted by verdict: effective, mixed, ineffective
    assert [v.name for v in result.variants] == ["twice", "twice-at-half-speed", "worse"]


def test_a_variant_better_at_one_budget_and_worse_at_another_is_mixed():
    variants = {"flip": {1e12: point(1e12, law(1.5e12)), 4e12: point(4e12, law(3e12))}}
    variant, rows = one_row(screen(baseline(), variants), "flip")
    assert [r.verdict for r in rows] == ["effective", "ineffective"]
    assert rows[0].multiplier == pytest.approx(1.5) and rows[1].multiplier == pytest.approx(0.75)
    assert variant.verdict == "mixed"


def test_throughput_counts_unless_switched_off():
    variants = {"fast": {b: point(b, law(b), tokens_per_s=1500.0) for b in BUDGETS}}
    variant, rows = one_row(screen(baseline(), variants), "fast")
    assert [r.multiplier for r in rows] == pytest.approx([1.5] * 3)
    assert variant.verdict == "effective"
    variant, rows = one_row(screen(baseline(), variants, use_throughput=False), "fast")
    assert [r.multiplier for r in rows] == pytest.approx([1.0] * 3)
    assert rows[0].throughput_ratio == 1.5 and variant.verdict == "mixed"


def test_the_speed_ratio_is_in_flops_per_second_so_a_costlier_model_is_charged_once():
    # twice the FLOPs per token, so half the tokens/s at the same FLOP/s, and the baseline's loss
    # at the same compute: worth exactly the baseline, not half of it
    wide = {b: point(b, law(b), tokens_per_s=500.0, per_token=12e6) for b in BUDGETS}
    variant, rows = one_row(screen(baseline(), {"wide": wide}), "wide")
    assert [r.throughput_ratio for r in rows] == pytest.approx([1.0] * 3)
    assert [r.multiplier for r in rows] == pytest.approx([1.0] * 3)
    assert rows[0].tokens == pytest.approx(BUDGETS[0] / 12e6)  # half the baseline's tokens
    # the same model running at half the FLOP/s (a slow kernel) is worth half
    slow = {b: point(b, law(b), tokens_per_s=250.0, per_token=12e6) for b in BUDGETS}
    variant, rows = one_row(screen(baseline(), {"slow": slow}), "slow")
    assert [r.multiplier for r in rows] == pytest.approx([0.5] * 3)
    assert variant.verdict == "ineffective"


def test_a_loss_below_the_baselines_asymptote_is_a_bound_not_a_number():
    result = screen(baseline(), {"magic": {1e12: point(1e12, 1.9)}}, max_extrapolation=4.0)
    variant, (row,) = one_row(result, "magic")
    assert row.status == "below_asymptote"
    assert row.multiplier is None and row.baseline_flops is None and row.compute_ratio is None
    # the baseline would need more than 4 x its largest budget: the multiplier is > 16
    assert row.baseline_bound == pytest.approx(16e12) and row.bound == pytest.approx(16.0)
    assert variant.verdict == "effective"
    saved = json.loads(json.dumps(result.to_dict()))
    assert saved["variants"][0]["rows"][0]["multiplier"] is None
    (line,) = csv.DictReader(io.StringIO(result.to_csv()))
    assert line["status"] == "below_asymptote" and line["multiplier"] == ""


def test_multipliers_beyond_the_extrapolation_range_are_bounds():
    variants = {
        "far-better": {1e12: point(1e12, law(50e12))},  # needs 50x: > 4 x the largest budget
        "far-worse": {1e12: point(1e12, law(0.1e12))},  # needs 0.1x: < the smallest / 4
        "slightly-worse": {1e12: point(1e12, law(0.2e12), 5000.0)},  # < range, but 5x faster
    }
    result = screen(baseline(), variants, max_extrapolation=4.0)
    better, (row,) = one_row(result, "far-better")
    assert (row.status, row.multiplier, better.verdict) == ("above_range", None, "effective")
    assert row.bound == pytest.approx(16.0)
    worse, (row,) = one_row(result, "far-worse")
    assert (row.status, row.multiplier, worse.verdict) == ("below_range", None, "ineffective")
    assert row.bound == pytest.approx(0.25)
    fast, (row,) = one_row(result, "slightly-worse")
    assert row.status == "below_range" and row.bound == pytest.approx(1.25)
    assert row.verdict == "undecided" and fast.verdict == "mixed"  # < 1.25 cannot tell


def test_two_budgets_fit_a_line_in_log_log():
    points = {b: point(b, 5.0 * (b / 1e12) ** -0.1) for b in (1e12, 4e12)}
    result = screen(points, {"same": {4e12: point(4e12, 5.0 * 4**-0.1)}})
    asymptote = result.fit.E
    assert asymptote == 0.0 and result.fit.c == pytest.approx(0.1)
    assert result.fit.compute_for(5.0 * 2**-0.1) == pytest.approx(2e12)
    assert result.variants[0].rows[0].multiplier == pytest.approx(1.0)
    assert result.variants[0].verdict == "mixed"


def test_a_fit_that_misses_the_baselines_own_runs_says_by_how_much(caplog):
    # losses that fall faster as compute grows: no E + K·C^-c goes through all three
    points = {1e12: point(1e12, 7.06), 2e12: point(2e12, 6.82), 4e12: point(4e12, 6.40)}
    result = screen(points, {"same": {2e12: point(2e12, 6.82)}}, tolerance=0.05)
    own = result.fit.self_multipliers()
    assert result.fit.rms > 0.003 and max(abs(m - 1) for m in own) > 0.05
    assert result.variants[0].rows[0].multiplier == pytest.approx(own[1])
    assert "misses its own runs by up to" in caplog.text


def test_the_baseline_fit_refuses_one_budget_and_a_loss_that_does_not_fall():
    with pytest.raises(UsageError, match="needs at least 2"):
        fit_baseline([1e12], [3.0])
    with pytest.raises(UsageError, match="does not fall with compute"):
        fit_baseline([1e12, 2e12], [3.0, 3.1])
    with pytest.raises(UsageError, match="does not fall with compute"):
        fit_baseline([1e12, 2e12, 4e12], [3.0, 3.0, 3.0])
    with pytest.raises(UsageError, match="not all positive and finite"):
        fit_baseline([1e12, 2e12], [3.0, math.nan])


# ---- the config --------------------------------------------------------------------------

# tests/train/test_trainer.py's SMALL MoE (a dense model's empty router bias cannot be saved
# in a checkpoint by the trainer yet: Orbax refuses zero-size arrays)
SMALL = ModelConfig(
    vocab_size=512, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64,
    n_routed_experts=4, top_k=2, expert_ffn_dim=32,
)  # fmt: skip


def base_config(cache: str = "cache") -> TrainConfig:
    return TrainConfig(
        model=SMALL,
        data=(DataSource(cache),),
        phases=(Phase(seq_len=32, schedule=ScheduleConfig(peak_lr=3e-3, warmup_steps=2)),),
        batch_size=4,
        eval_batches=4,
        eval_every=1000,
        checkpoint_every=1000,
    )


def test_a_wider_variant_spends_its_budget_on_fewer_tokens():
    wide = {"wide": ("model.expert_ffn_dim=128",)}
    config = ScreenConfig(base_config(), wide, budgets=(6e8, 1.2e9))
    steps = {step.name: step for step in screen_steps(config)}
    assert set(steps) == {
        "screen-baseline-6e08", "screen-baseline-1.2e09", "screen-wide-6e08",
        "screen-wide-1.2e09", "screen",
    }  # fmt: skip
    narrow, wide = steps["screen-baseline-1.2e09"].config, steps["screen-wide-1.2e09"].config
    assert wide.model.expert_ffn_dim == 128 and wide.steps < narrow.steps
    for run_config in (narrow, wide):  # each spends about the budget, by its own FLOPs per token
        tokens = run_config.steps * run_config.batch_size * 32
        assert flops_per_token(run_config.model, 32) * tokens == pytest.approx(1.2e9, rel=0.05)
    report = steps["screen"]
    assert set(report.dependencies) == {s for name, s in steps.items() if name != "screen"}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"budgets": (1e12,)}, "needs at least 2"),
        ({"budgets": (1e12, -1.0)}, "positive FLOP count"),
        ({"variants": {}}, "variants is empty"),
        ({"variants": {BASELINE: ("seed=1",)}}, "variant name 'baseline'"),
        ({"variants": {"x": ("model.d_modle=64",)}}, "variant x: model.d_modle=64: no key"),
        ({"tolerance": 1.5}, "tolerance must be in"),
    ],
)
def test_config_mistakes_are_one_line_errors(changes, message):
    config = replace(ScreenConfig(base_config()), **changes)
    with pytest.raises(ConfigError, match=message):
        screen_steps(config)


def test_a_screen_file_names_its_baseline_by_preset_or_in_full(tmp_path):
    path = tmp_path / "screen.yaml"
    path.write_text(EXAMPLE)
    config = load_screen(str(path))  # the example in --help
    assert config.base.model.d_model == 128 and config.base.eval_batches == 4
    assert config.variants["lr-x3"] == ("phases.0.schedule.peak_lr=9e-3",)
    assert config.budgets == (1e12, 2e12, 4e12)
    full = {"base": to_dict(base_config()), "variants": {"seed-1": ["seed=1"]}, "budgets": [1, 2]}
    path.write_text(yaml.safe_dump(full))
    assert load_screen(str(path)).base == base_config()
    path.write_text(yaml.safe_dump({**full, "preset": "tiny-moe"}))
    with pytest.raises(ConfigError, match="`preset` or as `base`, not both"):
        load_screen(str(path))
    path.write_text("variants: {a: [seed=1]}\n")
    with pytest.raises(ConfigError, match="name the baseline"):
        load_screen(str(path))


# ---- a real screen ------------------------------------------------------------------------


def cli(*args: str):
    app = typer.Typer()

    @app.callback()
    def scaling() -> None:
        """The `keel scaling` group."""

    register(app)
    return CliRunner().invoke(app, ["screen", *args])


@pytest.fixture(scope="module")
def real_screen(wikitext_cache, tmp_path_factory):
    """A SMALL baseline, a copy of it and a 30x too small learning rate, at 2 budgets."""
    config = ScreenConfig(
        base_config(wikitext_cache),
        variants={"copy": (), "lr-div30": ("phases.0.schedule.peak_lr=1e-4",)},
        budgets=(3e9, 6e9),  # 100 and 200 steps (each run's time is mostly its compilation)
    )
    prefix = str(tmp_path_factory.mktemp("screen"))
    steps = screen_steps(config)
    report = run(steps, prefix)
    assert report.ok, report.errors
    return config, prefix, read_screen(output_path(prefix, steps[-1]))


@pytest.mark.slow
def test_a_real_screen_finds_the_small_learning_rate_ineffective(real_screen):
    _, _, result = real_screen
    variants = {v["name"]: v for v in result["variants"]}
    assert [v["name"] for v in result["variants"]] == ["copy", "lr-div30"]
    assert variants["lr-div30"]["verdict"] == "ineffective"
    for row in variants["lr-div30"]["rows"]:
        assert row["multiplier"] is None or row["multiplier"] < 0.95
        assert (row["bound"] or row["multiplier"]) < 0.95
    # the copy trains exactly as the baseline: the same loss, so the same compute
    baseline_loss = {p["flops"]: p["loss"] for p in result["baseline"]}
    for row in variants["copy"]["rows"]:
        assert row["loss"] == pytest.approx(baseline_loss[row["flops"]], rel=1e-6)
        assert row["compute_ratio"] == pytest.approx(1.0, rel=1e-3)
        assert row["multiplier"] == pytest.approx(row["throughput_ratio"], rel=1e-3)
    assert result["fit"]["c"] > 0 and len(result["baseline"]) == 2


@pytest.mark.slow
def test_the_screen_command_reuses_the_runs_and_can_leave_throughput_out(real_screen, tmp_path):
    config, prefix, saved = real_screen
    path = tmp_path / "screen.yaml"
    variants = {name: list(overrides) for name, overrides in config.variants.items()}
    spec = {"base": to_dict(config.base), "variants": variants, "budgets": list(config.budgets)}
    path.write_text(yaml.safe_dump(spec))
    table = cli(str(path), "--prefix", prefix)
    assert table.exit_code == 0, table.output
    assert "lr-div30" in table.stdout and "ineffective" in table.stdout
    assert "baseline: the FLOPs the baseline needs" in table.stdout
    # without the (noisy, on a shared CPU) tokens/s ratio, the copy is exactly neutral
    path.write_text(yaml.safe_dump({**spec, "use_throughput": False}))
    result = cli(str(path), "--prefix", prefix, "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    verdicts = {v["name"]: v["verdict"] for v in printed["variants"]}
    assert verdicts == {"copy": "mixed", "lr-div30": "ineffective"}
    (copy,) = [v for v in printed["variants"] if v["name"] == "copy"]
    assert [row["verdict"] for row in copy["rows"]] == ["neutral", "neutral"]
    assert printed["fit"] == saved["fit"]
    # the training runs came from the cache: one more report, no new runs
    assert len(list(Path(prefix).glob("screen-*"))) == 6 + 2


def test_the_screen_command_reports_a_bad_config_in_one_line(tmp_path):
    path = tmp_path / "screen.yaml"
    path.write_text("preset: tiny-moe\nvariants: {a: [seed=1]}\nbudgets: [1e12]\n")
    result = cli(str(path), "--prefix", str(tmp_path))
    assert result.exit_code == 2
    assert result.output.startswith("error:") and result.output.count("\n") == 1
    assert "needs at least 2" in result.output
