"""Steps with their state, the controller's jobs and their output, log search and SQL.

Steps are the step store's entries (as `keel status` lists them), with the steps each depends on,
so the page can draw the DAG as a table of edges. Jobs are `keel job list`'s rows; a job's output
is read as `keel job logs` reads it, with the job's secrets hidden. Log search and the SQL box go
through the telemetry store's query engine (read-only: it runs SELECT only, and a LIKE search is
answered from its trigram indexes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from keel.cluster import state
from keel.cluster.listing import list_jobs
from keel.cluster.logs import NAMESPACE as TASK_LOG_NAMESPACE
from keel.cluster.logs import output_file
from keel.core.errors import UsageError
from keel.dashboard.sources import Sources, sql_text
from keel.steps.store import StepStore

MAX_LOG_BYTES = 1 << 20
"""A job's output shown: its last this many bytes per stream."""
MAX_RESULT_ROWS = 5_000
"""Rows of a SQL or search result sent to the page (the rest are counted, not sent)."""
SEARCH_ROWS = 200


def list_steps(sources: Sources) -> list[dict[str, Any]]:
    """Every step under the prefix: step (directory name), name, state, start, end, error, and
    depends_on (directory names of its inputs)."""
    if sources.root is None:
        return []
    return [
        {
            "step": entry.dir_name,
            "name": entry.record.name,
            "state": entry.state,
            "start": entry.record.start_time,
            "end": entry.record.end_time,
            "error": entry.record.error,
            "depends_on": [Path(dep["output"]).name for dep in entry.record.dependencies],
        }
        for entry in StepStore(str(sources.root)).entries()
    ]


def jobs(sources: Sources) -> list[dict[str, Any]]:
    """The controller's jobs, newest first (`keel job list --json`'s rows)."""
    root = sources.cluster_root
    return [] if root is None else list_jobs(root / "state.db")


def job_logs(sources: Sources, job_id: str) -> dict[str, Any]:
    """{"id", "state", "tasks": [{"replica", "stdout", "stderr"}]}: each task's latest attempt's
    output (its last MAX_LOG_BYTES per stream), secrets shown as ***."""
    root = sources.cluster_root
    if root is None:
        raise UsageError(f"no job {job_id}: this dashboard has no controller state")
    database = state.connect(root / "state.db")
    try:
        status = state.job_status(database, job_id)
        hide = state.redactor(database, job_id)
    finally:
        database.close()
    tasks = []
    for task in status["tasks"]:
        streams = {}
        for stream in ("stdout", "stderr"):
            text = "" if task["handle"] is None else _tail(output_file(root, job_id, task, stream))
            streams[stream] = "\n".join(hide(line) for line in text.split("\n"))
        tasks.append({"replica": task["replica"], **streams})
    return {"id": job_id, "state": status["state"], "tasks": tasks}


def search_logs(sources: Sources, text: str) -> dict[str, Any]:
    """Task log lines containing `text` (newest first, at most SEARCH_ROWS), from telemetry's
    cluster.task_log (a LIKE the store's trigram indexes answer)."""
    if not text.strip():
        raise UsageError("search for some text")
    telemetry = sources.telemetry
    if telemetry is None or TASK_LOG_NAMESPACE not in telemetry.namespaces():
        return {"columns": [], "rows": [], "total": 0}
    pattern = sql_text("%" + text.replace("%", "").replace("_", "") + "%")
    table = telemetry.query(
        f'SELECT ts, job_id, replica, stream, line FROM "{TASK_LOG_NAMESPACE}" '
        f"WHERE line LIKE {pattern} ORDER BY ts DESC LIMIT {SEARCH_ROWS}"
    )
    return table_json(table)


def run_sql(sources: Sources, sql: str) -> dict[str, Any]:
    """A SELECT over the telemetry namespaces: {"columns", "rows", "total"}."""
    if not sql.strip():
        raise UsageError('send {"sql": "SELECT ..."}')
    if sources.telemetry is None:
        raise UsageError("this prefix has no telemetry store yet")
    return table_json(sources.telemetry.query(sql))


def namespaces(sources: Sources) -> dict[str, dict[str, str]]:
    """{namespace: {column: type}} of the telemetry store, for the SQL box's hints."""
    if sources.telemetry is None:
        return {}
    schemas = sources.telemetry.namespaces()
    return {name: {f.name: str(f.type) for f in schemas[name]} for name in sorted(schemas)}


def table_json(table: pa.Table) -> dict[str, Any]:
    """The first MAX_RESULT_ROWS rows as lists, the column names and the row count."""
    head = table.slice(0, MAX_RESULT_ROWS)
    columns = [column.to_pylist() for column in head.columns]
    return {
        "columns": table.column_names,
        "rows": [list(row) for row in zip(*columns, strict=True)],
        "total": table.num_rows,
    }


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - MAX_LOG_BYTES))
            return handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
