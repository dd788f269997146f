"""The store's DuckDB: one in-memory database, cursors kept between queries with their views,
plans cached by query text, and one watchdog thread for every query's timeout.

What a query used to pay before DuckDB's scan, ~2-5 ms on a busy machine, is mostly gone for a
query seen before over an unchanged namespace: its plan comes from the cache (no parse), its view
already exists on the cursor it gets (a view's SQL names every file and row range it reads, so an
unchanged SQL means an unchanged view), and arming the watchdog is a heap push instead of a timer
thread. A view that reads Arrow rows (the WAL's) keeps its SQL, but its rows are registered
afresh for each query and released when the query ends, so an idle cursor holds no rows.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa

from keel.telemetry import plan as planner
from keel.telemetry.query import (
    IndexLookup,
    ScanReport,
    Snapshot,
    ViewDefinition,
    over_time,
    plan_and_run,
)
from keel.telemetry.schema import QueryLimits
from keel.telemetry.watchdog import Watchdog

IDLE_CURSORS = 8  # cursors (with their views) kept between queries; more run at once are closed
CACHED_PLANS = 256  # plans kept, least recently used dropped first
CACHED_SQL_CHARS = 64 << 10  # longer queries are planned every time (the cache keeps their text)


def open_database(root: Path, memory_bytes: int | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB for a store's queries: time zone UTC, files readable only under
    `root`, at most `memory_bytes` of DuckDB memory for all queries together (None: DuckDB's
    default, 80% of RAM). Queries run on cursors of it (their own temporary views)."""
    database = duckdb.connect()
    database.execute("SET GLOBAL TimeZone = 'UTC'")
    database.execute("SET GLOBAL parquet_metadata_cache = true")  # segments are immutable
    if memory_bytes is not None:
        database.execute(f"SET memory_limit = '{int(memory_bytes)}B'")
    allowed = f"{root}/".replace("'", "''")
    database.execute(f"SET allowed_directories = ['{allowed}']")
    database.execute("SET enable_external_access = false")
    return database


@dataclass
class Session:
    """A cursor kept between queries and the views it holds, by namespace, and a cursor
    without views for planning (DuckDB's `get_table_names` reads views a query names)."""

    cursor: duckdb.DuckDBPyConnection
    planning: duckdb.DuckDBPyConnection
    views: dict[str, str] = field(default_factory=dict)  # namespace -> its view's SQL
    registered: set[str] = field(default_factory=set)  # Arrow rows registered for this query

    def set_views(self, views: list[ViewDefinition]) -> None:
        """Make exactly `views` the cursor's views: create those whose SQL changed, register
        their Arrow rows, drop the rest (a query never sees another snapshot's view)."""
        wanted = {view.namespace: view for view in views}
        for name in [name for name in self.views if name not in wanted]:
            self.cursor.execute(f"DROP VIEW IF EXISTS {_quote(name)}")
            del self.views[name]
        for view in views:
            if view.rows_name is not None:
                self.cursor.register(view.rows_name, view.rows_table())
                self.registered.add(view.rows_name)
            if self.views.get(view.namespace) != view.sql:
                self.views.pop(view.namespace, None)
                self.cursor.execute(view.sql)
                self.views[view.namespace] = view.sql

    def interrupt(self) -> None:
        """Stop what either cursor runs (the watchdog calls this at the deadline)."""
        self.planning.interrupt()
        self.cursor.interrupt()

    def close(self) -> None:
        self.planning.close()
        self.cursor.close()

    def release_rows(self) -> None:
        """Unregister the Arrow rows of the last query (their views stay, re-registered later)."""
        for name in self.registered:
            self.cursor.unregister(name)
        self.registered.clear()


class QueryEngine:
    """Runs a store's queries; see the module docstring. Safe to call from many threads."""

    def __init__(self, root: Path, memory_bytes: int | None = None) -> None:
        self._database = open_database(root, memory_bytes)
        self._watchdog = Watchdog()
        self._lock = threading.Lock()
        self._idle: list[Session] = []
        self._plans: OrderedDict[tuple, planner.QueryPlan] = OrderedDict()
        self._closed = False

    def run(
        self,
        sql: str,
        snapshots: Callable[[set[str] | None], dict[str, Snapshot]],
        index_of: IndexLookup,
        *,
        execute: bool = True,
        limits: QueryLimits | None = None,
    ) -> tuple[pa.Table | None, list[ScanReport]]:
        """Run `sql` (or with execute=False only plan it); return the result and what was read.

        `snapshots(names)` gives the named namespaces (None: all of them, for their schemas).
        `limits` (default QueryLimits()) caps the result's rows and bytes and the seconds taken:
        the watchdog interrupts DuckDB at the deadline, and the result is fetched in batches and
        counted, so an oversized result is refused before it is held in memory whole."""
        limits = limits or QueryLimits()
        deadline = time.monotonic() + limits.timeout_seconds
        session = self._take()
        token = self._watchdog.arm(deadline, session.interrupt)
        finished = False
        try:
            result = plan_and_run(
                sql,
                session.cursor,
                lambda text, every: self._plan(session.planning, text, every),
                session.set_views,
                snapshots,
                index_of,
                execute,
                limits,
                deadline,
            )
            finished = True
            return result
        except duckdb.InterruptException:
            raise over_time(limits) from None
        finally:
            interrupted = self._watchdog.disarm(token)
            self._give_back(session, reuse=finished and not interrupted)

    def close(self) -> None:
        """Stop the watchdog, close the idle cursors and the database."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        self._watchdog.stop()
        for session in idle:
            session.close()
        self._database.close()

    def _take(self) -> Session:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return Session(self._database.cursor(), self._database.cursor())

    def _give_back(self, session: Session, reuse: bool) -> None:
        """Keep a cursor whose query ended normally (an interrupted or failed one may be left
        mid-statement, so it is closed); at most IDLE_CURSORS are kept."""
        if reuse:
            session.release_rows()
            with self._lock:
                if not self._closed and len(self._idle) < IDLE_CURSORS:
                    self._idle.append(session)
                    return
        session.close()

    def _plan(
        self, cursor: duckdb.DuckDBPyConnection, sql: str, every: dict[str, Snapshot]
    ) -> planner.QueryPlan:
        """The plan of `sql` given every namespace's schema and time column; cached, since it
        depends on nothing else (constants are read from the query's own text). A cached plan
        is shared: callers only read it."""
        inputs = tuple(
            (name, s.manifest.schema, s.manifest.options.time_column)
            for name, s in sorted(every.items(), key=lambda item: item[0])
        )
        key = (sql, inputs)
        with self._lock:
            cached = self._plans.get(key)
            if cached is not None:
                self._plans.move_to_end(key)
                return cached
        schemas = {name: schema for name, schema, _ in inputs}
        times = {name: column for name, _, column in inputs}
        made = planner.plan_query(cursor, sql, schemas, times)
        if len(sql) > CACHED_SQL_CHARS:
            return made
        with self._lock:
            self._plans[key] = made
            while len(self._plans) > CACHED_PLANS:
                self._plans.popitem(last=False)
        return made


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
