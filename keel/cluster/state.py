"""The controller's state in SQLite: jobs, attempts (tasks are their replicas' latest attempts),
clusters, reservations and events.

The database is the only state: a controller killed at any point and started again reads it and
carries on. Job commands in other processes write to it directly (`submit`, `request_cancel`);
SQLite's write-ahead journal lets them do so while the controller runs. An attempt is recorded
(state "launching") before the backend is asked to start it, so a restart never loses a task it
had started and never starts one twice: it asks the backend to launch the same attempt again,
which backends answer by adopting the task they already have.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from keel.cluster.spec import JobSpec, Priority, Resources
from keel.core.errors import UsageError

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL UNIQUE,
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    priority INTEGER NOT NULL,
    state TEXT NOT NULL,           -- pending running preempted succeeded failed cancelled
    cluster TEXT,
    reason TEXT NOT NULL DEFAULT '',
    outcome TEXT NOT NULL DEFAULT '',  -- why a running gang is being stopped: failed/lost/...
    failures INTEGER NOT NULL DEFAULT 0,
    preemptions INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, priority, seq, id);
CREATE TABLE IF NOT EXISTS attempts (
    job_id TEXT NOT NULL,
    replica INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    cluster TEXT NOT NULL,
    handle TEXT,
    state TEXT NOT NULL,           -- launching pending running succeeded failed lost cancelled
    exit_code INTEGER,
    reason TEXT NOT NULL DEFAULT '',
    started_at REAL NOT NULL,
    ended_at REAL,
    log_offsets TEXT NOT NULL DEFAULT '[0, 0]',
    PRIMARY KEY (job_id, replica, attempt)
);
CREATE INDEX IF NOT EXISTS attempts_by_state ON attempts (state);
CREATE VIEW IF NOT EXISTS tasks AS
    SELECT a.* FROM attempts a
    WHERE a.attempt = (SELECT max(b.attempt) FROM attempts b
                       WHERE b.job_id = a.job_id AND b.replica = a.replica);
CREATE TABLE IF NOT EXISTS clusters (
    name TEXT PRIMARY KEY,
    backend TEXT NOT NULL,
    region TEXT NOT NULL DEFAULT '',
    total TEXT NOT NULL DEFAULT '{}',
    free TEXT NOT NULL DEFAULT '{}',
    reported_at REAL,
    reported_tick INTEGER
);
CREATE TABLE IF NOT EXISTS reservations (
    job_id TEXT PRIMARY KEY,
    cluster TEXT NOT NULL,
    demand TEXT NOT NULL,
    tick INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    job_id TEXT,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS controller (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

ACTIVE_ATTEMPT_STATES = ("launching", "pending", "running")
FINAL_JOB_STATES = ("succeeded", "failed", "cancelled")


def connect(path: str | Path) -> sqlite3.Connection:
    """The state database at `path` (created if missing), in WAL mode, rows as sqlite3.Row."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    database = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
    database.row_factory = sqlite3.Row
    database.execute("PRAGMA journal_mode=WAL")
    database.execute("PRAGMA synchronous=NORMAL")
    database.execute("PRAGMA cache_size=-65536")  # 64 MiB: the controller rereads its queue
    database.executescript(SCHEMA)
    return database


