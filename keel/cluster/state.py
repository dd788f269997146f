"""The controller's state in SQLite: jobs, attempts (tasks are their replicas' latest attempts),
clusters and events (the capacity reservation ledger is in the controller's memory: a restarted
controller starts from a fresh capacity report).

Events: the events table records what the other rows do not (submissions, cancellations,
requeues, failures, preemptions, scaling, controller starts); an assignment is already its
attempts' row and a success its job's row, so those two are not written again as events (the
controller makes ~500 of them a tick at 10,000 queued jobs). The job_events view, read by
`job_events`, puts the three together.

No index on state: a job changes state twice in its life (started, ended) and its attempts three
times, and an index over state rewrites an entry at each change. At 10,000 queued jobs and ~250
jobs starting and ~250 ending a tick, the two such indexes keel kept (jobs by state, priority,
seq and id; attempts by state) cost ~2.4 ms of a ~22 ms controller tick (measured on copies of
the tick benchmark's tables), while the controller itself never reads by state: it keeps the
active jobs and attempts in memory. The reads that do filter by state run once at a start (the
controller loading its queue) or on a person's request (`keel job list --state`, which walks the
jobs newest first and stops at its limit; `keel cluster status`'s counts).

Waiting reasons: a queued job's row has a reason of its own once a scheduling round has looked at
it; the end of the queue that a round leaves waiting as a whole (keel.cluster.scheduler: once
every shape of job queued is blocked) is not written job by job (at 10,000 queued jobs and ~250
new ones a tick, that was ~250 rows a tick, ~1.2 ms): the `waiting` table holds each shape's
reason, and `reason_of` shows it for a queued job without one of its own.

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
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import orjson

from keel.cluster.scheduler import job_shape, shape_key
from keel.cluster.secrets import Redactor, private_dir, private_file, redact_command, redact_env
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
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    job_id TEXT,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS controller (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- Why the queued jobs of one shape (keel.cluster.scheduler.shape_key) wait, as the last round
-- that left the end of the queue waiting said: a queued job whose own reason is '' shows it.
CREATE TABLE IF NOT EXISTS waiting (shape TEXT PRIMARY KEY, reason TEXT NOT NULL);
-- No index on a job's or an attempt's state (keel before 2026-12-03 kept two; see the module
-- docstring): dropped where an older keel made them.
DROP INDEX IF EXISTS jobs_by_state;
DROP INDEX IF EXISTS attempts_by_state;
-- A job's whole story: the events table holds what the rows do not; an assignment is its
-- attempts' row (replica 0 stands for the gang) and a success its job's row. (keel before
-- 2026-12 also wrote those two as events: they are left out of the events part.)
CREATE VIEW IF NOT EXISTS job_events AS
    SELECT at, job_id, kind, detail FROM events WHERE kind NOT IN ('assigned', 'succeeded')
    UNION ALL
    SELECT started_at, job_id, 'assigned', cluster FROM attempts WHERE replica = 0
    UNION ALL
    SELECT ended_at, id, 'succeeded', '' FROM jobs WHERE state = 'succeeded';
"""

ACTIVE_ATTEMPT_STATES = ("launching", "pending", "running")
FINAL_JOB_STATES = ("succeeded", "failed", "cancelled")


def connect(path: str | Path) -> sqlite3.Connection:
    """The state database at `path` (created if missing), in WAL mode, rows as sqlite3.Row.
    The file and its -wal/-shm are 0600 (job specs may hold secrets); a directory made for it
    is 0700."""
    private_dir(Path(path).parent)
    private_file(path)  # SQLite gives the -wal and -shm files the database file's mode
    database = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
    database.row_factory = sqlite3.Row
    _enter_wal(database, path)
    database.execute("PRAGMA synchronous=NORMAL")
    database.execute("PRAGMA cache_size=-65536")  # 64 MiB: the controller rereads its queue
    database.executescript(SCHEMA)
    for journal in (Path(f"{path}-wal"), Path(f"{path}-shm")):  # made by an older keel
        if journal.exists() and journal.stat().st_mode & 0o077:
            journal.chmod(0o600)
    return database


WAL_DEADLINE_S = 30.0
"""How long connect keeps asking for WAL mode while other processes open the same new file."""


