"""A scaling ladder: the stored result of a sweep (runs.csv, its fits and plots), and the check of
a new run's loss curve against what the ladder predicts for it.

A ladder directory holds runs.csv (keel.scaling.sweep's collect step), ladder.json (the fits
below) and the plots of keel.scaling.plots. ladder.json keeps
- the isoFLOP fit (Approach 2): per budget C (FLOPs) the minimum N*, D*, loss; N* = G·C^a;
- the frontier L*(C) = E + K·(C/C₀)^-c through the minima (nats; 3 budgets or more);
- the parametric law L(N, D) = E + A/N^α + B/D^β (Approach 3, nats).

ladder.json also keeps the model family of the sweep's runs (dense or MoE, depths, vocabulary):
a prediction is for that family, and a run of another family is compared with a warning.

A new run is compared point by point: after step t it has trained on D_t tokens (steps x batch x
seq_len) and spent C_t = flops_per_token x D_t FLOPs; the ladder predicts L(N, D_t) with the run's
N (or, asked to, L*(C_t): the best any size reaches with that compute). The deviation is
(loss - predicted) / predicted, and a point past the warm-up fraction of the run is flagged when
its loss is above the prediction by more than the tolerance: the held-out eval_loss at an
evaluation step (what the ladder's runs report), elsewhere the training cross entropy averaged
over a trailing window of steps. Below is not a deficit: a run whose held-out loss beats the
prediction by more than the tolerance is reported as better than predicted (the verdict
"better"), and a low training loss says nothing at all (repeated data, several epochs of a small
cache, pulls it under the held-out loss the ladder was fitted to).
A run mid-schedule sits a little above a finished run of the same D (its learning rate has not
decayed yet), which the default 5% tolerance allows for (docs/scaling.md has the numbers).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from keel.core import paths
from keel.core.errors import UsageError
from keel.model.size import flops_per_token
from keel.scaling.budget import fit_size
from keel.scaling.family import ModelFamily, family_warning
from keel.scaling.fits import (
    IsoflopFit,
    ParametricFit,
    Runs,
    fit_isoflop,
    fit_parametric,
    load_runs,
)
from keel.scaling.sweep import RUNS_FILE
from keel.steps import Step, output_of
from keel.train.config import TrainConfig
from keel.train.trainer import METRICS_FILE

LADDER_FILE = "ladder.json"


@dataclass(frozen=True)
class LadderBudget:
    """One isoFLOP curve's minimum: C (FLOPs), N* (parameters), D* (tokens), loss (nats)."""

    flops: float
    n_opt: float
    d_opt: float
    loss_opt: float


@dataclass(frozen=True)
class Ladder:
    """A sweep's fits, as stored in ladder.json."""

    budgets: tuple[LadderBudget, ...]
    a: float
    """N* = G·C^a (C in FLOPs)."""
    b: float
    G: float
    H: float
    a_interval: tuple[float, float]
    frontier: tuple[float, float, float, float] | None
    """(E, K, c, ln C₀) of L*(C) = E + K·(C/C₀)^-c in nats; None with fewer than 3 budgets."""
    law: tuple[float, float, float, float, float]
    """(E, A, B, α, β) of L(N, D) = E + A/N^α + B/D^β in nats."""
    runs: int
    """Runs the fits used."""
    family: ModelFamily | None = None
    """The runs' model family; None in a ladder.json written before keel recorded it."""

    def frontier_loss(self, flops: Any) -> np.ndarray:
        """L*(C): the lowest loss (nats) any size reaches with C FLOPs."""
        if self.frontier is None:
            raise UsageError("this ladder has fewer than 3 budgets, so no loss-vs-compute fit")
        e, k, c, log_c0 = self.frontier
        return e + k * np.exp(-c * (np.log(np.asarray(flops, float)) - log_c0))

    def law_loss(self, params: Any, tokens: Any) -> np.ndarray:
        """L(N, D): the loss (nats) of N parameters trained on D tokens."""
        e, a, b, alpha, beta = self.law
        return e + a / np.asarray(params, float) ** alpha + b / np.asarray(tokens, float) ** beta

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ladder:
        def numbers(value):
            return None if value is None else tuple(float(v) for v in value)

        return cls(
            budgets=tuple(LadderBudget(**budget) for budget in data["budgets"]),
            a=float(data["a"]), b=float(data["b"]), G=float(data["G"]), H=float(data["H"]),
            a_interval=numbers(data["a_interval"]), frontier=numbers(data["frontier"]),
            law=numbers(data["law"]), runs=int(data["runs"]),
            family=ModelFamily.from_dict(data.get("family")),
        )  # fmt: skip


