"""A PNG of `keel runs report`: drops and load by step, and drops by context length (matplotlib,
Agg backend: no display needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: files only, no display

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from keel.train.run_report import RunReport

DPI = 100
DROP_LABELS = {
    "drop_rate": "all",
    "drop_rate_send": "send",
    "drop_rate_recv": "receive",
}


def plot_report(report: RunReport) -> Figure:
    """MoE: drop rates by step, load max/mean by step, drop rates by seq_len (bars), phase
    boundaries marked. Dense: the loss by step, titled as having no router."""
    series = report.series
    if not report.router:
        figure, axis = plt.subplots(figsize=(5, 3.6))
        axis.plot(series["step"], series["loss"], color="tab:blue")
        axis.set(title="loss (dense run: no router)", xlabel="step", ylabel="loss (nats/token)")
        _phase_lines(axis, report)
        figure.suptitle(report.run, fontsize=9)
        figure.tight_layout()
        return figure
    figure, (drops, load, context) = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, label in DROP_LABELS.items():
        drops.plot(series["step"], series[name], label=label)
    drops.set(title="drop rate by step", xlabel="step", ylabel="dropped / assignments")
    drops.legend(fontsize=7)
    _phase_lines(drops, report)
    load.plot(series["step"], series["load_max_over_mean"], color="tab:red")
    load.set(title="load max/mean (max over layers)", xlabel="step", ylabel="max / mean")
    _phase_lines(load, report)
    rows = report.by_seq_len
    width = 0.8 / len(DROP_LABELS)
    for index, (name, label) in enumerate(DROP_LABELS.items()):
        positions = [i + (index - 1) * width for i in range(len(rows))]
        context.bar(positions, [getattr(row, name) for row in rows], width, label=label)
    context.set_xticks(range(len(rows)), [str(row.seq_len) for row in rows])
    context.set(title="drops by context length", xlabel="seq_len (tokens)", ylabel="drop rate")
    context.legend(fontsize=7)
    figure.suptitle(report.run, fontsize=9)
    figure.tight_layout()
    return figure


def save_report_plot(report: RunReport, path: str) -> None:
    """Write plot_report(report) to `path` as a PNG."""
    figure = plot_report(report)
    try:
        figure.savefig(path, dpi=DPI, format="png")
    finally:
        plt.close(figure)


def _phase_lines(axis: plt.Axes, report: RunReport) -> None:
    """A dotted vertical line where each phase after the first begins, labelled with its name."""
    for phase in report.phases[1:]:
        axis.axvline(phase.first_step - 0.5, color="grey", linestyle=":", linewidth=1)
        axis.annotate(
            f"{phase.name} ({phase.seq_len})",
            (phase.first_step, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            va="top",
        )