def _enter_wal(database: sqlite3.Connection, path: str | Path) -> None:
    """Put the database in WAL mode. Switching a new file to WAL takes an exclusive lock and
    SQLite answers "database is locked" at once, without its busy timeout, to a process that
    asks while another holds it: twelve `keel job run` started together on a fresh root lost
    one that way. So ask again, with growing pauses, for up to WAL_DEADLINE_S."""
    deadline = time.monotonic() + WAL_DEADLINE_S
    pause = 0.005
    while True:
        try:
            mode = database.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
        else:
            if mode == "wal":
                return
            if time.monotonic() > deadline:
                raise sqlite3.OperationalError(f"{path}: cannot enter WAL mode (still {mode})")
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


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
    database: sqlite3.Connection, query: str, ids: list[str], parameters: tuple = ()
) -> list[tuple]:
    """Rows of `query` (a SELECT, or an UPDATE with or without RETURNING) for every id in `ids`:
    its `{ids}` stands for them, passed as one JSON array after `parameters` (`IN ({ids})`
    reads as `IN (SELECT value FROM json_each(?))`, which SQLite plans as a lookup per id). The
    statement's text is the same for any number of ids, so the connection's statement cache
    keeps it (a list of `?`, one per id, made a new statement every tick): 14-38% less time
    than that list for 250 ids on a small VM (docs/benchmarks.md)."""
    if not ids:
        return []
    text = query.format(ids="SELECT value FROM json_each(?)")
    return database.execute(text, (*parameters, orjson.dumps(ids).decode())).fetchall()


def encode_spec(spec: JobSpec) -> str:
    data = asdict(spec)
    data["priority"] = spec.priority.name.lower()
    data["env"] = dict(spec.env)
    return orjson.dumps(data).decode()


def decode_spec(text: str | bytes) -> JobSpec:
    """A JobSpec from its JSON (as `encode_spec` writes it, or as a client posts it); bad input
    is a UsageError naming the key (see `spec_from_mapping`)."""
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as error:
        raise UsageError(f"the job spec is not valid JSON: {error}") from None
    return spec_from_mapping(data)


def decode_stored_spec(text: str | bytes) -> JobSpec:
    """A JobSpec as `submit` stored it (validated then): decoded without checking it again, as
    the controller reads hundreds a tick, and built without the frozen dataclasses' __init__
    (one object.__setattr__ per field: ~10 us of a ~13 us decode on a small VM)."""
    data = orjson.loads(text)
    data["command"] = tuple(data["command"])
    data["resources"] = unchecked(Resources, data["resources"])
    data["priority"] = _PRIORITIES[data["priority"]]
    data.setdefault("cluster", "")  # stored by keel before 2026-11
    return unchecked(JobSpec, data)


def unchecked(kind: type, values: dict[str, Any]) -> Any:
    """An instance of the frozen dataclass `kind` (no slots) whose fields are `values`, every
    field, built without its __init__ (~1 us against ~4 us for a dozen fields): for values
    already checked, made hundreds of times a tick (a stored spec, as `encode_spec` wrote it; a
    TaskLaunch). tests/cluster/test_controller.py checks both against their __init__."""
    instance = object.__new__(kind)
    object.__setattr__(instance, "__dict__", values)
    return instance


_PRIORITIES = {priority.name.lower(): priority for priority in Priority}  # as encode_spec writes


