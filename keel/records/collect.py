"""What a report shows, read back from the runs of an experiment: its training runs (metrics,
config, result, state) and its data stages (stage.json), found through runs.jsonl and the step
stores under each run's prefix.

A committed step's files are its output; a failed or stopped training step keeps its run in the
step's work directory (keel.steps.context.step_work_dir), so its curves are reported too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from keel.core import paths
from keel.records.record import ExperimentRecord
from keel.records.runs import (
    FAILED,
    RUNNING,
    STOPPED,
    STOPPED_ERROR,
    Invocation,
    read_invocations,
)
from keel.steps import StepStore

METRICS_FILE, CONFIG_FILE, RESULT_FILE, STAGE_FILE = (
    "metrics.jsonl",
    "config.yaml",
    "result.json",
    "stage.json",
)
FINAL_KEYS = ("step", "loss", "eval_loss", "eval_bpb", "tokens_per_s", "mfu", "drop_rate")


@dataclass
class TrainingRun:
    """One training step of the experiment: where its run directory is and what it holds."""

    name: str
    dir_name: str
    identity: str
    state: str
    """finished, failed, stopped or running."""
    run_dir: str
    invocation: str
    git_commit: str | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def final(self) -> dict[str, Any]:
        """The last metrics line, with the latest evaluation carried onto it."""
        final: dict[str, Any] = {}
        for line in self.metrics:
            final.update({k: v for k, v in line.items() if k in FINAL_KEYS})
        return final

    @property
    def has_router(self) -> bool:
        return any("router" in line for line in self.metrics)


@dataclass
class DataStage:
    name: str
    dir_name: str
    documents_in: int
    documents_out: int
    dropped: dict[str, int]


@dataclass
class ExperimentData:
    record: ExperimentRecord
    invocations: list[Invocation]
    runs: list[TrainingRun]
    stages: list[DataStage]
    baseline: TrainingRun | None
    steps: list[dict[str, Any]]
    """Every step of every invocation (latest outcome of each NAME-HASH8), for reproducing."""


def collect(record: ExperimentRecord) -> ExperimentData:
    """Read everything the record's runs left: see the module docstring."""
    invocations = read_invocations(record)
    runs: dict[str, TrainingRun] = {}
    stages: dict[str, DataStage] = {}
    steps: dict[str, dict[str, Any]] = {}
    for invocation in invocations:
        store = StepStore(invocation.prefix)
        for step in invocation.steps or _running_steps(invocation, store):
            key = paths.join(store.prefix, step["dir_name"])
            steps[key] = {**step, "run": invocation.run, "git_commit": invocation.git_commit}
            committed = store.output_record(step["dir_name"]) is not None
            place = store.output_dir(step["dir_name"]) if committed else _work(store, step)
            if paths.exists(paths.join(place, METRICS_FILE)):
                runs[key] = _training_run(step, place, committed, invocation)
            elif committed and paths.exists(paths.join(place, STAGE_FILE)):
                stages[key] = _stage(step, place)
    ordered = list(runs.values())
    return ExperimentData(
        record,
        invocations,
        ordered,
        list(stages.values()),
        _baseline(record, ordered),
        list(steps.values()),
    )


def _running_steps(invocation: Invocation, store: StepStore) -> list[dict[str, Any]]:
    """An unfinished invocation lists no steps: the attempts it started, from their records."""
    if invocation.outcome != RUNNING:
        return []
    control = paths.join(store.prefix, ".keel", "steps")
    attempts = [store.attempt_record(name) for name in _listed(control)]
    found = []
    for attempt in sorted(filter(None, attempts), key=lambda attempt: attempt.start_time):
        dir_name = attempt.name + "-" + attempt.identity[:8]
        if attempt.start_time >= invocation.started:
            outcome = {"RUNNING": "running", "SUCCESS": "executed"}.get(attempt.status, "failed")
            found.append(
                {
                    "name": attempt.name,
                    "dir_name": dir_name,
                    "identity": attempt.identity,
                    "outcome": outcome,
                    "output": attempt.output,
                    "error": attempt.error,
                }
            )
    return found


def _listed(directory: str) -> list[str]:
    return paths.list_dir(directory) if paths.exists(directory) else []


def _work(store: StepStore, step: dict[str, Any]) -> str:
    return paths.join(store.control(step["dir_name"]), "work")


def _training_run(step: dict, place: str, committed: bool, invocation: Invocation) -> TrainingRun:
    error = step.get("error")
    if committed:
        state = "finished"
    elif step["outcome"] == "running" or invocation.outcome == RUNNING:
        state = "running"
    elif step["outcome"] == STOPPED or (error or "").startswith(STOPPED_ERROR):
        state = STOPPED
    else:
        state = FAILED
    metrics = [
        json.loads(line)
        for line in paths.read_text(paths.join(place, METRICS_FILE)).splitlines()
        if line.strip()
    ]
    config_path = paths.join(place, CONFIG_FILE)
    config = yaml.safe_load(paths.read_text(config_path)) if paths.exists(config_path) else {}
    return TrainingRun(
        name=step["name"],
        dir_name=step["dir_name"],
        identity=step["identity"],
        state=state,
        run_dir=place,
        invocation=invocation.run,
        git_commit=invocation.git_commit,
        metrics=metrics,
        config=config or {},
        error=error,
    )


def _stage(step: dict, place: str) -> DataStage:
    report = json.loads(paths.read_text(paths.join(place, STAGE_FILE)))
    return DataStage(
        name=step["name"],
        dir_name=step["dir_name"],
        documents_in=int(report.get("documents_in", 0)),
        documents_out=int(report.get("documents_out", 0)),
        dropped={k: int(v) for k, v in report.get("dropped", {}).items()},
    )


def _baseline(record: ExperimentRecord, runs: list[TrainingRun]) -> TrainingRun | None:
    """experiment.yaml's baseline (a step name or NAME-HASH8), else the first training run."""
    if record.baseline:
        for run in runs:
            if record.baseline in (run.name, run.dir_name):
                return run
    return runs[0] if runs else None


def config_diff(run: dict[str, Any], baseline: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, baseline value, run value) for every key whose values differ."""
    mine, theirs = dict(_flat(run)), dict(_flat(baseline))
    return [
        (key, theirs.get(key), mine.get(key))
        for key in sorted(set(mine) | set(theirs))
        if mine.get(key) != theirs.get(key)
    ]


def _flat(value: Any, prefix: str = ""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flat(item, f"{prefix}{key}.")
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for index, item in enumerate(value):
            yield from _flat(item, f"{prefix}{index}.")
    else:
        yield prefix.rstrip("."), value
