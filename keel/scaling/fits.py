"""Chinchilla scaling-law fits (Hoffmann et al. 2022): isoFLOP parabolas and L = E + A/N^α + B/D^β.

Units throughout: N in parameters, D in tokens, C in FLOPs (C ≈ 6·N·D), loss in nats per token.
"""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares, minimize

from keel.core.errors import KeelError, UsageError

logger = logging.getLogger(__name__)

COLUMNS = ("params", "tokens", "loss")
BUDGET_TOLERANCE = 0.15  # with explicit budgets, a run belongs to one within ±15% of its FLOPs
BUDGET_GAP_DECADES = 0.1  # without them, sorted log10(FLOPs) split where gaps exceed 0.1 decade
HUBER_DELTA = 1e-3


@dataclass(frozen=True)
class Runs:
    """Final losses of training runs: N [runs] parameters, D [runs] tokens, C [runs] FLOPs, nats."""

    params: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    flops: np.ndarray


def make_runs(params, tokens, loss, flops=None, source: str = "input") -> Runs:
    """Pack run arrays (FLOPs default to 6·N·D); a bad value is UsageError naming the row."""
    columns = {"params": params, "tokens": tokens, "loss": loss}
    columns["flops"] = 6.0 * np.asarray(params, float) * np.asarray(tokens, float)
    if flops is not None:
        columns["flops"] = flops
    arrays = {name: np.asarray(values, dtype=float) for name, values in columns.items()}
    for name, values in arrays.items():
        bad = np.flatnonzero(~(np.isfinite(values) & (values > 0)))
        if bad.size:
            row = int(bad[0])
            raise UsageError(
                f"{source}: row {row + 1} (line {row + 2}): {name} is {float(values[row])!r}; "
                f"{name} must be a positive finite number"
            )
    if arrays["loss"].size == 0:
        raise UsageError(f"{source}: no runs")
    return Runs(**arrays)


def load_runs(path: str | Path) -> Runs:
    """Read a CSV with columns params, tokens, loss and optional flops (one row per run)."""
    try:
        with open(path, newline="") as file:
            rows = list(csv.DictReader(file))
            header = rows[0].keys() if rows else []
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    for column in COLUMNS:
        if column not in header:
            raise UsageError(f"{path}: missing column {column!r} (need params, tokens, loss)")
    with_flops = "flops" in header
    values: dict[str, list[float]] = {name: [] for name in (*COLUMNS, "flops")}
    for number, row in enumerate(rows, start=1):
        for name in (*COLUMNS, "flops") if with_flops else COLUMNS:
            try:
                values[name].append(float(row[name]))
            except (TypeError, ValueError):
                raise UsageError(
                    f"{path}: row {number} (line {number + 1}): {name} is {row[name]!r}, "
                    "not a number"
                ) from None
    flops = values["flops"] if with_flops else None
    return make_runs(values["params"], values["tokens"], values["loss"], flops, source=str(path))


def group_budgets(
    flops: np.ndarray, budgets: list[float] | None = None
) -> list[tuple[float, np.ndarray]]:
    """(budget C in FLOPs, row indices) per budget, ascending.

    With `budgets`, a run joins the nearest budget within ±15% and other runs are ignored. Without,
    runs are sorted by log10(C) and split where consecutive runs are more than 0.1 decade apart; a
    group's budget is its median C.
    """
    log_flops = np.log10(flops)
    if budgets:
        centers = np.log10(np.asarray(sorted(budgets), dtype=float))
        nearest = np.argmin(np.abs(log_flops[:, None] - centers[None, :]), axis=1)
        ratio = flops / 10.0 ** centers[nearest]
        inside = np.abs(ratio - 1.0) <= BUDGET_TOLERANCE
        if (~inside).any():
            logger.info("ignoring %d runs not within 15%% of a budget", int((~inside).sum()))
        return [
            (float(10.0**center), np.flatnonzero(inside & (nearest == i)))
            for i, center in enumerate(centers)
        ]
    order = np.argsort(log_flops)
    cuts = np.flatnonzero(np.diff(log_flops[order]) > BUDGET_GAP_DECADES) + 1
    return [(float(np.median(flops[g])), np.sort(g)) for g in np.split(order, cuts)]


@dataclass(frozen=True)
class BudgetFit:
    """One isoFLOP curve: loss ≈ p0·x² + p1·x + p2 with x = ln N, minimised at N* (parameters)."""

    flops: float
    n_opt: float
    d_opt: float
    loss_opt: float
    parabola: tuple[float, float, float]
    params: tuple[float, ...]
    loss: tuple[float, ...]


