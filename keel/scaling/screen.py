"""Screening variants of a baseline by their effective compute multiplier.

The baseline and each variant (a list of `--set key=value` overrides of it) train at every budget
C (FLOPs), each for the steps C buys with ITS model's FLOPs per token (keel.scaling.budget), so a
wider variant trains on fewer tokens. The baseline's final loss against its compute is fitted as
L(C) = E + K·(C/C₀)^-c (C₀ the geometric mean of its FLOPs; with 2 budgets E = 0, a line in
log-log). For a variant that reached loss L_v with C_v FLOPs:

    multiplier = C_base(L_v) / C_v x (variant FLOP/s / baseline FLOP/s at the same budget)

where C_base(L) inverts the baseline's fit and FLOP/s = tokens/s x FLOPs per token: the
baseline's time to L_v over the variant's. (A tokens/s ratio would charge a model that costs more
per token twice: once in C_v, again in its tokens/s.) A multiplier above 1 + tolerance at every
budget makes the variant effective, below 1 - tolerance at every budget ineffective, anything
else mixed. A C_base beyond `max_extrapolation` x the baseline's largest budget (or below its
smallest / max_extrapolation), or a loss under the fit's asymptote E, is reported as a bound on
the multiplier, never as a number.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from keel.core import paths
from keel.core.config import apply_overrides
from keel.core.errors import ConfigError, UsageError
from keel.scaling.budget import RunPoint, at_budget, read_run
from keel.scaling.fits import fit_frontier, frontier_loss
from keel.steps import Step, output_of
from keel.train.config import TrainConfig
from keel.train.presets import preset
from keel.train.steps import train_step

BASELINE = "baseline"
"""The baseline's name in step names and tables (so no variant may use it)."""
MIN_BUDGETS = 2
"""A loss-vs-compute curve needs two points for a slope; 3 or more also fit its asymptote E."""
VERDICTS = ("effective", "mixed", "ineffective")
REPORT_VERSION = "1"
"""Version of the report step: bump it when the analysis below changes, so cached reports redo."""
JSON_FILE, CSV_FILE = "screen.json", "screen.csv"
logger = logging.getLogger(__name__)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _default_variants() -> dict[str, tuple[str, ...]]:
    return {"lr-x3": ("phases.0.schedule.peak_lr=9e-3",), "top-4": ("model.top_k=4",)}


@dataclass(frozen=True)
class ScreenConfig:
    """A baseline, its variants and the budgets they all train at."""

    base: TrainConfig = field(default_factory=lambda: preset("tiny-moe"))
    """The baseline run (one phase; its steps are set by each budget)."""
    variants: dict[str, tuple[str, ...]] = field(default_factory=_default_variants)
    """Variant name -> overrides of `base` in `--set` syntax, e.g. ("model.d_model=256",)."""
    budgets: tuple[float, ...] = (1e12, 2e12, 4e12)
    """Compute budgets (FLOPs), at least 2: the baseline's loss-vs-compute fit needs a slope."""
    tolerance: float = 0.05
    """A multiplier within 1 ± tolerance counts as neutral."""
    max_extrapolation: float = 4.0
    """The baseline's fit is trusted from its smallest budget / this to its largest x this."""
    use_throughput: bool = True
    """Multiply by the achieved FLOP/s ratio; false screens compute efficiency alone (for noisy
    or shared machines, where tokens/s is not a measurement)."""

    def validate(self) -> ScreenConfig:
        if len(self.budgets) < MIN_BUDGETS:
            raise ConfigError(
                f"budgets has {len(self.budgets)}; the baseline's loss-vs-compute fit needs at "
                f"least {MIN_BUDGETS} (3 or more also fit its asymptote)"
            )
        if any(not (b > 0 and math.isfinite(b)) for b in self.budgets):
            raise ConfigError(f"budgets {list(self.budgets)}: each must be a positive FLOP count")
        labels = [budget_label(b) for b in self.budgets]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"budgets {list(self.budgets)}: two are equal to 3 digits")
        if not self.variants:
            raise ConfigError("variants is empty: name at least one, e.g. lr-x3: [...]")
        for name in self.variants:
            if name == BASELINE or not _NAME.match(name):
                raise ConfigError(
                    f"variant name {name!r}: use letters, digits, '_', '-', '.' (not {BASELINE!r})"
                )
        if not 0.0 <= self.tolerance < 1.0:
            raise ConfigError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if not self.max_extrapolation >= 1.0:
            raise ConfigError(f"max_extrapolation must be >= 1, got {self.max_extrapolation}")
        return self

    def arms(self) -> dict[str, TrainConfig]:
        """The baseline and each variant's TrainConfig (overrides applied; at_budget sets steps)."""
        arms = {BASELINE: self.base}
        for name, overrides in self.variants.items():
            arms[name] = apply_overrides(self.base, overrides, where=f"variant {name}:")
        return arms