def run_budgets(csv_path: str) -> list[float] | None:
    """The distinct values of runs.csv's `budget` column (FLOPs), or None without one."""
    with paths.open_file(csv_path, "r") as file:
        rows = list(csv.DictReader(file))
    if not rows or "budget" not in rows[0]:
        return None
    return sorted({float(row["budget"]) for row in rows})


def fit_ladder(
    runs: Runs, budgets: Sequence[float] | None = None, bootstrap: int = 200
) -> tuple[Ladder, IsoflopFit, ParametricFit]:
    """(Ladder, IsoflopFit, ParametricFit) of a sweep's runs; UsageError (naming the budget) when
    an isoFLOP curve has no interior minimum. `bootstrap` resamples the isoFLOP fit (its
    intervals go into ladder.json and optimal.png); the parametric law is fitted once, without
    resamples, as the ladder keeps only its point estimate (`keel scaling fit --method
    parametric` gives its intervals): 100 refits were ~80% of the step's fitting time."""
    isoflop = fit_isoflop(runs, list(budgets) if budgets else None, bootstrap=bootstrap)
    parametric = fit_parametric(runs, bootstrap=0)
    ladder = Ladder(
        budgets=tuple(
            LadderBudget(f.flops, f.n_opt, f.d_opt, f.loss_opt) for f in isoflop.budgets
        ),
        a=isoflop.a, b=isoflop.b, G=isoflop.G, H=isoflop.H, a_interval=isoflop.a_interval,
        frontier=isoflop.frontier,
        law=(parametric.E, parametric.A, parametric.B, parametric.alpha, parametric.beta),
        runs=int(runs.loss.size),
    )  # fmt: skip
    return ladder, isoflop, parametric


def load_ladder(directory: str) -> Ladder:
    """The ladder stored in `directory` (its ladder.json)."""
    path = paths.join(directory, LADDER_FILE)
    if not paths.exists(path):
        raise UsageError(
            f"{directory} holds no {LADDER_FILE}: build a ladder with keel scaling ladder"
        )
    return Ladder.from_dict(json.loads(paths.read_text(path)))


@dataclass(frozen=True)
class LadderConfig:
    runs: str
    """A sweep's runs.csv (usually output_of(collect step, "runs.csv"))."""
    extrapolate_to: float = 0.0
    """The budget (FLOPs) optimal.png extrapolates N*(C), D*(C) to; 0: 100x the largest."""
    bootstrap: int = 200
    family: ModelFamily | None = None
    """The sweep's model family, kept in ladder.json (ladder_step fills it in)."""


def write_ladder(config: LadderConfig, output: str) -> None:
    """A ladder directory: runs.csv, ladder.json and the plots (isoflops.png with each budget's
    parabola and minimum, optimal.png with N*(C), D*(C) extrapolated, predicted_vs_actual.png);
    `output` is a local directory (the fits and matplotlib read and write local files)."""
    from keel.scaling.plots import write_plots  # matplotlib: imported only when plotting

    text = paths.read_text(config.runs)
    paths.write_text(paths.join(output, RUNS_FILE), text)
    runs_path = paths.local_path(paths.join(output, RUNS_FILE))
    runs = load_runs(runs_path)
    ladder, isoflop, parametric = fit_ladder(runs, run_budgets(str(runs_path)), config.bootstrap)
    ladder = replace(ladder, family=config.family)
    paths.write_text(paths.join(output, LADDER_FILE), json.dumps(ladder.to_dict(), indent=2) + "\n")
    write_plots(runs, isoflop, parametric, paths.local_path(output), config.extrapolate_to or None)