@dataclass(frozen=True)
class Prediction:
    """Compute-optimal N* (parameters), D* (tokens) and loss (nats) predicted at C FLOPs, with
    bootstrap intervals (low, high) at `level`; loss and its interval are None if unpredictable."""

    flops: float
    n_opt: float
    d_opt: float
    loss: float | None
    n_interval: tuple[float, float]
    d_interval: tuple[float, float]
    loss_interval: tuple[float, float] | None
    level: float


@dataclass(frozen=True)
class IsoflopFit:
    """Approach 2: N* = G·C^a, D* = H·C^b (C in FLOPs) fitted through the per-budget minima.

    `frontier` is (E, K, c, log C₀) of L*(C) = E + K·(C/C₀)^-c through the minima (nats), used to
    predict loss; None with fewer than 3 budgets. Intervals are bootstrap percentiles at `level`.
    """

    budgets: tuple[BudgetFit, ...]
    a: float
    b: float
    G: float
    H: float
    a_interval: tuple[float, float]
    b_interval: tuple[float, float]
    frontier: tuple[float, float, float, float] | None
    level: float
    samples: np.ndarray = field(repr=False, compare=False)  # [bootstrap, 6]: ln G, a, E, K, c, ok

    def predict(self, flops: float) -> Prediction:
        """Extrapolate N*, D* (and the frontier loss) to a budget of `flops` FLOPs."""
        log_c = math.log(flops)
        log_n = self.samples[:, 0] + self.samples[:, 1] * log_c
        n_s, d_s = np.exp(log_n), flops / (6.0 * np.exp(log_n))
        n_opt = self.G * flops**self.a
        loss = loss_interval = None
        if self.frontier is not None:
            loss = float(frontier_loss(self.frontier[:3], log_c - self.frontier[3]))
            ok = self.samples[:, 5] > 0
            loss_s = frontier_loss(self.samples[ok, 2:5].T, log_c - self.frontier[3])
            loss_interval = _interval(loss_s, self.level)
        return Prediction(
            float(flops), float(n_opt), float(flops / (6.0 * n_opt)), loss,
            _interval(n_s, self.level), _interval(d_s, self.level), loss_interval, self.level,
        )  # fmt: skip


def _interval(values: np.ndarray, level: float) -> tuple[float, float]:
    if values.size == 0:
        return (math.nan, math.nan)
    tail = 50.0 * (1.0 - level)
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return float(low), float(high)


def frontier_loss(theta, x):
    """L = E + K·exp(-c·x) for theta = (E, K, c), x = ln C - ln C₀ (nats)."""
    e, k, c = theta
    return e + k * np.exp(-c * x)


def _parabola(log_n: np.ndarray, loss: np.ndarray) -> np.ndarray | None:
    """Parabola coefficients in ln N, or None when it has no minimum (degenerate or concave)."""
    if np.unique(log_n).size < 3:
        return None
    coeffs = np.polyfit(log_n, loss, 2)
    return coeffs if coeffs[0] > 0 else None


def _fit_budget(flops: float, rows: np.ndarray, runs: Runs) -> BudgetFit:
    where = f"budget {flops:.3g} FLOPs"
    if rows.size < 3:
        raise UsageError(
            f"{where} has {rows.size} runs; an isoFLOP parabola needs at least 3 of about equal "
            "FLOPs (name the budgets with --budgets, or fit every run with --method parametric)"
        )
    n, loss = runs.params[rows], runs.loss[rows]
    lowest = int(np.argmin(loss))
    if n[lowest] in (n.min(), n.max()):
        side = "smallest" if n[lowest] == n.min() else "largest"
        raise UsageError(
            f"{where}: the lowest loss is at its {side} model (N={n[lowest]:.3g}); no interior "
            "minimum, so add runs that bracket the optimum or leave this budget out"
        )
    coeffs = _parabola(np.log(n), loss)
    if coeffs is None:
        raise UsageError(f"{where}: the loss is not convex in ln N (need 3 distinct sizes)")
    x = -coeffs[1] / (2.0 * coeffs[0])
    n_opt = math.exp(x)
    order = np.argsort(n)
    return BudgetFit(
        flops, n_opt, flops / (6.0 * n_opt), float(np.polyval(coeffs, x)),
        tuple(float(v) for v in coeffs), tuple(n[order].tolist()), tuple(loss[order].tolist()),
    )  # fmt: skip


