"""isoFLOP sweep plans: sizes bracket each budget's prior optimum, D = C / FLOPs per token, one
train step per point plus the step writing runs.csv; impossible sweeps fail naming the budget."""

import json
import math
from dataclasses import replace

import pytest
import typer
import yaml
from typer.testing import CliRunner

from keel.cli import sweep_commands
from keel.core.config import to_dict
from keel.core.errors import ConfigError
from keel.model.config import ModelConfig
from keel.model.size import flops_per_token, model_size
from keel.scaling.sweep import (
    RUNS_FILE,
    SweepConfig,
    budget_tag,
    plan_sweep,
    scale_model,
    shaped_config,
    sweep_steps,
)
from keel.steps import StepRef
from keel.train.config import Phase, TrainConfig
from keel.train.schedule import ScheduleConfig

DENSE = ModelConfig(
    vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=96
)
MOE = replace(
    DENSE, n_routed_experts=8, top_k=2, n_shared_experts=1, expert_ffn_dim=32, n_dense_layers=1
)
BASE = TrainConfig(
    model=DENSE,
    phases=(Phase(seq_len=64, schedule=ScheduleConfig(peak_lr=3e-3, warmup_steps=10)),),
    batch_size=8,
)
SWEEP = SweepConfig(
    base=BASE,
    budgets=(1e10, 3e10, 1e11, 3e11),
    widths=(8, 16, 24, 32, 48, 64, 96, 128),
    depths=(1, 2, 4),
    points_per_budget=4,
)


def prior(flops: float, ratio: float = 20.0) -> float:
    return math.sqrt(flops / (6 * ratio))


@pytest.mark.parametrize("base_model", [DENSE, MOE], ids=["dense", "moe"])
def test_each_budget_brackets_its_prior_optimum(base_model):
    sweep = replace(SWEEP, base=replace(BASE, model=base_model), depths=(2, 4))
    points = plan_sweep(sweep)
    assert len(points) == 4 * len(sweep.budgets)
    for budget in sweep.budgets:
        sizes = [p.params for p in points if p.budget == budget]
        assert len(set(sizes)) == 4 and sizes == sorted(sizes)
        assert min(sizes) < prior(budget) < max(sizes)
        assert max(sizes) / min(sizes) > 3  # log-spaced around it, not bunched