def budget_label(flops: float) -> str:
    """A budget as it appears in step names: 2e+12 -> '2e12'."""
    return f"{flops:.3g}".replace("+", "")


@dataclass(frozen=True)
class ScreenRun:
    """One training run of the screen: its arm, nominal budget, config and run directory."""

    arm: str
    budget: float
    config: TrainConfig
    run: str


@dataclass(frozen=True)
class ScreenReport:
    """The report step's config: every run, and how to judge them."""

    runs: tuple[ScreenRun, ...]
    tolerance: float
    max_extrapolation: float
    use_throughput: bool


def screen_steps(config: ScreenConfig, caches: tuple[Any, ...] = ()) -> list[Step]:
    """One train step per (arm, budget), `screen-ARM-BUDGET`, drawing from `caches` (paths or
    output_of a tokenize step) where the base names no data; last, the `screen` report step,
    which writes screen.json and screen.csv."""
    config.validate()
    steps, runs = [], []
    for arm, train_config in config.arms().items():
        train_config = train_config.with_data(tuple(caches))
        for budget in config.budgets:
            budgeted = at_budget(train_config, budget).validate()
            step = train_step(f"screen-{arm}-{budget_label(budget)}", budgeted)
            steps.append(step)
            runs.append(ScreenRun(arm, float(budget), budgeted, output_of(step)))
    report = ScreenReport(
        tuple(runs), config.tolerance, config.max_extrapolation, config.use_throughput
    )
    return [*steps, Step("screen", write_screen, report, REPORT_VERSION)]


@dataclass(frozen=True)
class BaselineFit:
    """The baseline's final loss (nats) against its compute C (FLOPs): L = E + K·(C/C0)^-c."""

    E: float
    K: float
    c: float
    C0: float
    flops: tuple[float, ...]
    loss: tuple[float, ...]
    rms: float
    """Root mean square of ln L - ln L(C) over the points: the fit's relative error (0 with 2)."""

    def loss_at(self, flops: float) -> float:
        return self.E + self.K * (flops / self.C0) ** -self.c

    def compute_for(self, loss: float) -> float:
        """The FLOPs the baseline needs to reach `loss`; inf at or below the asymptote E."""
        if loss <= self.E:
            return math.inf
        return self.C0 * ((loss - self.E) / self.K) ** (-1.0 / self.c)

    def self_multipliers(self) -> tuple[float, ...]:
        """C_base(L) / C at the baseline's own points: all 1 for a fit through them; their spread
        is the multiplier error the fit alone causes."""
        points = zip(self.flops, self.loss, strict=True)
        return tuple(self.compute_for(loss) / flops for flops, loss in points)

    def describe(self) -> str:
        asymptote = self.E  # 0 for a line in log-log (or a fit that put it there)
        shape = f"{asymptote:.4g} + " if asymptote > 1e-6 * min(self.loss) else ""
        return f"L(C) = {shape}{self.K:.4g}·(C/{self.C0:.3g})^-{self.c:.4g}"


