"""How `keel data stats` and `keel data head` print: tables, text histograms, sample documents."""

from __future__ import annotations

import json
from typing import Any

from rich.markup import escape
from rich.table import Table

from keel.cli.output import stdout
from keel.data.documents import ID_COLUMN, TEXT_COLUMN
from keel.data.stats import DataStats, Histogram

BAR_WIDTH = 40
"""Characters of the longest bar of a text histogram."""
VALUE_CHARS = 80
"""A non-text column's value is cut to this many characters in `keel data head`."""


def show_stats(stats: DataStats) -> None:
    table = Table("what", "value", title=f"{stats.kind}: {stats.path}")
    table.add_row("documents", f"{stats.documents:,}")
    if stats.bytes is not None:
        table.add_row("text bytes (UTF-8)", f"{stats.bytes:,}")
    if stats.tokens is not None:
        table.add_row("tokens", f"{stats.tokens:,}")
    table.add_row("files", f"{stats.files:,}")
    table.add_row("file bytes", f"{stats.file_bytes:,}")
    for key, value in stats.extra.items():
        table.add_row(key, str(value))
    if stats.stage is not None:
        table.add_row("stage", stats.stage.stage)
        table.add_row("documents in", f"{stats.stage.documents_in:,}")
        for reason, count in sorted(stats.stage.dropped.items()):
            table.add_row(f"dropped: {reason}", f"{count:,}")
    stdout.print(table)
    if stats.length is not None:
        show_histogram(f"document length ({stats.length.unit})", stats.length)
    if stats.language is not None:
        show_histogram("language", stats.language)
    if stats.quality is not None:
        show_histogram("quality score", stats.quality)
    elif stats.kind == "documents":
        missing = " and no language" if stats.language is None else ""
        stdout.print(
            f"\n[dim]no quality_score column{missing}: `keel data quality --model FILE` adds "
            "them[/]"
        )


def show_histogram(title: str, histogram: Histogram) -> None:
    """`title`, then one line per bin: label, count, a bar scaled to the largest bin."""
    rows = list(histogram.bins) + ([("null", histogram.nulls)] if histogram.nulls else [])
    stdout.print(f"\n[bold]{title}[/]")
    if not rows:
        stdout.print("  (no documents)")
        return
    largest = max(count for _, count in rows) or 1
    label_width = max(len(label) for label, _ in rows)
    count_width = max(len(f"{count:,}") for _, count in rows)
    for label, count in rows:
        bar = "█" * round(BAR_WIDTH * count / largest)
        stdout.print(
            f"  {escape(label):>{label_width}}  {count:>{count_width},}  {bar}", highlight=False
        )


def show_documents(documents: list[dict[str, Any]], chars: int) -> None:
    """Each document: a header line of its id and other columns, then its text (cut to `chars`)."""
    for number, document in enumerate(documents, 1):
        columns = [
            f"{name}={_short(value)}"
            for name, value in document.items()
            if name not in (ID_COLUMN, TEXT_COLUMN)
        ]
        stdout.print(
            f"[bold]#{number} {escape(str(document.get(ID_COLUMN, '')))}[/] "
            + escape(" ".join(columns)),
            highlight=False,
        )
        text = document.get(TEXT_COLUMN) or ""
        cut = f" [dim]... ({len(text) - chars:,} more characters)[/]" if len(text) > chars else ""
        stdout.print(escape(text[:chars]) + cut, highlight=False)
        stdout.print()


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 3] + "..."
