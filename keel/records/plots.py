"""The report's figures as PNG bytes (matplotlib, Agg backend: files only, no display).

Each function returns None when the runs hold nothing to draw (no evaluation, no MoE layer,
no data stage), so the report leaves that figure out.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from keel.records.collect import DataStage, TrainingRun

DPI = 100
STATE_STYLES = {"finished": "-", "running": "-", "failed": ":", "stopped": "--"}
"""Line style by a run's state: a failed or stopped run is drawn, but marked."""


def loss_plot(runs: list[TrainingRun], baseline: TrainingRun | None) -> bytes | None:
    """Training loss (nats per token) against step, every run; the baseline in black."""
    if not runs:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    for run in runs:
        _curve(axis, run, baseline, "loss")
    axis.set(xlabel="step", ylabel="loss (nats/token)", title="training loss")
    return _png(figure, axis)


def eval_plot(runs: list[TrainingRun], baseline: TrainingRun | None) -> bytes | None:
    """Held-out bits per byte against step, for runs that evaluated."""
    evaluated = [run for run in runs if any("eval_bpb" in line for line in run.metrics)]
    if not evaluated:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    for run in evaluated:
        _curve(axis, run, baseline, "eval_bpb", marker="o")
    axis.set(xlabel="step", ylabel="bits per byte", title="evaluation (held out)")
    return _png(figure, axis)


def router_plot(runs: list[TrainingRun]) -> bytes | None:
    """MoE runs: the most loaded expert over the mean (worst layer) and the token drop rate
    (mean over layers) against step."""
    moe = [run for run in runs if run.has_router]
    if not moe:
        return None
    figure, (load, drops) = plt.subplots(1, 2, figsize=(11, 4))
    for run in moe:
        _curve(load, run, None, "load_max_over_mean")
        _curve(drops, run, None, "drop_rate")
    load.set(xlabel="step", ylabel="max load / mean load", title="router load (worst layer)")
    drops.set(xlabel="step", ylabel="fraction of tokens", title="drop rate (mean of layers)")
    load.legend(fontsize=7)
    figure.tight_layout()
    return _save(figure)


def stages_plot(stages: list[DataStage]) -> bytes | None:
    """Documents in and out of each data stage, in run order."""
    if not stages:
        return None
    figure, axis = plt.subplots(figsize=(7, 0.5 * len(stages) + 1.5))
    rows = range(len(stages))
    axis.barh(rows, [s.documents_in for s in stages], color="lightgray", label="in")
    axis.barh(rows, [s.documents_out for s in stages], color="tab:blue", label="kept")
    axis.set_yticks(rows, [s.name for s in stages], fontsize=8)
    axis.invert_yaxis()
    axis.set(xlabel="documents", title="data stages: documents in and kept")
    return _png(figure, axis)


def _curve(
    axis: plt.Axes,
    run: TrainingRun,
    baseline: TrainingRun | None,
    key: str,
    marker: str | None = None,
) -> None:
    points = [(line["step"], line[key]) for line in run.metrics if key in line]
    if not points:
        return
    steps, values = zip(*points, strict=True)
    is_baseline = baseline is not None and run.dir_name == baseline.dir_name
    label = run.dir_name + (" (baseline)" if is_baseline else "")
    label += "" if run.state == "finished" else f" [{run.state}]"
    axis.plot(
        steps,
        values,
        STATE_STYLES.get(run.state, "-"),
        marker=marker,
        color="black" if is_baseline else None,
        linewidth=2.0 if is_baseline else 1.2,
        label=label,
    )


def _png(figure: Figure, axis: plt.Axes) -> bytes:
    axis.legend(fontsize=7)
    figure.tight_layout()
    return _save(figure)


def _save(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, dpi=DPI, format="png")
    finally:
        plt.close(figure)
    return buffer.getvalue()
