"""`keel job list`: the submitted jobs of a controller's state database, newest first.

A read of the jobs table only (no tasks, no events): one query that walks the jobs newest first
(the seq index) and stops at its limit, however many jobs there are; with --state it skips the
jobs in other states on the way (state is not indexed: keel.cluster.state says why).
`keel job status ID` tells a job's whole story.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from keel.cluster.spec import Priority
from keel.cluster.state import connect, reason_of, shape_reasons
from keel.core.errors import UsageError

JOB_STATES = ("pending", "running", "preempted", "succeeded", "failed", "cancelled")
"""Every state a job row can be in (keel.cluster.state's jobs table)."""


def list_jobs(
    database_path: str | Path, job_state: str | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """The jobs of the state database at `database_path`, newest first: id, name, state,
    cluster, priority, reason and times (unix seconds). Only jobs in `job_state` when given; at
    most `limit` of them. No database yet: no jobs (nothing is created)."""
    if job_state is not None and job_state not in JOB_STATES:
        raise UsageError(f"--state {job_state!r}: use one of {', '.join(JOB_STATES)}")
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be at least 1, got {limit}")
    if not Path(database_path).is_file():
        return []
    database = connect(database_path)
    try:
        query = (
            "SELECT id, name, state, cluster, priority, reason, submitted_at, started_at, "
            "ended_at, spec FROM jobs"
        )
        arguments: list[Any] = []
        if job_state is not None:
            query += " WHERE state = ?"
            arguments.append(job_state)
        query += " ORDER BY seq DESC"
        if limit is not None:
            query += " LIMIT ?"
            arguments.append(limit)
        rows = [dict(row) for row in database.execute(query, arguments)]
        reasons = shape_reasons(database)
    finally:
        database.close()
    for row in rows:
        row["priority"] = Priority(row["priority"]).name.lower()
        row["reason"] = reason_of(row, reasons)
        del row["spec"]
    return rows
