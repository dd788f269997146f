"""Training runs as the dashboard shows them: the runs table, metric series and config diffs.

Metrics come from telemetry's `train.metrics` (long form: ts, run, step, name, value; see
keel.telemetry.sink), so the charts show exactly what the store holds. A run's config and state
come from its run directory (config.yaml, result.json) and, for a run trained as a step, from the
step store's records. `run` is the name the trainer reported under (its output path).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from datetime import UTC
from pathlib import Path
from typing import Any

import yaml

from keel.dashboard.sources import Sources, sql_text
from keel.steps.store import StepStore
from keel.telemetry.sink import METRICS_NAMESPACE
from keel.train.run_dir import CONFIG_FILE, RESULT_FILE

TABLE_METRICS = ("loss", "eval_bpb", "mfu", "tokens_per_s")
"""The last value of each of these is a column of the runs table."""
LIVE_SECONDS = 120.0
"""A run without result.json that reported within this many seconds counts as running."""
_METRICS = f'"{METRICS_NAMESPACE}"'


def has_metrics(sources: Sources) -> bool:
    telemetry = sources.telemetry
    return telemetry is not None and METRICS_NAMESPACE in telemetry.namespaces()


def list_runs(sources: Sources) -> list[dict[str, Any]]:
    """One row per run: run, name, state, experiment, step, last_report (ISO time, UTC) and the
    last value of each TABLE_METRICS name (None when the run never reported it), newest first."""
    if not has_metrics(sources):
        return []
    assert sources.telemetry is not None
    summary = sources.telemetry.query(
        f"SELECT run, max(step) AS step, max(ts) AS last FROM {_METRICS} GROUP BY run"
    ).to_pylist()
    names = ", ".join(sql_text(name) for name in TABLE_METRICS)
    last = sources.telemetry.query(
        f"SELECT run, name, arg_max(value, step) AS value FROM {_METRICS} "
        f"WHERE name IN ({names}) GROUP BY run, name"
    ).to_pylist()
    values: dict[str, dict[str, float]] = {}
    for row in last:
        values.setdefault(row["run"], {})[row["name"]] = row["value"]
    records = _step_records(sources)
    runs = []
    for row in summary:
        run = row["run"]
        directory = run_directory(sources, run)
        record = records.get(Path(run).name)
        runs.append(
            {
                "run": run,
                "name": Path(run).name,
                "state": _state(directory, record, row["last"]),
                "experiment": _experiment(record),
                "step": row["step"],
                "last_report": row["last"].replace(tzinfo=UTC).isoformat(),
                **{name: values.get(run, {}).get(name) for name in TABLE_METRICS},
            }
        )
    return sorted(runs, key=lambda run: run["last_report"], reverse=True)


def metric_names(sources: Sources, run: str) -> list[str]:
    """The metric names `run` reported, sorted."""
    if not has_metrics(sources):
        return []
    assert sources.telemetry is not None
    table = sources.telemetry.query(
        f"SELECT DISTINCT name FROM {_METRICS} WHERE run = {sql_text(run)} ORDER BY name"
    )
    return table.column("name").to_pylist()


def metric_series(sources: Sources, run: str, names: list[str]) -> dict[str, list[list[float]]]:
    """{name: [steps, values]} of `run`, ascending by step; a step reported twice (a resumed
    run) keeps its latest row."""
    if not names or not has_metrics(sources):
        return {name: [[], []] for name in names}
    assert sources.telemetry is not None
    wanted = ", ".join(sql_text(name) for name in names)
    rows = sources.telemetry.query(
        f"SELECT name, step, arg_max(value, ts) AS value FROM {_METRICS} "
        f"WHERE run = {sql_text(run)} AND name IN ({wanted}) GROUP BY name, step "
        "ORDER BY name, step"
    ).to_pydict()
    series: dict[str, list[list[float]]] = {name: [[], []] for name in names}
    for name, step, value in zip(rows["name"], rows["step"], rows["value"], strict=True):
        series[name][0].append(step)
        series[name][1].append(value)
    return series


def run_directory(sources: Sources, run: str) -> Path | None:
    """Where `run`'s files are: its reported path, else a directory of that name under the prefix
    (a prefix copied or mounted elsewhere); None when neither exists."""
    candidates = [Path(run)]
    if sources.root is not None:
        if not Path(run).is_absolute():
            candidates.append(sources.root.parent / run)
        candidates.append(sources.root / Path(run).name)
    return next((path for path in candidates if path.is_dir()), None)


def run_config(sources: Sources, run: str) -> dict[str, Any]:
    """The config the run trained under (its config.yaml, else its step record's config; {}
    when neither is there, e.g. with --url)."""
    directory = run_directory(sources, run)
    if directory is not None and (directory / CONFIG_FILE).is_file():
        return yaml.safe_load((directory / CONFIG_FILE).read_text()) or {}
    entry = _step_records(sources).get(Path(run).name)
    return dict(entry.record.config) if entry is not None else {}


def config_diff(sources: Sources, first: str, second: str) -> list[dict[str, Any]]:
    """The config keys (dotted) whose values differ between two runs: key, a, b (None: absent)."""
    a = dict(flatten(run_config(sources, first)))
    b = dict(flatten(run_config(sources, second)))
    return [
        {"key": key, "a": a.get(key), "b": b.get(key)}
        for key in sorted(a.keys() | b.keys())
        if a.get(key) != b.get(key)
    ]


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf value) of nested dicts and lists; list items by index."""
    if isinstance(value, Mapping):
        if not value and prefix:
            yield prefix[:-1], {}
        for key, item in value.items():
            yield from flatten(item, f"{prefix}{key}.")
    elif isinstance(value, list | tuple) and value:
        for index, item in enumerate(value):
            yield from flatten(item, f"{prefix}{index}.")
    else:
        yield prefix[:-1], list(value) if isinstance(value, tuple) else value


def _step_records(sources: Sources) -> dict[str, Any]:
    """{output directory name: StepEntry} of the prefix's steps."""
    if sources.root is None:
        return {}
    return {entry.dir_name: entry for entry in StepStore(str(sources.root)).entries()}


def _state(directory: Path | None, entry: Any, last_report: Any) -> str:
    if entry is not None:
        return {"SUCCESS": "finished"}.get(entry.state, entry.state.lower())
    if directory is not None and (directory / RESULT_FILE).is_file():
        return "finished"
    age = time.time() - last_report.replace(tzinfo=UTC).timestamp()
    return "running" if age < LIVE_SECONDS else "stopped"


def _experiment(entry: Any) -> str:
    """The experiment record a run belongs to, when its step record names one."""
    if entry is None:
        return ""
    return str(entry.record.extra.get("experiment", ""))