def fit_baseline(flops, loss) -> BaselineFit:
    """Fit the baseline's (C, L) points: E + K·(C/C0)^-c by least squares on ln L with 3 or more
    (E in [0, min L)), a line in log-log (E = 0) through 2. UsageError if L does not fall with C."""
    c_arr, l_arr = np.asarray(flops, float), np.asarray(loss, float)
    if c_arr.size < MIN_BUDGETS or np.unique(c_arr).size != c_arr.size:
        raise UsageError(
            f"the baseline has {np.unique(c_arr).size} distinct budgets; its loss-vs-compute fit "
            f"needs at least {MIN_BUDGETS}"
        )
    if not (np.all(np.isfinite(l_arr)) and np.all(l_arr > 0)):
        raise UsageError(f"the baseline's losses {l_arr.tolist()} are not all positive and finite")
    c0 = float(np.exp(np.log(c_arr).mean()))
    x = np.log(c_arr / c0)
    theta = _line(x, l_arr, 0.0)
    if c_arr.size > MIN_BUDGETS:
        starts = [_line(x, l_arr, f * l_arr.min()) for f in (0.0, 0.5, 0.8, 0.9, 0.95, 0.99)]
        candidates = [fit_frontier(x, l_arr, (e, math.exp(k), c)) for e, k, c in starts]

        def misfit(t: np.ndarray) -> float:
            fitted = np.maximum(frontier_loss(t, x), 1e-12)
            return float(np.sum((np.log(fitted) - np.log(l_arr)) ** 2))

        e, k, c = min(candidates, key=misfit)
        theta = np.array([min(e, l_arr.min() * (1 - 1e-9)), math.log(k), c])
    e, log_k, c = (float(v) for v in theta)
    if not c > 1e-9:
        pairs = ", ".join(f"{l_:.4f} at {c_:.3g}" for c_, l_ in zip(c_arr, l_arr, strict=True))
        raise UsageError(
            f"the baseline's loss does not fall with compute ({pairs} FLOPs): widen or raise the "
            "budgets so that more compute gives a lower loss"
        )
    fitted = e + math.exp(log_k) * np.exp(-c * x)
    rms = float(np.sqrt(np.mean((np.log(l_arr) - np.log(fitted)) ** 2)))
    return BaselineFit(e, math.exp(log_k), c, c0, tuple(c_arr.tolist()), tuple(l_arr.tolist()), rms)


def _line(x: np.ndarray, loss: np.ndarray, e: float) -> np.ndarray:
    """(E, ln K, c) of ln(L - E) = ln K - c·x by least squares, E fixed."""
    slope, intercept = np.polyfit(x, np.log(loss - e), 1)
    return np.array([e, intercept, -slope])


@dataclass(frozen=True)
class ScreenRow:
    """One variant at one budget. `status` "ok": `multiplier` is a number; "above_range" or
    "below_asymptote": the multiplier is > `bound`; "below_range": it is < `bound`."""

    variant: str
    budget: float
    flops: float
    """C_v: FLOPs the variant spent (its own FLOPs per token x its tokens)."""
    tokens: int
    loss: float
    """Final held-out loss (nats per token)."""
    baseline_flops: float | None
    """C_base: FLOPs the baseline's fit needs to reach `loss`; None when not trusted."""
    baseline_bound: float | None
    """For a bound: C_base > this (above_range, below_asymptote) or < this (below_range)."""
    compute_ratio: float | None
    """C_base / C_v."""
    throughput_ratio: float
    """The variant's achieved FLOP/s (tokens/s x FLOPs per token) over the baseline's at the same
    budget: its tokens/s ratio when both models cost the same per token."""
    multiplier: float | None
    """compute_ratio x throughput_ratio (or x 1 without throughput); None when not trusted."""
    bound: float | None
    """For a bound: the multiplier is > this (above_range, below_asymptote) or < this."""
    status: str
    verdict: str
    """effective, ineffective, neutral (within tolerance) or undecided (a bound that can't tell)."""

    @property
    def estimate(self) -> float:
        """The multiplier, or its bound when out of range (for sorting)."""
        return self.multiplier if self.multiplier is not None else float(self.bound or 0.0)


@dataclass(frozen=True)
class VariantResult:
    name: str
    verdict: str
    """effective (every budget), ineffective (every budget) or mixed."""
    score: float
    """Geometric mean of the rows' multipliers (bounds where out of range): the sort key."""
    rows: tuple[ScreenRow, ...]