def test_tokens_are_the_budget_over_flops_per_token():
    for point in plan_sweep(SWEEP):
        config = point.config
        seq_len = config.phases[0].seq_len
        per_token = flops_per_token(config.model, seq_len)
        assert point.tokens == point.steps * config.batch_size * seq_len
        assert config.total_steps == point.steps
        # D = C / FLOPs per token, up to half a step of rounding
        assert abs(point.tokens - point.budget / per_token) <= config.batch_size * seq_len / 2
        assert point.flops == pytest.approx(per_token * point.tokens)
        assert config.phases[0].schedule.warmup_steps <= max(point.steps // 10, 1)


def test_shapes_scale_heads_widths_and_learning_rate():
    model = scale_model(DENSE, 64, 3)
    assert (model.n_heads, model.n_kv_heads, model.head_dim) == (8, 4, 8)
    assert model.ffn_dim == 192 and model.n_layers == 3
    run = shaped_config(SWEEP, 64, 3)
    assert run.phases[0].schedule.peak_lr == pytest.approx(3e-3 * 32 / 64)  # lr ~ 1/width
    assert shaped_config(replace(SWEEP, lr_width_exponent=0), 64, 3).phases[0].schedule.peak_lr == (
        3e-3
    )
    with pytest.raises(ConfigError, match="d20-l2: d_model must be a multiple of head_dim"):
        scale_model(DENSE, 20, 2)


def test_an_moe_sweep_counts_active_parameters():
    sweep = replace(SWEEP, base=replace(BASE, model=MOE), depths=(2, 4))
    for point in plan_sweep(sweep):
        model = point.config.model
        size = model_size(model)
        assert point.params == size.active_matmul < size.total
        assert (model.n_routed_experts, model.top_k, model.n_shared_experts) == (8, 2, 1)
        assert model.expert_ffn_dim == model.d_model  # base: 32 wide at d_model 32
    # the same shapes dense: an MoE point is charged for top_k experts only
    moe = scale_model(MOE, 64, 2)
    routed = model_size(moe).total - model_size(moe).active
    assert routed == (8 - 2) * 1 * 3 * 64 * 64  # the 6 unused experts of the one MoE layer


def test_a_budget_without_a_bracketing_shape_is_named():
    with pytest.raises(ConfigError, match=r"budget 1e\+15 FLOPs: no shape above its prior optimum"):
        plan_sweep(replace(SWEEP, budgets=(1e10, 1e15)))
    with pytest.raises(ConfigError, match=r"budget 1e\+06 FLOPs: no shape below"):
        plan_sweep(replace(SWEEP, budgets=(1e6, 1e10)))


def test_a_budget_that_buys_no_step_is_named():
    # a tiny tokens-per-parameter prior centres 1e7 FLOPs on sizes that cannot take one step
    sweep = replace(SWEEP, budgets=(1e7,), tokens_per_param=1e-5)
    with pytest.raises(ConfigError, match=r"budget 1e\+07 FLOPs buys 0.0\d+ steps of d"):
        plan_sweep(sweep)


def test_too_few_points_or_sizes_fail():
    with pytest.raises(ConfigError, match="needs at least 3 sizes"):
        plan_sweep(replace(SWEEP, points_per_budget=2))
    with pytest.raises(ConfigError, match="2 distinct sizes"):
        plan_sweep(replace(SWEEP, widths=(16, 32), depths=(1,)))


def test_sweep_steps_are_one_train_step_per_point_and_a_collect_step():
    steps = sweep_steps(SWEEP, ("/data/cache",))
    points = plan_sweep(SWEEP)
    *trains, collect = steps
    assert len(trains) == len(points)
    assert trains[0].name == f"sweep-1e10-{points[0].label}"
    assert trains[0].config.data[0].cache == "/data/cache"
    assert collect.name == "sweep-runs" and set(collect.dependencies) == set(trains)
    assert [run.label for run in collect.config.runs] == [p.label for p in points]
    assert budget_tag(1.25e13) == "1.25e13" and budget_tag(3e11) == "3e11"
    assert RUNS_FILE == "runs.csv"


def test_sweep_steps_take_a_cache_from_another_step():
    from keel.steps import Step, output_of

    tokenize = Step("tokenize", lambda config, output: None, {"vocab": 512})
    steps = sweep_steps(SWEEP, (output_of(tokenize),), name="ladder")
    assert isinstance(steps[0].config.data[0].cache, StepRef)
    assert tokenize in steps[0].dependencies
    assert steps[-1].name == "ladder-runs"


def cli():
    app = typer.Typer()
    sweep_commands.register(app)
    return app


def test_cli_prints_the_plan(tmp_path):
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(to_dict(BASE)))
    args = ["sweep", str(config), "--budgets", "1e10,1e11", "--widths", "8,16,24,32,48,64"]
    result = CliRunner().invoke(cli(), [*args, "--depths", "1,2", "--points", "3", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "dry run" in result.output and "d16-l1" in result.output
    as_json = CliRunner().invoke(cli(), [*args, "--points", "3", "--dry-run", "--json"])
    plan = json.loads(as_json.output)
    assert plan["runs_csv"] is None and len(plan["plan"]) == 6
    assert {"budget", "label", "params", "tokens", "steps", "flops"} <= set(plan["plan"][0])


def test_cli_errors_are_one_line():
    result = CliRunner().invoke(
        cli(), ["sweep", "--preset", "tiny-dense", "--budgets", "1e10", "--dry-run"]
    )
    assert result.exit_code == 2
    assert result.output.startswith("error: budget 1e+10 FLOPs: no shape below")
    assert result.output.count("\n") == 1
