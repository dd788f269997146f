"""PNG plots of the scaling-law fits (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: files only, no display

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from keel.scaling.fits import IsoflopFit, ParametricFit, Runs

DPI = 100


def plot_isoflops(fit: IsoflopFit) -> Figure:
    """Loss (nats) against N (parameters) per budget, each with its parabola and minimum N*."""
    figure, axes = plt.subplots(figsize=(6, 4))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(fit.budgets)))
    for budget, color in zip(fit.budgets, colors, strict=True):
        n = np.array(budget.params)
        axes.scatter(n, budget.loss, s=12, color=color, label=f"{budget.flops:.2g} FLOPs")
        grid = np.geomspace(n.min(), n.max(), 100)
        axes.plot(grid, np.polyval(budget.parabola, np.log(grid)), color=color, lw=1)
        axes.scatter([budget.n_opt], [budget.loss_opt], marker="*", s=80, color=color, ec="k")
    axes.set(
        xscale="log", xlabel="parameters N", ylabel="final loss (nats)", title="isoFLOP curves"
    )
    axes.legend(fontsize=7)
    figure.tight_layout()
    return figure


def plot_optimal(fit: IsoflopFit, extrapolate_to: float | None = None) -> Figure:
    """N*(C) and D*(C) with their power laws and bootstrap bands, extrapolated to a larger C."""
    flops = np.array([b.flops for b in fit.budgets])
    top = extrapolate_to or 100.0 * flops.max()
    grid = np.geomspace(flops.min(), max(top, flops.max()), 50)
    log_n = fit.samples[:, :1] + fit.samples[:, 1:2] * np.log(grid)[None, :]  # [bootstrap, grid]
    tail = 50.0 * (1.0 - fit.level)
    band_n = np.exp(np.percentile(log_n, [tail, 100.0 - tail], axis=0))
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    series = (
        ("N* (parameters)", [b.n_opt for b in fit.budgets], fit.G * grid**fit.a, band_n),
        ("D* (tokens)", [b.d_opt for b in fit.budgets], fit.H * grid**fit.b, grid / (6 * band_n)),
    )
    for ax, (label, points, line, band) in zip(axes, series, strict=True):
        ax.scatter(flops, points, color="k", s=14, label="isoFLOP minima")
        ax.plot(grid, line, color="C0", label="power law")
        ax.fill_between(grid, band.min(0), band.max(0), color="C0", alpha=0.2, label="interval")
        prediction = fit.predict(float(grid[-1]))
        value = prediction.n_opt if label.startswith("N") else prediction.d_opt
        ax.scatter([grid[-1]], [value], marker="*", s=90, color="C3", label=f"C={grid[-1]:.2g}")
        ax.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel=label)
        ax.legend(fontsize=7)
    axes[0].set_title(f"N* ∝ C^{fit.a:.3f}")
    axes[1].set_title(f"D* ∝ C^{fit.b:.3f}")
    figure.tight_layout()
    return figure


def plot_predicted_vs_actual(fit: ParametricFit, runs: Runs) -> Figure:
    """Loss predicted by L(N, D) against the measured loss (nats), one point per run."""
    predicted = fit.loss_at(runs.params, runs.tokens)
    figure, axes = plt.subplots(figsize=(4.5, 4.5))
    points = axes.scatter(runs.loss, predicted, c=np.log10(runs.flops), s=12, cmap="viridis")
    low, high = min(runs.loss.min(), predicted.min()), max(runs.loss.max(), predicted.max())
    axes.plot([low, high], [low, high], color="k", lw=0.8, ls="--")
    axes.set(xlabel="actual loss (nats)", ylabel="predicted loss (nats)")
    axes.set_title(f"E={fit.E:.2f}, α={fit.alpha:.2f}, β={fit.beta:.2f}", fontsize=9)
    figure.colorbar(points, ax=axes, label="log10 C (FLOPs)")
    figure.tight_layout()
    return figure


def write_plots(
    runs: Runs,
    isoflop: IsoflopFit,
    parametric: ParametricFit,
    directory: str | Path,
    extrapolate_to: float | None = None,
) -> list[Path]:
    """Write isoflops.png, optimal.png and predicted_vs_actual.png into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    figures = {
        "isoflops.png": plot_isoflops(isoflop),
        "optimal.png": plot_optimal(isoflop, extrapolate_to),
        "predicted_vs_actual.png": plot_predicted_vs_actual(parametric, runs),
    }
    paths = []
    for name, figure in figures.items():
        path = directory / name
        figure.savefig(path, dpi=DPI)
        plt.close(figure)
        paths.append(path)
    return paths