@dataclass(frozen=True)
class Screen:
    """The baseline's fit and every variant's rows, sorted by verdict then score."""

    fit: BaselineFit
    baseline: tuple[RunPoint, ...]
    budgets: tuple[float, ...]
    variants: tuple[VariantResult, ...]
    tolerance: float
    max_extrapolation: float
    use_throughput: bool

    def to_dict(self) -> dict:
        """screen.json: all of the above as plain data (a NaN, such as an unmeasured
        throughput, as null)."""
        return _finite(asdict(self))

    def to_csv(self) -> str:
        """screen.csv: one row per variant and budget, with the variant's verdict."""
        out = io.StringIO()
        names = [f.name for f in ScreenRow.__dataclass_fields__.values()]
        writer = csv.writer(out)
        writer.writerow([*names, "variant_verdict"])
        for variant in self.variants:
            for row in variant.rows:
                writer.writerow([*(getattr(row, n) for n in names), variant.verdict])
        return out.getvalue()


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def screen(
    baseline: Mapping[float, RunPoint],
    variants: Mapping[str, Mapping[float, RunPoint]],
    tolerance: float = 0.05,
    max_extrapolation: float = 4.0,
    use_throughput: bool = True,
) -> Screen:
    """Judge each variant against the baseline: `baseline` maps each budget (FLOPs) to its run,
    `variants` each name to its runs at some of those budgets."""
    budgets = tuple(sorted(baseline))
    points = tuple(baseline[b] for b in budgets)
    fit = fit_baseline([p.flops for p in points], [p.loss for p in points])
    off = max(abs(m - 1.0) for m in fit.self_multipliers())
    if off > tolerance:
        logger.warning(
            "the baseline's fit misses its own runs by up to %.0f%% in compute, more than the "
            "tolerance (%.0f%%): verdicts within that margin are not resolved",
            100 * off, 100 * tolerance,
        )  # fmt: skip
    low, high = min(fit.flops) / max_extrapolation, max(fit.flops) * max_extrapolation
    results = []
    for name, runs in variants.items():
        rows = []
        for budget in sorted(runs):
            if budget not in baseline:
                raise UsageError(f"variant {name} ran at {budget:.3g} FLOPs; the baseline did not")
            run, base = runs[budget], baseline[budget]
            ratio = _flops_per_s(run) / _flops_per_s(base)
            if use_throughput and not (math.isfinite(ratio) and ratio > 0):
                raise UsageError(
                    f"no throughput for {name} or the baseline at {budget:.3g} FLOPs (a run of one "
                    "step?): raise the budgets or set use_throughput: false"
                )
            rows.append(_row(name, budget, run, fit, ratio, (low, high), use_throughput, tolerance))
        if not rows:
            raise UsageError(f"variant {name} has no runs")
        verdict = rows[0].verdict
        if verdict not in ("effective", "ineffective") or any(r.verdict != verdict for r in rows):
            verdict = "mixed"
        score = math.exp(np.mean([math.log(max(row.estimate, 1e-300)) for row in rows]))
        results.append(VariantResult(name, verdict, score, tuple(rows)))
    results.sort(key=lambda v: (VERDICTS.index(v.verdict), -v.score))
    return Screen(
        fit, points, budgets, tuple(results), tolerance, max_extrapolation, use_throughput
    )


def _flops_per_s(run: RunPoint) -> float:
    """Achieved training FLOP/s: tokens/s x FLOPs per token."""
    return run.tokens_per_s * run.flops / run.tokens


def _row(name, budget, run: RunPoint, fit, ratio, trusted, use_throughput, tolerance) -> ScreenRow:
    low, high = trusted
    speed = ratio if use_throughput else 1.0
    needed = fit.compute_for(run.loss)
    if not math.isfinite(needed):
        status, limit = "below_asymptote", high
    elif needed > high:
        status, limit = "above_range", high
    elif needed < low:
        status, limit = "below_range", low
    else:
        status, limit = "ok", None
    if limit is None:
        multiplier = needed / run.flops * speed
        bound = base_bound = None
        if multiplier > 1 + tolerance:
            verdict = "effective"
        elif multiplier < 1 - tolerance:
            verdict = "ineffective"
        else:
            verdict = "neutral"
    else:
        multiplier, needed, base_bound = None, None, limit
        bound = limit / run.flops * speed
        if status == "below_range":
            verdict = "ineffective" if bound <= 1 - tolerance else "undecided"
        else:
            verdict = "effective" if bound >= 1 + tolerance else "undecided"
    return ScreenRow(
        name, float(budget), run.flops, run.tokens, run.loss, needed, base_bound,
        None if needed is None else needed / run.flops, ratio, multiplier, bound, status, verdict,
    )  # fmt: skip


def write_screen(report: ScreenReport, output: str) -> None:
    """The report step: read every run, screen the variants, write screen.json and screen.csv."""
    baseline: dict[float, RunPoint] = {}
    variants: dict[str, dict[float, RunPoint]] = {}
    for run in report.runs:
        point = read_run(run.run, run.config)
        if run.arm == BASELINE:
            baseline[run.budget] = point
        else:
            variants.setdefault(run.arm, {})[run.budget] = point
    result = screen(
        baseline, variants, report.tolerance, report.max_extrapolation, report.use_throughput
    )
    paths.write_text(paths.join(output, JSON_FILE), json.dumps(result.to_dict(), indent=2) + "\n")
    paths.write_text(paths.join(output, CSV_FILE), result.to_csv())


def read_screen(output: str) -> dict:
    """The screen.json a report step wrote into `output`."""
    return json.loads(paths.read_text(paths.join(output, JSON_FILE)))