def ladder_step(name: str, collect: Step, extrapolate_to: float = 0.0) -> Step:
    """The step that fits and plots a sweep's runs.csv (`collect` is sweep_steps' last step)."""
    family = ModelFamily.of([run.config.model for run in collect.config.runs])
    config = LadderConfig(output_of(collect, RUNS_FILE), extrapolate_to, family=family)
    return Step(name, write_ladder, config)


@dataclass(frozen=True)
class ComparedPoint:
    """One logged point of a run against the ladder."""

    step: int
    tokens: int
    """D so far: tokens trained on up to and including this step."""
    flops: float
    """C so far: FLOPs spent (flops_per_token x tokens, per phase)."""
    loss: float
    """The run's loss here (nats): eval_loss at evaluation steps, else the trailing mean of the
    training cross entropy."""
    kind: str
    """"eval" or "train": which loss `loss` is."""
    predicted: float
    """The ladder's loss for this run's N at these tokens (or L*(C)), nats."""
    deviation: float
    """(loss - predicted) / predicted."""
    checked: bool
    """Past the warm-up fraction of the run, so it can be flagged."""
    flagged: bool
    """Checked, and above the prediction by more than the tolerance (worse than predicted)."""


@dataclass(frozen=True)
class Comparison:
    """A run's loss curve against a ladder's prediction."""

    params: int
    """N of the run (active matmul parameters)."""
    prediction: str
    """"L(N, D)" or "L*(C)": what the ladder predicted with."""
    tolerance: float
    warmup_fraction: float
    points: tuple[ComparedPoint, ...]
    family_warning: str = ""
    """Non-empty when the run's model is not of the ladder's family (what differs), or the
    ladder does not record its family."""

    @property
    def flagged(self) -> tuple[ComparedPoint, ...]:
        return tuple(point for point in self.points if point.flagged)

    @property
    def ok(self) -> bool:
        """No point is worse than predicted by more than the tolerance."""
        return not self.flagged

    @property
    def worst(self) -> ComparedPoint | None:
        """The checked point farthest above the prediction (or least below it)."""
        checked = [point for point in self.points if point.checked]
        return max(checked, key=_above) if checked else None

    @property
    def best(self) -> ComparedPoint | None:
        """The last checked evaluation (the run's result) when it is below the prediction by
        more than the tolerance, else the checked evaluation farthest below it."""
        evals = [point for point in self.points if point.checked and point.kind == "eval"]
        if not evals:
            return None
        return evals[-1] if _above(evals[-1]) < -self.tolerance else min(evals, key=_above)

    @property
    def verdict(self) -> str:
        """ "worse" (a point above the prediction by more than the tolerance), "better" (none,
        and a held-out loss below it by more than the tolerance) or "within"."""
        if self.flagged:
            return "worse"
        best = self.best
        return "better" if best is not None and best.deviation < -self.tolerance else "within"

    def summary(self) -> str:
        """One line: worse than, better than or within the ladder's prediction, and where."""
        checked = [point for point in self.points if point.checked]
        if not checked:
            return "no point past the warm-up to compare"
        verdict = self.verdict
        if verdict == "worse":
            return (
                f"{len(self.flagged)} of {len(checked)} points are worse than the ladder predicts "
                f"by more than {self.tolerance:.0%}; worst {self._where(self.worst)}"
            )
        if verdict == "better":
            return (
                f"better than the ladder predicts: {self._where(self.best)}; no point more than "
                f"{self.tolerance:.0%} above it"
            )
        largest = max(checked, key=_distance)
        return (
            f"within {self.tolerance:.0%} of the ladder; largest deviation {self._where(largest)}"
        )

    def _where(self, point: ComparedPoint) -> str:
        return (
            f"{point.deviation:+.1%} at step {point.step} ({point.kind} loss {point.loss:.3f} "
            f"vs {point.predicted:.3f} predicted by {self.prediction})"
        )