def spec_from_mapping(data: Any) -> JobSpec:
    """A JobSpec from decoded JSON. Only "command" is required; other keys default as in
    JobSpec. An unknown key, a missing command or a wrongly typed value is a UsageError naming
    the key, e.g. `job spec key 'resources.cpus': expected a number, got 'abc'`."""
    if not isinstance(data, dict):
        raise UsageError(f"the job spec must be a JSON object, got {_kind(data)}")
    _no_unknown_keys(data, SPEC_KEYS, "")
    if "command" not in data:
        raise UsageError("job spec key 'command' is missing: give the command as a list of words")
    command = _typed(data, "command", list, "a list of strings")
    if not all(isinstance(word, str) for word in command):
        raise UsageError("job spec key 'command': expected a list of strings")
    resources = _typed(data, "resources", dict, "an object", {})
    _no_unknown_keys(resources, RESOURCE_KEYS, "resources.")
    env = _typed(data, "env", dict, "an object of strings", {})
    bad = next((k for k, v in env.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise UsageError(f"job spec key 'env.{bad}': expected a string, got {_kind(env[bad])}")
    defaults, default_resources = JobSpec(()), Resources()
    return JobSpec(
        command=tuple(command),
        name=_typed(data, "name", str, "a string", defaults.name),
        resources=Resources(
            cpus=float(_number(resources, "cpus", "resources.", default_resources.cpus)),
            memory_mb=_whole(resources, "memory_mb", "resources.", default_resources.memory_mb),
            device_type=_typed(
                resources,
                "device_type",
                str,
                "a string",
                default_resources.device_type,
                "resources.",
            ),
            device_count=_whole(
                resources, "device_count", "resources.", default_resources.device_count
            ),
        ),
        replicas=_whole(data, "replicas", "", defaults.replicas),
        env=dict(env),
        region=_typed(data, "region", str, "a string", defaults.region),
        cluster=_typed(data, "cluster", str, "a string", defaults.cluster),
        priority=Priority.parse(
            _typed(data, "priority", str, "a string", defaults.priority.name.lower())
        ),
        max_retries=_whole(data, "max_retries", "", defaults.max_retries),
        max_preemptions=_whole(data, "max_preemptions", "", defaults.max_preemptions),
        workdir=_typed(data, "workdir", str, "a string", defaults.workdir),
    )


SPEC_KEYS = frozenset(f.name for f in fields(JobSpec))
RESOURCE_KEYS = frozenset(f.name for f in fields(Resources))


def _kind(value: Any) -> str:
    return repr(value) if isinstance(value, (str, int, float)) else type(value).__name__


def _no_unknown_keys(data: dict, known: frozenset[str], prefix: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(
            f"unknown job spec key '{prefix}{unknown[0]}': use some of {', '.join(sorted(known))}"
        )


def _typed(
    data: dict, key: str, kind: type, described: str, default: Any = None, prefix: str = ""
) -> Any:
    value = data.get(key, default)
    if not isinstance(value, kind):
        raise UsageError(f"job spec key '{prefix}{key}': expected {described}, got {_kind(value)}")
    return value


def _number(data: dict, key: str, prefix: str, default: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"job spec key '{prefix}{key}': expected a number, got {_kind(value)}")
    return value


def _whole(data: dict, key: str, prefix: str, default: int) -> int:
    value = data.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(
            f"job spec key '{prefix}{key}': expected a whole number, got {_kind(value)}"
        )
    return value


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
        event(database, job_id, "submitted", " ".join(redact_command(spec.command)))
    return job_id


class UnknownJobError(UsageError):
    """No job has the id asked for (the HTTP API answers 404)."""


def job(database: sqlite3.Connection, job_id: str) -> sqlite3.Row:
    """The job's row; UnknownJobError naming the id if there is none."""
    row = database.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if row is None:
        raise UnknownJobError(f"no job {job_id!r}: `keel job status` lists nothing by that id")
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


def job_events(database: sqlite3.Connection, job_id: str) -> list[dict[str, Any]]:
    """What happened to the job, oldest first: [{"at": unix seconds, "kind": "submitted",
    "detail": ...}, ...] (the job_events view)."""
    rows = database.execute(
        "SELECT at, kind, detail FROM job_events WHERE job_id = ? ORDER BY at", (job_id,)
    )
    return [dict(row) for row in rows]


def job_status(database: sqlite3.Connection, job_id: str) -> dict[str, Any]:
    """The job as `keel job status --json` prints it; its spec with secrets hidden
    (keel.cluster.secrets)."""
    row = job(database, job_id)
    spec = orjson.loads(row["spec"])
    spec["command"] = redact_command(spec["command"])
    spec["env"] = redact_env(spec["env"])
    tasks = database.execute(
        "SELECT replica, attempt, cluster, handle, state, exit_code, reason FROM tasks "
        "WHERE job_id = ? ORDER BY replica",
        (job_id,),
    ).fetchall()
    return {
        "id": row["id"],
        "name": row["name"],
        "state": row["state"],
        "reason": reason_of(row, shape_reasons(database)),
        "cluster": row["cluster"],
        "priority": Priority(row["priority"]).name.lower(),
        "failures": row["failures"],
        "preemptions": row["preemptions"],
        "submitted_at": row["submitted_at"],
        "started_at": row["started_at"],
        "ended_at": row["ended_at"],
        "spec": spec,
        "tasks": [dict(task) for task in tasks],
    }


def shape_reasons(database: sqlite3.Connection) -> dict[str, str]:
    """Why the queued jobs of each shape wait ({shape_key: reason}, the waiting table)."""
    return dict(database.execute("SELECT shape, reason FROM waiting").fetchall())


def reason_of(row: Any, reasons: dict[str, str]) -> str:
    """A job's reason as shown: its row's (with the jobs table's state, reason and spec
    columns); for a queued job without one, its shape's from `reasons` (`shape_reasons`)."""
    if row["reason"] or row["state"] != "pending":
        return row["reason"]
    spec = decode_stored_spec(row["spec"])
    return reasons.get(shape_key(job_shape(spec.demand(), spec.region, spec.cluster)), "")


def redactor(database: sqlite3.Connection, job_id: str) -> Redactor:
    """What hides the job's secret values in its output (keel.cluster.secrets)."""
    return Redactor.for_env(orjson.loads(job(database, job_id)["spec"])["env"])


def get_value(database: sqlite3.Connection, key: str, default: str = "") -> str:
    row = database.execute("SELECT value FROM controller WHERE key = ?", (key,)).fetchone()
    return row[0] if row is not None else default


def set_value(database: sqlite3.Connection, key: str, value: str) -> None:
    database.execute(
        "INSERT INTO controller (key, value) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (key, value),
    )
