"""A PNG of `keel data stats`' histograms (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: files only, no display

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from keel.data.stats import DataStats, Histogram

DPI = 100


def plot_stats(stats: DataStats) -> Figure:
    """One bar chart per histogram the stats hold (length; language and quality when present)."""
    shown = [
        (title, histogram)
        for title, histogram in (
            (f"document length ({stats.length.unit})" if stats.length else "", stats.length),
            ("language", stats.language),
            ("quality score", stats.quality),
        )
        if histogram is not None
    ]
    figure, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 3.6), squeeze=False)
    for axis, (title, histogram) in zip(axes[0], shown, strict=True):
        _bars(axis, histogram, title)
    figure.suptitle(f"{stats.path}: {stats.documents:,} documents", fontsize=9)
    figure.tight_layout()
    return figure


def save_stats_plot(stats: DataStats, path: str) -> None:
    """Write plot_stats(stats) to `path` as a PNG."""
    figure = plot_stats(stats)
    try:
        figure.savefig(path, dpi=DPI, format="png")
    finally:
        plt.close(figure)


def _bars(axis: plt.Axes, histogram: Histogram, title: str) -> None:
    labels = [label for label, _ in histogram.bins]
    counts = [count for _, count in histogram.bins]
    if histogram.nulls:
        labels.append("null")
        counts.append(histogram.nulls)
    axis.bar(range(len(counts)), counts, color="tab:blue")
    axis.set_xticks(range(len(counts)), labels, rotation=45, ha="right", fontsize=7)
    axis.set(title=title, ylabel="documents")
