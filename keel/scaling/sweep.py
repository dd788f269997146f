"""isoFLOP sweeps: for each compute budget C (FLOPs), a few model sizes around the expected
optimum, each trained on the tokens C buys, as ordinary cached keel steps.

Sizes. A sweep draws its models from a family of shapes (d_model, n_layers) of one base
TrainConfig: `head_dim` is fixed, n_heads = d_model / head_dim, the key/value heads keep the
base's query-heads-per-KV-head ratio, and every hidden width (dense SwiGLU `ffn_dim`, MoE
`expert_ffn_dim`, `latent_dim`) scales with d_model; an MoE keeps its expert count, top_k and
shared experts. N is the model's active matmul parameters (budget.fit_size), so an MoE is sized
by what a token uses. Each budget is centred on a prior optimum N ≈ sqrt(C / (6·r)) from a
tokens-per-parameter ratio r (default 20, Chinchilla's D ≈ 20·N): the `points_per_budget`
shapes chosen are the ones closest (in ln N) to sizes log-spaced `spacing`x apart around it, and
they must bracket it (one smaller, one larger). The prior only centres the sweep; the fit finds
the real optimum, so a prior far off (tiny models, where the embedding dominates N) is fixed by
lowering r until the measured minima are interior.

Tokens. D = C / flops_per_token(model, seq_len) (6·N plus attention; budget.at_budget), spent as
steps = round(D / (batch_size · seq_len)); the batch size and sequence length stay the base's for
every point, so D = steps · batch_size · seq_len up to half a step of rounding.

Learning rate. peak_lr = base peak_lr · (base d_model / d_model)^lr_width_exponent: with the
default exponent 1 the learning rate goes as 1/width (the μP rule for Adam's hidden matrices,
applied to the whole model for simplicity); 0 keeps the base's. Warmup is the base's, capped at a
tenth of the steps; the schedule's shape (WSD by default) and its decay fraction are the base's.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from keel.core import paths
from keel.core.errors import ConfigError
from keel.model.config import ModelConfig
from keel.model.size import flops_per_token
from keel.scaling.budget import at_budget, fit_size, flops_per_step, read_run, tokens_per_step
from keel.steps import Step, output_of
from keel.train.config import DataSource, TrainConfig
from keel.train.presets import preset
from keel.train.steps import train_step

RUNS_FILE = "runs.csv"
RUNS_COLUMNS = ("params", "tokens", "flops", "loss", "tokens_per_s", "budget", "label")


@dataclass(frozen=True)
class SweepConfig:
    """Budgets and a family of shapes of one base run (a single phase)."""

    base: TrainConfig = field(default_factory=lambda: preset("tiny-dense"))
    """The run every point starts from: optimizer, schedule, batch size, seq_len, data."""
    budgets: tuple[float, ...] = (1e13, 3e13, 1e14)
    """Compute budgets C in FLOPs, one isoFLOP curve each."""
    widths: tuple[int, ...] = ()
    """d_model values of the family (multiples of head_dim); empty: ~√2 steps from base/4 to 4x."""
    depths: tuple[int, ...] = ()
    """n_layers values of the family; empty: the base's depth halved, as is, and doubled."""
    shapes: tuple[tuple[int, int], ...] = ()
    """Explicit (d_model, n_layers) shapes; when given, widths and depths are not used."""
    head_dim: int = 0
    """Per-head width of every shape; 0: the base model's."""
    points_per_budget: int = 4
    """Sizes trained per budget (at least 3: a parabola in ln N needs 3)."""
    tokens_per_param: float = 20.0
    """Prior ratio r = D/N at the optimum, centring each budget: N ≈ sqrt(C / (6·r))."""
    spacing: float = 2.0
    """Ratio between neighbouring sizes the choice aims at (2: N*/2.8 … 2.8·N* for 4 points)."""
    lr_width_exponent: float = 1.0
    """peak_lr scales as (base d_model / d_model) to this power; 0 keeps the base's."""
    min_steps: int = 1
    """A budget that buys fewer optimizer steps than this for a chosen size is an error."""


@dataclass(frozen=True)
class SweepPoint:
    """One run of a sweep."""

    budget: float
    """C asked for (FLOPs)."""
    label: str
    """The shape, e.g. d64-l2."""
    config: TrainConfig
    """The run: the shape, its learning rate, and `steps` = what the budget buys."""
    params: int
    """N: active matmul parameters."""
    tokens: int
    """D: steps x batch_size x seq_len."""
    steps: int
    flops: float
    """C actually spent: flops_per_token x D (within half a step of `budget`)."""


def shape_label(d_model: int, n_layers: int) -> str:
    return f"d{d_model}-l{n_layers}"


