"""`keel runs ...`: commands about existing training runs (`keel runs lineage RUN`, `keel runs
report RUN`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.table import Table

from keel.cli.output import print_json, stdout, user_errors

if TYPE_CHECKING:  # the report's module loads only in the command that needs it
    from keel.train.run_report import PhaseReport, RouterNumbers, RunReport

app = typer.Typer(
    name="runs",
    # The first paragraph is keel/cli/main.py's COMMANDS line (tests/cli/test_lazy_cli.py).
    help="Existing training runs: where one branched from (lineage), its router report.",
    no_args_is_help=True,
)


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="runs")


@app.command("lineage")
@user_errors
def lineage_command(
    run: str = typer.Argument(..., help="A run directory (a local path or a URL)."),
    as_json: bool = typer.Option(False, "--json", help="Print the lineage as JSON."),
) -> None:
    """RUN's ancestry, nearest first: the run each one branched from (`keel train --from`),
    at which step, and that parent's config identity.

    Examples:
      keel runs lineage runs/cooldown
      keel runs lineage s3://bucket/runs/cooldown --json
    """
    from keel.train.branch import lineage

    links = lineage(run)
    if as_json:
        print_json({"run": run, "lineage": [asdict(link) for link in links]})
        return
    if not links:
        stdout.print(f"{escape(run)} started from scratch: no parent")
        return
    table = Table("run", "branched from", "at step", "parent config")
    for link in links:
        parent_config = link.parent_config[:16]
        table.add_row(escape(link.run), escape(link.parent), str(link.step), parent_config)
    stdout.print(table)


@app.command("report")
@user_errors
def report_command(
    run: str = typer.Argument(..., help="A run directory (a local path or a URL)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
    plot: str = typer.Option(
        "", "--plot", help="Also write a PNG: drops and load by step, drops by context length."
    ),
) -> None:
    """RUN's router per phase and sequence length: drop rate (all, send, receive), load
    max/mean and balance loss, means over each phase's steps, per MoE layer too, and drops by
    context length. A dense run has no router: one line says so, and the steps and loss per
    phase follow (exit 0).

    Examples:
      keel runs report runs/moe
      keel runs report runs/moe --json
      keel runs report runs/moe --plot moe-report.png
    """
    from keel.train.run_report import run_report

    report = run_report(run)
    if plot:
        from keel.train.run_report_plot import save_report_plot

        save_report_plot(report, plot)
    if as_json:
        print_json(report.to_json())
        return
    _print_report(report)
    if plot:
        stdout.print(f"plot: {escape(plot)}")


def _print_report(report: RunReport) -> None:
    """The report as rich tables: phases, per-layer numbers, drops by context length, events."""
    if not report.router:
        stdout.print(f"{escape(report.run)} is a dense run: no router, nothing dropped")
        table = Table("phase", "seq_len", "steps", "loss", title="phases")
        for phase in report.phases:
            table.add_row(
                escape(phase.name), str(phase.seq_len), _steps(phase), f"{phase.loss:.4f}"
            )
        stdout.print(table)
        _print_events(report.events)
        return
    columns = ("drop", "send", "receive", "load max/mean", "balance loss")
    table = Table("phase", "seq_len", "steps", "loss", *columns, title="router per phase")
    for phase in report.phases:
        table.add_row(
            escape(phase.name),
            str(phase.seq_len),
            _steps(phase),
            f"{phase.loss:.4f}",
            *_router_cells(phase.router),
        )
    stdout.print(table)
    layers = Table("phase", "layer", *columns, title="per MoE layer")
    for phase in report.phases:
        for index, numbers in enumerate(phase.layers):
            layers.add_row(escape(phase.name), str(index), *_router_cells(numbers))
    stdout.print(layers)
    context = Table("seq_len", "steps", "drop", "send", "receive", title="drops by context length")
    for row in report.by_seq_len:
        context.add_row(
            str(row.seq_len),
            str(row.steps),
            _percent(row.drop_rate),
            _percent(row.drop_rate_send),
            _percent(row.drop_rate_recv),
        )
    stdout.print(context)
    _print_events(report.events)


def _router_cells(numbers: RouterNumbers) -> list[str]:
    balance = "-" if numbers.balance_loss is None else f"{numbers.balance_loss:.3g}"
    return [
        _percent(numbers.drop_rate),
        _percent(numbers.drop_rate_send),
        _percent(numbers.drop_rate_recv),
        f"{numbers.load_max_over_mean:.3f}",
        balance,
    ]


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.2f}%"


def _steps(phase: PhaseReport) -> str:
    return f"{phase.steps} ({phase.first_step}-{phase.last_step})"


def _print_events(events: tuple[dict[str, Any], ...]) -> None:
    for event in events:
        details = ", ".join(
            f"{key}={value}" for key, value in event.items() if key not in ("event", "step")
        )
        stdout.print(
            f"event at step {event.get('step')}: {escape(event.get('event', '?'))} "
            f"{escape(details)}".rstrip()
        )
