"""`keel runs ...`: commands about existing training runs (`keel runs lineage RUN`)."""

from __future__ import annotations

from dataclasses import asdict

import typer
from rich.markup import escape
from rich.table import Table

from keel.cli.output import print_json, stdout, user_errors

app = typer.Typer(
    name="runs",
    help="Commands about existing training runs: where a run branched from (lineage).",
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
