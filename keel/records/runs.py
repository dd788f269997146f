"""An experiment record's runs.jsonl: each `keel run ... --experiment ID` made for it.

Two lines per invocation, appended: `started` (experiment file, prefix, command, git commit)
before any step runs, and `finished` (outcome, each step's name, NAME-HASH8 and outcome) after.
An invocation with no `finished` line is still running, or was killed. Cached steps are listed
too: a run of an experiment may reuse outputs another experiment (or none) made.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from keel.records.record import ExperimentRecord
from keel.steps import RunReport, Step, all_steps

RUNS_FILE = "runs.jsonl"
OK, FAILED, STOPPED, RUNNING = "ok", "failed", "stopped", "running"
STOPPED_ERROR = "Stopped:"
"""How a step stopped by SIGTERM (keel.core.stop.Stopped) starts its error line."""


@dataclass
class Invocation:
    """One `keel run` for the experiment, as runs.jsonl tells it."""

    run: str
    started: str
    experiment_file: str
    prefix: str
    command: list[str]
    git_commit: str | None
    finished: str | None = None
    outcome: str = RUNNING
    steps: list[dict[str, Any]] = field(default_factory=list)
    """name, dir_name, identity, outcome (executed/cached/failed), output, error."""


def start_invocation(
    record: ExperimentRecord,
    experiment_file: str,
    prefix: str,
    command: list[str],
    git_commit: str | None,
) -> str:
    """Append the `started` line of a new invocation; its run id (time and a random tail)."""
    moment = datetime.now(UTC)
    run = f"{moment.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(2)}"
    _append(
        record,
        {
            "event": "started",
            "run": run,
            "time": moment.isoformat(timespec="seconds"),
            "experiment_file": experiment_file,
            "prefix": prefix,
            "command": command,
            "git_commit": git_commit,
            "pid": os.getpid(),
        },
    )
    return run


def finish_invocation(
    record: ExperimentRecord, run: str, steps: list[Step], report: RunReport | None
) -> str:
    """Append the `finished` line: the outcome and every step's; None report: the run raised
    before its steps reported (stopped). Returns the outcome."""
    rows = []
    for step in all_steps(steps):
        error = report.errors.get(step.dir_name) if report else None
        stopped = (error or "").startswith(STOPPED_ERROR)
        outcome = STOPPED if stopped else _step_outcome(step, report)
        rows.append(
            {
                "name": step.name,
                "dir_name": step.dir_name,
                "identity": step.identity,
                "outcome": outcome,
                "output": report.outputs.get(step.name) if report else None,
                "error": error,
            }
        )
    if report is None or any(row["outcome"] == STOPPED for row in rows):
        outcome = STOPPED
    else:
        outcome = OK if report.ok else FAILED
    _append(
        record,
        {
            "event": "finished",
            "run": run,
            "time": datetime.now(UTC).isoformat(timespec="seconds"),
            "outcome": outcome,
            "steps": rows,
        },
    )
    return outcome


def read_invocations(record: ExperimentRecord) -> list[Invocation]:
    """The record's invocations in the order they started."""
    path = record.directory / RUNS_FILE
    if not path.is_file():
        return []
    by_run: dict[str, Invocation] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        if entry["event"] == "started":
            by_run[entry["run"]] = Invocation(
                run=entry["run"],
                started=entry["time"],
                experiment_file=entry["experiment_file"],
                prefix=entry["prefix"],
                command=entry["command"],
                git_commit=entry.get("git_commit"),
            )
        elif entry["event"] == "finished" and entry["run"] in by_run:
            invocation = by_run[entry["run"]]
            invocation.finished = entry["time"]
            invocation.outcome = entry["outcome"]
            invocation.steps = entry["steps"]
    return list(by_run.values())


def _step_outcome(step: Step, report: RunReport | None) -> str:
    if report is None:
        return STOPPED
    for outcome in ("executed", "cached", "failed"):
        if step.name in getattr(report, outcome):
            return outcome
    return "not run"


def _append(record: ExperimentRecord, entry: dict[str, Any]) -> None:
    """One line, appended in one write (lines of concurrent runs do not interleave)."""
    with Path(record.directory, RUNS_FILE).open("a") as file:
        file.write(json.dumps(entry, sort_keys=True) + "\n")