def fit_frontier(log_c: np.ndarray, loss: np.ndarray, start=None) -> np.ndarray:
    """(E, K, c) of L* = E + K·exp(-c·x), x = ln C - mean; least squares on ln L*."""
    if start is None:
        e0 = 0.9 * loss.min()
        slope = np.polyfit(log_c, np.log(loss - e0), 1)[0]
        start = (e0, float(np.exp(np.log(loss - e0).mean())), max(-slope, 1e-3))

    def residuals(theta):
        return np.log(np.maximum(frontier_loss(theta, log_c), 1e-12)) - np.log(loss)

    bounds = ([0.0, 0.0, 0.0], [loss.min(), np.inf, 5.0])
    return least_squares(residuals, np.clip(start, *bounds), bounds=bounds).x


def _resample_sizes(
    rng: np.random.Generator, rows: np.ndarray, params: np.ndarray, tries: int = 100
) -> np.ndarray | None:
    """A resample (with replacement) of one budget's runs that still holds 3 distinct sizes, the
    fewest a parabola needs; None if `tries` draws found none. With exactly 3 runs in a budget
    every accepted resample is the budget itself, so its N* carries no sampling spread."""
    for _ in range(tries):
        pick = rng.choice(rows, rows.size)
        if np.unique(params[pick]).size >= 3:
            return pick
    return None


