"""`keel experiment new|list|show|report`: experiment records in the project's experiments/
(keel.records; docs/experiments.md). Runs join a record with `keel run FILE.py --experiment ID`."""

from __future__ import annotations

from dataclasses import asdict

import typer
from rich.markup import escape
from rich.table import Table

from keel.cli.output import print_json, stderr, stdout, user_errors
from keel.records.record import (
    ExperimentRecord,
    find_record,
    list_records,
    new_record,
    records_root,
)
from keel.records.runs import Invocation, read_invocations

app = typer.Typer(
    name="experiment",
    help="Experiment records: a hypothesis, the runs that test it, and their report.",
    no_args_is_help=True,
)
JSON = typer.Option(False, "--json", help="Print one JSON object on stdout instead of text.")


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="experiment")


@app.command("new")
@user_errors
def new_command(
    name: str = typer.Argument(..., help="A short name, e.g. moe-vs-dense."),
    hypothesis: str = typer.Option(
        ..., "--hypothesis", help="What the runs should show, in a sentence."
    ),
    issue: str | None = typer.Option(None, "--issue", help="The issue the experiment serves."),
    as_json: bool = JSON,
) -> None:
    """Create a record: experiments/<id>-<name>/ with README.md and experiment.yaml.

    Example: keel experiment new muon-vs-adamw --hypothesis "Muon reaches a lower loss in 200
    steps" --issue https://github.com/org/repo/issues/17
    """
    record = new_record(records_root(), name, hypothesis, issue)
    if as_json:
        print_json(_record_json(record))
        return
    stdout.print(f"{record.id}: {record.directory}", highlight=False)
    stderr.print(
        f"next: edit {record.directory}/README.md (setup), then "
        f"`keel run FILE.py --experiment {record.id}`",
        highlight=False,
    )


@app.command("list")
@user_errors
def list_command(as_json: bool = JSON) -> None:
    """List the project's experiment records, oldest first: id, name, status, runs."""
    records = list_records(records_root())
    if as_json:
        rows = [{**_record_json(r), "runs": len(read_invocations(r))} for r in records]
        print_json({"experiments": rows})
        return
    if not records:
        stderr.print(f"no experiment records in {records_root()}: `keel experiment new NAME ...`")
        return
    table = Table("id", "name", "status", "runs", "hypothesis")
    for record in records:
        hypothesis = record.hypothesis if len(record.hypothesis) < 70 else record.hypothesis[:67]
        table.add_row(
            record.id,
            escape(record.name),
            record.status,
            str(len(read_invocations(record))),
            escape(hypothesis + ("..." if hypothesis != record.hypothesis else "")),
        )
    stdout.print(table)


@app.command("show")
@user_errors
def show_command(
    experiment: str = typer.Argument(..., metavar="ID", help="The record's id."),
    as_json: bool = JSON,
) -> None:
    """Show a record: its hypothesis and every run made for it, with outcomes."""
    record = find_record(records_root(), experiment)
    invocations = read_invocations(record)
    if as_json:
        print_json({**_record_json(record), "runs": [asdict(i) for i in invocations]})
        return
    stdout.print(
        f"[bold]{record.id}[/] {escape(record.name)} ({record.status})\n"
        f"hypothesis: {escape(record.hypothesis)}\n"
        + (f"issue: {escape(record.issue)}\n" if record.issue else "")
        + f"record: {record.directory}",
        highlight=False,
    )
    if not invocations:
        stderr.print(f"no runs yet: `keel run FILE.py --experiment {record.id}`")
        return
    table = Table("run", "started", "outcome", "file", "steps")
    for invocation in invocations:
        table.add_row(
            invocation.run,
            invocation.started,
            _outcome(invocation.outcome),
            escape(invocation.experiment_file),
            _step_counts(invocation),
        )
    stdout.print(table)


@app.command("report")
@user_errors
def report_command(
    experiment: str = typer.Argument(..., metavar="ID", help="The record's id."),
    as_json: bool = JSON,
) -> None:
    """Write the record's report: report/report.md and a self-contained report/report.html.

    Every training run with its final metrics (failed and stopped ones marked), loss and eval
    curves against the baseline, router load and drops, data stages, config diffs against the
    baseline, and the git commits, commands and step hashes that reproduce each run.
    """
    from keel.records.report import write_report  # matplotlib: only this command needs it

    record = find_record(records_root(), experiment)
    written = write_report(record)
    if as_json:
        print_json(
            {"id": record.id, "markdown": str(written.markdown), "html": str(written.html)}
            | {"training_runs": written.runs}
        )
        return
    stdout.print(f"{written.markdown}\n{written.html}", highlight=False)
    stderr.print(f"{written.runs} training runs reported")


def _record_json(record: ExperimentRecord) -> dict:
    data = asdict(record)
    data["directory"] = str(record.directory)
    return data


def _outcome(outcome: str) -> str:
    color = {"ok": "green", "failed": "red", "stopped": "magenta"}.get(outcome, "yellow")
    return f"[{color}]{outcome}[/]"


def _step_counts(invocation: Invocation) -> str:
    counts: dict[str, int] = {}
    for step in invocation.steps:
        counts[step["outcome"]] = counts.get(step["outcome"], 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in counts.items()) or "-"