def budget_tag(flops: float) -> str:
    """A budget as a step-name fragment: 1e12 -> "1e12", 1.25e13 -> "1.25e13"."""
    mantissa, _, exponent = f"{flops:.3g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def scale_model(base: ModelConfig, d_model: int, n_layers: int, head_dim: int = 0) -> ModelConfig:
    """`base` at width `d_model` and depth `n_layers`: heads of `head_dim` (0: the base's), hidden
    widths scaled with d_model, the same experts, top_k and query heads per key/value head."""
    head_dim = head_dim or base.head_dim
    label = shape_label(d_model, n_layers)
    if d_model < head_dim or d_model % head_dim:
        raise ConfigError(
            f"shape {label}: d_model must be a multiple of head_dim ({head_dim}); "
            "choose widths that are"
        )
    if n_layers < 1:
        raise ConfigError(f"shape {label}: n_layers must be at least 1")
    if base.is_moe and n_layers <= base.n_dense_layers:
        raise ConfigError(
            f"shape {label}: the MoE base has {base.n_dense_layers} dense layers, so a shape "
            "needs more layers than that; choose larger depths"
        )
    n_heads = d_model // head_dim
    group = max(1, base.n_heads // base.n_kv_heads)
    n_kv_heads = max(1, n_heads // group)
    while n_heads % n_kv_heads:
        n_kv_heads -= 1

    def scaled(width: int) -> int:
        return max(1, round(width * d_model / base.d_model)) if width else 0

    return replace(
        base,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=scaled(base.ffn_dim),
        expert_ffn_dim=scaled(base.expert_ffn_dim),
        latent_dim=scaled(base.latent_dim),
    ).validate()


def family(config: SweepConfig) -> list[tuple[int, int]]:
    """The (d_model, n_layers) shapes a sweep chooses from."""
    if config.shapes:
        return sorted(set(config.shapes))
    model = config.base.model
    head_dim = config.head_dim or model.head_dim
    widths = config.widths or tuple(
        sorted(
            {
                max(head_dim, round(model.d_model * 2 ** (k / 2) / head_dim) * head_dim)
                for k in range(-4, 5)
            }
        )
    )
    depths = config.depths or tuple(sorted({max(1, model.n_layers // 2), model.n_layers,
                                            2 * model.n_layers}))  # fmt: skip
    return [(d, n) for d in widths for n in depths]


def _closest_run(sizes: list[float], targets: list[float]) -> list[int]:
    """Indices of len(targets) members of ascending `sizes`, in order, minimising the summed
    |ln size - ln target| (dynamic programming over ordered choices)."""
    k, count = len(targets), len(sizes)
    cost = [[abs(math.log(s) - math.log(t)) for s in sizes] for t in targets]
    best = [[math.inf] * count for _ in range(k)]
    back = [[-1] * count for _ in range(k)]
    for j in range(count):
        best[0][j] = cost[0][j]
    for i in range(1, k):
        running, arg = math.inf, -1
        for j in range(count):
            if j >= 1 and best[i - 1][j - 1] < running:
                running, arg = best[i - 1][j - 1], j - 1
            best[i][j] = running + cost[i][j]
            back[i][j] = arg
    j = min(range(count), key=lambda index: best[k - 1][index])
    chosen = [j]
    for i in range(k - 1, 0, -1):
        j = back[i][j]
        chosen.append(j)
    return chosen[::-1]


def shaped_config(config: SweepConfig, d_model: int, n_layers: int) -> TrainConfig:
    """The sweep's base run at one shape, with the learning-rate rule applied (no budget yet)."""
    base = config.base
    phase = base.phases[0]
    model = scale_model(base.model, d_model, n_layers, config.head_dim)
    lr = phase.schedule.peak_lr * (base.model.d_model / d_model) ** config.lr_width_exponent
    schedule = replace(phase.schedule, peak_lr=lr)
    return replace(base, model=model, phases=(replace(phase, schedule=schedule),))


def plan_sweep(config: SweepConfig) -> list[SweepPoint]:
    """The runs of a sweep, by budget then size; ConfigError (naming the budget) when a budget's
    prior optimum is not bracketed by the family or buys fewer than `min_steps` steps."""
    if len(config.base.phases) != 1:
        raise ConfigError("a sweep's base config has one phase; give it a single-phase config")
    if config.points_per_budget < 3:
        raise ConfigError(
            f"points_per_budget is {config.points_per_budget}; an isoFLOP parabola needs at "
            "least 3 sizes per budget"
        )
    if not config.budgets or any(not c > 0 for c in config.budgets):
        raise ConfigError(f"budgets {config.budgets}: give positive FLOP counts")
    if not config.tokens_per_param > 0 or not config.spacing > 1:
        raise ConfigError("tokens_per_param must be > 0 and spacing > 1")
    members: dict[int, tuple[int, str, TrainConfig]] = {}
    for d_model, n_layers in sorted(family(config)):
        shaped = shaped_config(config, d_model, n_layers)
        params = fit_size(shaped)  # equal N: the first (narrowest) shape stands for it
        members.setdefault(params, (params, shape_label(d_model, n_layers), shaped))
    ordered = sorted(members.values(), key=lambda member: member[0])
    k = config.points_per_budget
    if len(ordered) < k:
        raise ConfigError(
            f"the family has {len(ordered)} distinct sizes, fewer than points_per_budget={k}; "
            "add widths or depths"
        )
    points = []
    for budget in sorted(config.budgets):
        prior = math.sqrt(budget / (6.0 * config.tokens_per_param))
        targets = [prior * config.spacing ** (i - (k - 1) / 2) for i in range(k)]
        chosen = [ordered[i] for i in _closest_run([m[0] for m in ordered], targets)]
        where = f"budget {budget:.3g} FLOPs"
        if not chosen[0][0] < prior < chosen[-1][0]:
            below = prior <= chosen[0][0]
            edge = chosen[0] if below else chosen[-1]
            raise ConfigError(
                f"{where}: no shape {'below' if below else 'above'} its prior optimum "
                f"N≈{prior:.3g} ({config.tokens_per_param:g} tokens per parameter; the "
                f"{'smallest' if below else 'largest'} is {edge[1]}, N={edge[0]:.3g}): add "
                f"{'smaller' if below else 'larger'} shapes, change the budget or tokens_per_param"
            )
        for params, label, shaped in chosen:
            points.append(_point(config, budget, label, shaped, params, where))
    return points


def _point(
    config: SweepConfig, budget: float, label: str, shaped: TrainConfig, params: int, where: str
) -> SweepPoint:
    seq_len = shaped.phases[0].seq_len
    per_step = flops_per_step(shaped)
    if budget / per_step < config.min_steps:
        raise ConfigError(
            f"{where} buys {budget / per_step:.3g} steps of {label} (N={params:.3g}, "
            f"{per_step:.3g} FLOPs per step); at least {config.min_steps} needed: raise the "
            "budget, or use smaller shapes or a smaller batch"
        )
    run = at_budget(shaped, budget).validate()
    tokens = run.steps * tokens_per_step(run)
    return SweepPoint(
        budget, label, run, params, tokens, run.steps,
        flops_per_token(run.model, seq_len) * tokens,
    )  # fmt: skip


@dataclass(frozen=True)
class SweepRun:
    """A sweep point as the collect step reads it: where its run directory is and its config."""

    budget: float
    label: str
    run: str
    """The train step's output (a StepRef until the executor resolves it)."""
    config: TrainConfig


@dataclass(frozen=True)
class CollectConfig:
    runs: tuple[SweepRun, ...]


def collect_runs(config: CollectConfig, output: str) -> None:
    """Write runs.csv: one row per finished run (params, tokens, flops, loss, tokens_per_s,
    budget, label), the input of keel.scaling.fits."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(RUNS_COLUMNS)
    for item in config.runs:
        point = read_run(item.run, item.config)
        writer.writerow(
            [point.params, point.tokens, f"{point.flops:.6g}", f"{point.loss:.6f}",
             f"{point.tokens_per_s:.6g}", f"{item.budget:.6g}", item.label]
        )  # fmt: skip
    paths.write_text(paths.join(output, RUNS_FILE), buffer.getvalue())


def _data(caches: Sequence[Any]) -> tuple[DataSource, ...]:
    return tuple(c if isinstance(c, DataSource) else DataSource(c) for c in caches)


def sweep_steps(config: SweepConfig, caches: Sequence[Any] = (), name: str = "sweep") -> list[Step]:
    """One train step per point (named `{name}-{budget}-{shape}`, e.g. sweep-1e12-d64-l2) and a
    last step `{name}-runs` writing runs.csv. `caches` (paths, `output_of(tokenize)` references
    or DataSources) replace the base's data; empty keeps it."""
    data = _data(caches)
    trains, runs = [], []
    for point in plan_sweep(config):
        run_config = replace(point.config, data=data) if data else point.config
        step = train_step(f"{name}-{budget_tag(point.budget)}-{point.label}", run_config)
        trains.append(step)
        runs.append(SweepRun(point.budget, point.label, output_of(step), run_config))
    return [*trains, Step(f"{name}-runs", collect_runs, CollectConfig(tuple(runs)))]