@contextmanager
def transaction(database: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction (BEGIN IMMEDIATE: writers queue instead of failing mid-way)."""
    database.execute("BEGIN IMMEDIATE")
    try:
        yield database
    except BaseException:
        database.execute("ROLLBACK")
        raise
    database.execute("COMMIT")


def rows_for_ids(
    database: sqlite3.Connection, query: str, ids: list[str], batch: int = 500
) -> list[sqlite3.Row]:
    """Rows of `query`, whose `{ids}` stands for a list of parameters, for every id in `ids`,
    asked in batches (SQLite caps the parameters of one statement)."""
    rows: list[sqlite3.Row] = []
    for start in range(0, len(ids), batch):
        part = ids[start : start + batch]
        rows += database.execute(query.format(ids=", ".join("?" * len(part))), part).fetchall()
    return rows


def encode_spec(spec: JobSpec) -> str:
    data = asdict(spec)
    data["priority"] = spec.priority.name.lower()
    data["env"] = dict(spec.env)
    return orjson.dumps(data).decode()


def decode_spec(text: str) -> JobSpec:
    data = orjson.loads(text)
    return JobSpec(
        command=tuple(data["command"]),
        name=data["name"],
        resources=Resources(**data["resources"]),
        replicas=data["replicas"],
        env=data["env"],
        region=data["region"],
        cluster=data.get("cluster", ""),
        priority=Priority.parse(data["priority"]),
        max_retries=data["max_retries"],
        max_preemptions=data["max_preemptions"],
        workdir=data["workdir"],
    )


def submit(database: sqlite3.Connection, spec: JobSpec) -> str:
    """Queue a job; return its id ("j-000042")."""
    with transaction(database):
        sequence = database.execute("SELECT coalesce(max(seq), 0) + 1 FROM jobs").fetchone()[0]
        job_id = f"j-{sequence:06d}"
        database.execute(
            "INSERT INTO jobs (id, seq, name, spec, priority, state, submitted_at) "
            "VALUES (?, ?, ?, ?, ?, 'pending', ?)",
            (
                job_id,
                sequence,
                spec.name or spec.command[0],
                encode_spec(spec),
                int(spec.priority),
                time.time(),
            ),
        )
        event(database, job_id, "submitted", " ".join(spec.command))
    return job_id


def job(database: sqlite3.Connection, job_id: str) -> sqlite3.Row:
    """The job's row; UsageError naming the id if there is none."""
    row = database.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if row is None:
        raise UsageError(f"no job {job_id!r}: `keel job status` lists nothing by that id")
    return row


def request_cancel(database: sqlite3.Connection, job_id: str) -> str:
    """Ask for a job to stop; a pending job is cancelled at once. Returns its state after."""
    with transaction(database):
        row = job(database, job_id)
        if row["state"] in FINAL_JOB_STATES:
            return row["state"]
        if row["state"] == "pending":
            database.execute(
                "UPDATE jobs SET state = 'cancelled', reason = 'cancelled before it started', "
                "ended_at = ? WHERE id = ?",
                (time.time(), job_id),
            )
            event(database, job_id, "cancelled", "while pending")
            return "cancelled"
        database.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
        event(database, job_id, "cancel requested")
        return row["state"]


def event(database: sqlite3.Connection, job_id: str | None, kind: str, detail: str = "") -> None:
    database.execute(
        "INSERT INTO events (at, job_id, kind, detail) VALUES (?, ?, ?, ?)",
        (time.time(), job_id, kind, detail),
    )


def job_status(database: sqlite3.Connection, job_id: str) -> dict[str, Any]:
    """The job as `keel job status --json` prints it."""
    row = job(database, job_id)
    tasks = database.execute(
        "SELECT replica, attempt, cluster, handle, state, exit_code, reason FROM tasks "
        "WHERE job_id = ? ORDER BY replica",
        (job_id,),
    ).fetchall()
    return {
        "id": row["id"],
        "name": row["name"],
        "state": row["state"],
        "reason": row["reason"],
        "cluster": row["cluster"],
        "priority": Priority(row["priority"]).name.lower(),
        "failures": row["failures"],
        "preemptions": row["preemptions"],
        "submitted_at": row["submitted_at"],
        "started_at": row["started_at"],
        "ended_at": row["ended_at"],
        "tasks": [dict(task) for task in tasks],
    }


def get_value(database: sqlite3.Connection, key: str, default: str = "") -> str:
    row = database.execute("SELECT value FROM controller WHERE key = ?", (key,)).fetchone()
    return row[0] if row is not None else default


def set_value(database: sqlite3.Connection, key: str, value: str) -> None:
    database.execute(
        "INSERT INTO controller (key, value) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (key, value),
    )
