"""`keel data ...`: each DataKit stage as a command over document-set directories."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import typer
from rich.table import Table

from keel.cli.output import print_json, stdout, user_errors
from keel.core.errors import UsageError
from keel.data.documents import StageReport
from keel.data.mix import MixConfig, MixSource, run_mix
from keel.data.stats import data_stats
from keel.flow import RunOptions

app = typer.Typer(
    name="data",
    help="DataKit: raw documents -> deduplicated, decontaminated training tokens.\n\n"
    "Each command reads a document set (a directory of part-*.parquet files, or a glob) and "
    "writes one; see docs/data.md.",
    no_args_is_help=True,
)

INPUT = typer.Option(..., "--input", "-i", help="Input document set: a directory or a glob.")
OUTPUT = typer.Option(..., "--output", "-o", help="Output directory (replaced atomically).")
WORKERS = typer.Option(None, "--workers", help="keel/flow workers (default: all cores).")
BACKEND = typer.Option("local", "--backend", help="keel/flow backend: local or ray.")
JSON = typer.Option(False, "--json", help="Print the stage report as one JSON object.")


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="data")


def run_stage(
    run: Callable[..., StageReport],
    input: str,
    output: str,
    config: object,
    workers: int | None,
    backend: str,
    as_json: bool,
) -> StageReport:
    """Run one stage with the chosen backend and print its report."""
    report = run(input, output, config, flow_options(workers, backend))
    show_report(report, output, as_json)
    return report


def flow_options(workers: int | None, backend: str) -> RunOptions:
    if backend not in ("local", "ray"):
        raise UsageError(f"--backend {backend!r}: use local or ray")
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    return RunOptions(backend=backend, workers=workers)


def show_report(report: StageReport, output: str, as_json: bool) -> None:
    if as_json:
        print_json(dataclasses.asdict(report))
        return
    dropped = sum(report.dropped.values())
    stdout.print(
        f"[bold]{report.stage}[/]: {report.documents_in:,} documents in, "
        f"{report.documents_out:,} out, {dropped:,} dropped -> {output}"
    )
    for reason, count in sorted(report.dropped.items(), key=lambda item: -item[1]):
        stdout.print(f"  {reason}: {count:,}")


@app.command("mix")
@user_errors
def mix_command(
    source: list[str] = typer.Option(
        ..., "--source", help="DIR=WEIGHT (repeatable): a document set and its token weight."
    ),
    output: str = OUTPUT,
    total_tokens: int | None = typer.Option(None, "--total-tokens", help="Target tokens."),
    bytes_per_token: float = typer.Option(4.0, "--bytes-per-token", help="Token estimate."),
    workers: int | None = WORKERS,
    backend: str = BACKEND,
    as_json: bool = JSON,
) -> None:
    """Mix document sets by token weight; small sources repeat (epochs in mix.json).

    Example: keel data mix --source web/=0.7 --source books/=0.3 --output mix/ --total-tokens 1e9
    """
    sources = tuple(_mix_source(text) for text in source)
    config = MixConfig(sources, total_tokens, bytes_per_token)
    report = run_mix(config, output, flow_options(workers, backend))
    show_report(report, output, as_json)


@app.command("stats")
@user_errors
def stats_command(
    path: str = typer.Argument(..., help="A document set or token cache directory."),
    as_json: bool = JSON,
) -> None:
    """Documents, bytes, tokens (for a token cache) and the stage's drop accounting.

    Example: keel data stats keel-out/dedup-1a2b3c4d
    """
    stats = data_stats(path)
    if as_json:
        print_json(stats.to_dict())
        return
    table = Table("what", "value", title=f"{stats.kind}: {path}")
    table.add_row("documents", f"{stats.documents:,}")
    table.add_row("files", f"{stats.files:,}")
    table.add_row("bytes", f"{stats.bytes:,}")
    if stats.tokens is not None:
        table.add_row("tokens", f"{stats.tokens:,}")
    if stats.stage is not None:
        table.add_row("stage", stats.stage.stage)
        table.add_row("documents in", f"{stats.stage.documents_in:,}")
        for reason, count in sorted(stats.stage.dropped.items()):
            table.add_row(f"dropped: {reason}", f"{count:,}")
    stdout.print(table)


def _mix_source(text: str) -> MixSource:
    path, separator, weight = text.rpartition("=")
    try:
        return MixSource(path, float(weight)) if separator else _bad_source(text)
    except ValueError:
        return _bad_source(text)


def _bad_source(text: str) -> MixSource:
    raise UsageError(f"--source {text!r}: expected DIR=WEIGHT, e.g. web/=0.7")