def fit_isoflop(
    runs: Runs,
    budgets: list[float] | None = None,
    bootstrap: int = 200,
    level: float = 0.9,
    seed: int = 0,
) -> IsoflopFit:
    """Approach 2: a parabola of loss in ln N per budget gives N*, D* = C/(6N*); then least squares
    of ln N* and ln D* on ln C gives a, b; intervals by resampling runs within each budget."""
    groups = group_budgets(runs.flops, budgets)
    fits = tuple(_fit_budget(c, rows, runs) for c, rows in groups)
    if len(fits) < 2:
        raise UsageError(f"found {len(fits)} budget; a power law in C needs at least 2")
    log_c = np.log([f.flops for f in fits])
    a, log_g = np.polyfit(log_c, np.log([f.n_opt for f in fits]), 1)
    loss_opt = np.array([f.loss_opt for f in fits])
    center = float(log_c.mean())
    frontier = fit_frontier(log_c - center, loss_opt) if len(fits) >= 3 else None
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(bootstrap):
        log_n_opt, minima = [], []
        for _, rows in groups:
            pick = _resample_sizes(rng, rows, runs.params)
            coeffs = None if pick is None else _parabola(np.log(runs.params[pick]), runs.loss[pick])
            if coeffs is None:
                break
            x = -coeffs[1] / (2.0 * coeffs[0])
            log_n_opt.append(x)
            minima.append(np.polyval(coeffs, x))
        else:
            slope, intercept = np.polyfit(log_c, log_n_opt, 1)
            theta = (np.nan,) * 3
            if frontier is not None:
                theta = fit_frontier(log_c - center, np.array(minima), frontier)
            samples.append((intercept, slope, *theta, float(frontier is not None)))
    if len(samples) < max(bootstrap // 2, 1):
        raise KeelError(f"only {len(samples)} of {bootstrap} bootstrap resamples could be fitted")
    samples = np.array(samples)
    a_interval = _interval(samples[:, 1], level)
    return IsoflopFit(
        fits, float(a), float(1.0 - a), float(math.exp(log_g)), float(math.exp(-log_g) / 6.0),
        a_interval, (1.0 - a_interval[1], 1.0 - a_interval[0]),
        None if frontier is None else (*map(float, frontier), center), level, samples,
    )  # fmt: skip


@dataclass(frozen=True)
class ParametricFit:
    """Approach 3: L(N, D) = E + A/N^α + B/D^β in nats (N parameters, D tokens).

    a = β/(α+β), b = α/(α+β) are the exponents of N*, D* in C; `loss` is the summed Huber objective.
    `samples` [bootstrap, 5] holds (ln A, ln B, ln E, α, β) refitted on resampled runs (none when
    fitted with bootstrap=0: the intervals are then NaN).
    """

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    a: float
    b: float
    loss: float
    level: float
    samples: np.ndarray = field(repr=False, compare=False)

    def loss_at(self, params, tokens) -> np.ndarray:
        """Predicted loss (nats) for N parameters trained on D tokens."""
        n, d = np.asarray(params, float), np.asarray(tokens, float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def predict(self, flops: float) -> Prediction:
        """Compute-optimal N*, D* and loss at `flops` FLOPs (C = 6·N·D) with bootstrap intervals."""
        theta = [*np.log([self.A, self.B, self.E]).tolist(), self.alpha, self.beta]
        n, d, loss = _optimum(np.array(theta)[None, :], flops)
        n_s, d_s, loss_s = _optimum(self.samples, flops)
        return Prediction(
            float(flops), float(n[0]), float(d[0]), float(loss[0]), _interval(n_s, self.level),
            _interval(d_s, self.level), _interval(loss_s, self.level), self.level,
        )  # fmt: skip


def _optimum(theta: np.ndarray, flops: float):
    a_, b_, e_, alpha, beta = theta.T
    g = (alpha * np.exp(a_) / (beta * np.exp(b_))) ** (1.0 / (alpha + beta))
    n = g * (flops / 6.0) ** (beta / (alpha + beta))
    d = flops / (6.0 * n)
    return n, d, np.exp(e_) + np.exp(a_) / n**alpha + np.exp(b_) / d**beta


def _huber_terms(theta: np.ndarray, log_n, log_d, log_l, delta: float):
    """Summed Huber of ln L̂ - ln L over runs, per row of theta [starts, 5], and its gradient."""
    a_, b_, e_, alpha, beta = (theta[:, i : i + 1] for i in range(5))
    terms = np.stack(
        [a_ - alpha * log_n, b_ - beta * log_d, np.broadcast_to(e_, (theta.shape[0], log_n.size))]
    )
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    r = top + np.log(total) - log_l
    huber = np.where(np.abs(r) <= delta, 0.5 * r**2, delta * (np.abs(r) - 0.5 * delta))
    slope = np.clip(r, -delta, delta) * weights / total  # [3, starts, runs]
    grad = np.stack(
        [slope[0].sum(1), slope[1].sum(1), slope[2].sum(1),
         -(slope[0] * log_n).sum(1), -(slope[1] * log_d).sum(1)], axis=1,
    )  # fmt: skip
    return huber.sum(axis=1), grad


def _grid() -> np.ndarray:
    """Hoffmann et al.'s starts: α, β ∈ {0, .5, …, 2}, e ∈ {-1, -.5, …, 1.5}, a, b ∈ {0, 5, …, 25}
    (5,400 points)."""
    axes = (np.arange(0, 26, 5.0), np.arange(0, 26, 5.0), np.arange(-1, 1.6, 0.5))
    exps = np.arange(0, 2.1, 0.5)
    return np.stack(np.meshgrid(*axes, exps, exps, indexing="ij"), -1).reshape(-1, 5)


def _minimize(start: np.ndarray, data, delta: float) -> np.ndarray:
    def objective(theta):
        value, grad = _huber_terms(theta[None, :], *data, delta)
        return value[0] / delta, grad[0] / delta  # scaled so L-BFGS-B's relative ftol bites

    bounds = [(None, None)] * 3 + [(1e-3, 5.0)] * 2
    options = {"maxiter": 5000, "ftol": 1e-15, "gtol": 1e-10}
    return minimize(objective, start, jac=True, method="L-BFGS-B", bounds=bounds, options=options).x


def fit_parametric(
    runs: Runs,
    delta: float = HUBER_DELTA,
    starts: int = 16,
    bootstrap: int = 100,
    level: float = 0.9,
    seed: int = 0,
) -> ParametricFit:
    """Approach 3: minimise Σ Huber_δ(LSE(a - α ln N, b - β ln D, e) - ln L) over (a, b, e, α, β)
    with L-BFGS-B from the `starts` best points of Hoffmann et al.'s grid; A=eᵃ, B=eᵇ, E=eᵉ."""
    if runs.loss.size < 5:
        raise UsageError(f"{runs.loss.size} runs; L(N, D) has 5 parameters and needs more runs")
    data = (np.log(runs.params), np.log(runs.tokens), np.log(runs.loss))
    grid = _grid()
    values, _ = _huber_terms(grid, *data, delta)
    fitted = [_minimize(s, data, delta) for s in grid[np.argsort(values)[:starts]]]
    scores = [_huber_terms(t[None, :], *data, delta)[0][0] for t in fitted]
    best = fitted[int(np.argmin(scores))]
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(bootstrap):
        pick = rng.choice(runs.loss.size, runs.loss.size)
        samples.append(_minimize(best, tuple(x[pick] for x in data), delta))
    a_, b_, e_, alpha, beta = best
    return ParametricFit(
        float(np.exp(e_)), float(np.exp(a_)), float(np.exp(b_)), float(alpha), float(beta),
        float(beta / (alpha + beta)), float(alpha / (alpha + beta)), float(min(scores)), level,
        np.array(samples).reshape(-1, 5),
    )  # fmt: skip
