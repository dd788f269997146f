"""Training runs as the dashboard shows them: the runs table, metric series and config diffs.

Metrics come from telemetry's `train.metrics` (long form: ts, run, step, name, value; see
keel.telemetry.sink), so the charts show exactly what the store holds. A run directory directly
under the prefix that never reported there (`keel train` without a telemetry target) is read from
its own metrics.jsonl instead, nested values flattened to the same dotted names. A run's config
and state come from its run directory (config.yaml, result.json) and, for a run trained as a step,
from the step store's records. `run` is the name the trainer reported under (its output path), or
a metrics.jsonl run's directory. Only known runs are read: any other name is a UsageError.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from keel.core.errors import UsageError
from keel.dashboard.sources import Sources, sql_text
from keel.steps.store import StepStore
from keel.telemetry.sink import METRICS_NAMESPACE
from keel.telemetry.sink import flatten as flatten_numbers
from keel.train.run_dir import CONFIG_FILE, METRICS_FILE, RESULT_FILE

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
    runs = _telemetry_runs(sources)
    reported = {Path(run["run"]).name for run in runs}
    records = _step_records(sources)
    for directory in _file_runs(sources):
        if directory.name in reported:
            continue
        series = _file_series(directory)
        steps = series.get("loss", [[0], []])[0] or [0]
        last = datetime.fromtimestamp((directory / METRICS_FILE).stat().st_mtime, UTC)
        record = records.get(directory.name)
        runs.append(
            {
                "run": str(directory),
                "name": directory.name,
                "state": _state(directory, record, last),
                "experiment": _experiment(record),
                "step": max(steps),
                "last_report": last.isoformat(),
                **{name: (series.get(name) or [[], [None]])[1][-1] for name in TABLE_METRICS},
            }
        )
    return sorted(runs, key=lambda run: run["last_report"], reverse=True)


def _telemetry_runs(sources: Sources) -> list[dict[str, Any]]:
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
    return runs


def metric_names(sources: Sources, run: str) -> list[str]:
    """The metric names `run` reported, sorted."""
    directory = _file_run(sources, run)
    if directory is not None:
        return sorted(_file_series(directory))
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
    directory = _file_run(sources, run)
    if directory is not None:
        stored = _file_series(directory)
        return {name: stored.get(name, [[], []]) for name in names}
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
    (a prefix copied or mounted elsewhere); None when neither exists. Call with known runs only
    (check_run)."""
    candidates = [Path(run)]
    if sources.root is not None:
        if not Path(run).is_absolute():
            candidates.append(sources.root.parent / run)
        candidates.append(sources.root / Path(run).name)
    return next((path for path in candidates if path.is_dir()), None)


def run_config(sources: Sources, run: str) -> dict[str, Any]:
    """The config the run trained under (its config.yaml, else its step record's config; {}
    when neither is there, e.g. with --url)."""
    check_run(sources, run)
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


def check_run(sources: Sources, run: str) -> None:
    """UsageError unless `run` reported to telemetry or is a metrics.jsonl run under the prefix
    (so a request cannot make the dashboard read files elsewhere)."""
    if _file_run(sources, run) is not None:
        return
    if has_metrics(sources):
        assert sources.telemetry is not None
        found = sources.telemetry.query(
            f"SELECT run FROM {_METRICS} WHERE run = {sql_text(run)} LIMIT 1"
        )
        if found.num_rows:
            return
    raise UsageError(f"no run {run!r}: see the runs table")


def _file_runs(sources: Sources) -> list[Path]:
    """Run directories directly under the prefix with a metrics.jsonl."""
    if sources.root is None:
        return []
    return sorted(path.parent for path in sources.root.glob(f"*/{METRICS_FILE}"))


def _file_run(sources: Sources, run: str) -> Path | None:
    """`run` as a metrics.jsonl run under the prefix that never reported to telemetry, or None."""
    if sources.root is None:
        return None
    directory = Path(run)
    if directory.parent != sources.root or not (directory / METRICS_FILE).is_file():
        return None
    if has_metrics(sources):
        assert sources.telemetry is not None
        reported = sources.telemetry.query(
            f"SELECT run FROM {_METRICS} WHERE run LIKE {sql_text('%' + directory.name)} LIMIT 1"
        )
        if reported.num_rows:
            return None
    return directory


def _file_series(directory: Path) -> dict[str, list[list[float]]]:
    """{name: [steps, values]} of a run's metrics.jsonl (nested values as dotted names)."""
    by_name: dict[str, dict[int, float]] = {}
    with (directory / METRICS_FILE).open() as lines:
        for line in lines:
            if not line.strip():
                continue
            record = json.loads(line)
            step = int(record["step"])
            for name, value in flatten_numbers(record):
                if name != "step":
                    by_name.setdefault(name, {})[step] = value
    return {
        name: [sorted(values), [values[step] for step in sorted(values)]]
        for name, values in by_name.items()
    }


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
    return entry.record.experiment or ""