def _above(point: ComparedPoint) -> float:
    """The deviation, NaN counting as infinitely far above."""
    return point.deviation if math.isfinite(point.deviation) else math.inf


def _distance(point: ComparedPoint) -> float:
    """How far a point is off in a direction that means something: either way for held-out
    losses, above for training losses (NaN counts as infinitely far)."""
    return abs(_above(point)) if point.kind == "eval" else _above(point)


def read_metrics(source: str) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (`source` is the file or its run directory)."""
    path = source if source.endswith(".jsonl") else paths.join(source, METRICS_FILE)
    if not paths.exists(path):
        raise UsageError(f"{path}: no such file; give a run directory with {METRICS_FILE}")
    return [json.loads(line) for line in paths.read_text(path).splitlines() if line.strip()]


def compare_to_ladder(
    metrics: str | Sequence[dict[str, Any]],
    config: TrainConfig,
    ladder: Ladder | str,
    *,
    tolerance: float = 0.05,
    warmup_fraction: float = 0.25,
    window: int = 20,
    use: str = "law",
) -> Comparison:
    """Compare a run's logged losses (metrics.jsonl rows, the file or its run directory) with the
    ladder's prediction for the run's N (`config` is the run's TrainConfig), by `use` "law"
    (L(N, D)) or "frontier" (L*(C)). Points after `warmup_fraction` of the steps are flagged when
    above it by more than `tolerance` (module docstring);
    training loss is averaged over the last `window` steps."""
    rows = read_metrics(metrics) if isinstance(metrics, str) else list(metrics)
    rows.sort(key=lambda row: row["step"])
    ladder = load_ladder(ladder) if isinstance(ladder, str) else ladder
    if use not in ("law", "frontier"):
        raise UsageError(f"use={use!r}: choose law or frontier")
    if not 0 <= warmup_fraction < 1 or not tolerance > 0 or window < 1:
        raise UsageError("warmup_fraction must be in [0, 1), tolerance > 0 and window >= 1")
    if not rows:
        raise UsageError("the run has logged no steps yet")
    law = use == "law"
    params = fit_size(config)
    seq_lens = {phase.name: phase.seq_len for phase in config.phases}
    total = max(config.total_steps, int(rows[-1]["step"]))
    tokens = flops = 0.0
    recent: list[float] = []
    points = []
    last_step = 0
    for row in rows:
        step = int(row["step"])
        seq_len = seq_lens.get(row.get("phase", ""), config.phases[-1].seq_len)
        count = (step - last_step) * config.batch_size * seq_len
        last_step = step
        tokens += count
        flops += flops_per_token(config.model, seq_len) * count
        recent = [*recent, float(row.get("cross_entropy", row["loss"]))][-window:]
        if "eval_loss" in row:
            kind, loss = "eval", float(row["eval_loss"])
        else:
            kind, loss = "train", float(np.mean(recent))
        predicted = float(ladder.law_loss(params, tokens) if law else ladder.frontier_loss(flops))
        deviation = (loss - predicted) / predicted
        checked = step > warmup_fraction * total
        point = ComparedPoint(
            step, int(tokens), flops, loss, kind, predicted, deviation, checked, False
        )
        points.append(replace(point, flagged=checked and _above(point) > tolerance))
    return Comparison(
        params, "L(N, D)" if law else "L*(C)", tolerance, warmup_fraction, tuple(points),
        family_warning(ladder.family, config.model),
    )  # fmt: skip
