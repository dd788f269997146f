"""The telemetry store: namespaced tables of rows on local disk, written durably, queried with SQL.

Write path: rows are checked against the namespace's schema, appended to the namespace's current
write-ahead log generation and fsynced (the write returns only then); when a generation holds
`flush_rows` rows, `flush_bytes` bytes or rows older than `flush_seconds`, it is sealed and a
background thread writes it as a sorted, indexed Parquet segment and commits the manifest, after
which the WAL file is deleted. Read path: keel.telemetry.query over the manifest's segments plus
the rows still in WAL generations.

One process writes a root at a time (an flock on `<root>/.writer.lock`, taken by the first write;
the kernel releases it if the process dies); any number of processes query it. A reader that is not
the writer reads WAL files before the manifest, so a generation flushed in between is found in its
segment, never lost and never counted twice.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa

from keel.core.flock import try_lock
from keel.telemetry import compaction
from keel.telemetry.compaction import CompactionReport
from keel.telemetry.engine import QueryEngine
from keel.telemetry.indexes import SegmentIndexes
from keel.telemetry.manifest import Manifest, SegmentEntry
from keel.telemetry.namespace import NamespaceWriter
from keel.telemetry.query import ScanReport, Snapshot
from keel.telemetry.schema import (
    NamespaceOptions,
    QueryLimits,
    StoreBusyError,
    TelemetryInputError,
    TelemetryQueryError,
    check_namespace,
    check_storable,
    to_table,
)
from keel.telemetry.sidecar import SegmentIndex
from keel.telemetry.snapshots import ManifestCache, read_snapshots
from keel.telemetry.times import check_time_unit

logger = logging.getLogger(__name__)
LOCK_FILE = ".writer.lock"


@dataclass(frozen=True)
class StoreOptions:
    """Sizes in rows and bytes, ages in seconds. See the module docstring for what each drives."""

    flush_rows: int = 1_000_000
    flush_bytes: int = 256 << 20
    flush_seconds: float = 5.0
    row_group_rows: int = 16_384
    compact_target_rows: int = 8_000_000
    background: bool = True
    auto_compact_seconds: float | None = None
    retire_grace_seconds: float = 60.0  # replaced segment files outlive their manifest this long
    max_pending_bytes: int = 2 << 30  # writes wait while this much WAL awaits its flush
    query_memory_bytes: int | None = 4 << 30  # DuckDB memory for all queries together


class TelemetryStore:
    """Namespaced tables under `root`; see the module docstring. Use as a context manager."""

    def __init__(self, root: str | os.PathLike[str], options: StoreOptions | None = None) -> None:
        self.root = Path(root).resolve()
        self.options = options or StoreOptions()
        self._state = threading.Condition(threading.RLock())
        self._work = threading.RLock()  # one flush, rebuild or compaction at a time
        self._spaces: dict[str, NamespaceWriter] = {}
        self._indexes = SegmentIndexes(self.root, self._state)
        self._lock_fd = -1
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failure: BaseException | None = None
        self._last_compaction = time.monotonic()
        self._engine: QueryEngine | None = None
        self._manifests = ManifestCache()  # parsed manifests, when reading as another process

    # -- public API -------------------------------------------------------------------------

    def create(
        self, namespace: str, schema: pa.Schema, options: NamespaceOptions | None = None
    ) -> None:
        """Declare a namespace's schema and options (a no-op if it exists with that schema)."""
        check_namespace(namespace)
        check_storable(schema)
        self._ensure_writer()
        with self._state:
            existing = self._spaces.get(namespace)
            if existing is not None:
                if not existing.manifest.schema.equals(schema):
                    raise TelemetryInputError(
                        f"namespace {namespace} exists with another schema: "
                        f"{existing.manifest.schema.to_string(show_schema_metadata=False)}"
                    )
                return
            self._new_namespace(namespace, schema, options)

    def write(
        self,
        namespace: str,
        data: pa.Table | pa.RecordBatch | list[dict[str, Any]],
        *,
        time_unit: str | None = None,
    ) -> int:
        """Append rows; return how many. They are durable (fsynced) when this returns.

        `time_unit` (s, ms, us, ns): how epoch numbers in time columns are read, when the
        namespace declares none; a namespace this write creates records it."""
        check_namespace(namespace)
        check_time_unit(time_unit)
        self._ensure_writer()
        with self._state:
            space = self._spaces.get(namespace)
        if space is not None:
            time_unit = _write_unit(namespace, space.manifest.options.time_unit, time_unit)
        table = to_table(data, space.manifest.schema if space else None, time_unit)
        if table.num_rows == 0:
            return 0
        if space is None:
            with self._state:
                space = self._spaces.get(namespace) or self._new_namespace(
                    namespace, table.schema, NamespaceOptions(time_unit=time_unit)
                )
            time_unit = _write_unit(namespace, space.manifest.options.time_unit, time_unit)
            table = to_table(table, space.manifest.schema, time_unit)
        with self._state:
            while (
                sum(g.bytes for g in space.sealed) >= self.options.max_pending_bytes
                and self._thread is not None
            ):
                self._raise_failure()
                self._state.wait(0.5)
        with space.appending:
            if space.active is None:
                space.open_generation(time.monotonic())
            written = space.log.append(table)
            with self._state:
                space.active.tables.append(table)
                space.active.rows += table.num_rows
                space.active.bytes += written
                full = (
                    space.active.rows >= self.options.flush_rows
                    or space.active.bytes >= self.options.flush_bytes
                )
                if full:
                    space.seal()
        if full:
            self._after_seal()
        return table.num_rows

    def query(self, sql: str, limits: QueryLimits | None = None) -> pa.Table:
        """Run DuckDB SQL; each namespace is a table of that name (quote dotted names).

        `limits` (default QueryLimits()) caps the result's rows and bytes and the seconds taken;
        a query past one raises QueryLimitError naming the cap."""
        return self._run(sql, execute=True, limits=limits)[0]

    def explain(self, sql: str) -> list[ScanReport]:
        """What `query(sql)` would read per namespace (segments, row groups), without running it."""
        return self._run(sql, execute=False)[1]

    def _run(
        self, sql: str, *, execute: bool, limits: QueryLimits | None = None
    ) -> tuple[pa.Table | None, list[ScanReport]]:
        for attempt in range(3):
            try:
                return self._query_engine().run(
                    sql,
                    self._snapshots,
                    self._index,
                    execute=execute,
                    limits=limits,
                )
            except duckdb.IOException as error:
                # A segment retired by a compaction in another process since we read the manifest.
                if attempt == 2:
                    raise TelemetryQueryError(
                        f"query failed: {str(error).splitlines()[0]}"
                    ) from None
        raise AssertionError("unreachable")

    def tail(self, namespace: str, limit: int = 20, after: datetime | None = None) -> pa.Table:
        """The newest `limit` rows (newer than `after` if given), oldest first."""
        check_namespace(namespace)
        manifest = self._manifest(namespace)
        column = manifest.options.time_column
        if column is None:
            raise TelemetryQueryError(f"namespace {namespace} has no time column to tail by")
        where = ""
        if after is not None:
            if after.tzinfo is not None:
                after = after.astimezone(UTC).replace(tzinfo=None)
            where = f" WHERE \"{column}\" > TIMESTAMP '{after.isoformat(sep=' ')}'"
        return self.query(
            f'SELECT * FROM (SELECT * FROM "{namespace}"{where} '
            f'ORDER BY "{column}" DESC LIMIT {int(limit)}) ORDER BY "{column}"'
        )

    def namespaces(self) -> dict[str, pa.Schema]:
        return {name: snap.manifest.schema for name, snap in sorted(self._snapshots(None).items())}

    def flush(self, namespace: str | None = None) -> None:
        """Turn every buffered row (of one namespace or all) into segments now."""
        self._ensure_writer()
        with self._state:
            spaces = [s for n, s in self._spaces.items() if namespace in (None, n)]
        for space in spaces:
            with space.appending, self._state:
                space.seal()
        self._flush_sealed()

    def compact(
        self, namespace: str | None = None, *, now: float | None = None
    ) -> CompactionReport:
        """Merge small segments, drop segments past retention, delete retired files."""
        self._ensure_writer()
        report = CompactionReport()
        now = time.time() if now is None else now
        with self._state:
            names = [n for n in self._spaces if namespace in (None, n)]
        with self._work:
            for name in names:
                self._compact_namespace(self._spaces[name], now, report)
        self._last_compaction = time.monotonic()
        return report

    def wait_idle(self) -> None:
        """Wait until sealed generations are flushed and stale indexes rebuilt."""
        if self._lock_fd < 0:
            return
        if self._thread is None:
            self._flush_sealed()
            self._rebuild_indexes()
            return
        with self._state:
            while any(s.sealed for s in self._spaces.values()) or self._indexes.stale:
                self._raise_failure()
                self._state.notify_all()
                self._state.wait(0.1)
        self._raise_failure()

    def close(self, *, flush: bool = True) -> None:
        """Flush (unless told not to), stop the background thread, release the writer lock."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._lock_fd < 0:
            return
        try:
            if flush and self._failure is None:
                self.flush()
        finally:
            with self._state:
                self._stopping = True
                self._state.notify_all()
            if self._thread is not None:
                self._thread.join()
            for space in self._spaces.values():
                if space.log is not None:
                    space.log.close()
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._raise_failure()

    def __enter__(self) -> TelemetryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writer state -----------------------------------------------------------------------

    def _ensure_writer(self) -> None:
        if self._lock_fd >= 0:
            self._raise_failure()
            return
        with self._state:
            if self._lock_fd >= 0:
                return
            self.root.mkdir(parents=True, exist_ok=True)
            fd = try_lock(self.root / LOCK_FILE, 0o644)
            if fd is None:
                holder = (self.root / LOCK_FILE).read_bytes()[:4096].decode("utf-8", "replace")
                raise StoreBusyError(
                    f"telemetry store {self.root} is open for writing by another process "
                    f"({holder.strip() or 'unknown'}): write through its server (--url) or stop it"
                ) from None
            holder = orjson.dumps({"pid": os.getpid(), "host": socket.gethostname()})
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder, 0)
            self._lock_fd = fd
            for directory in sorted(
                p for p in self.root.iterdir() if (p / "manifest.json").exists()
            ):
                self._spaces[directory.name] = NamespaceWriter.recover(directory)
            if self.options.background:
                self._thread = threading.Thread(
                    target=self._background, name="keel-telemetry", daemon=True
                )
                self._thread.start()

    def _new_namespace(
        self, namespace: str, schema: pa.Schema, options: NamespaceOptions | None
    ) -> NamespaceWriter:
        space = NamespaceWriter.create(self.root / namespace, namespace, schema, options)
        self._spaces[namespace] = space
        return space

    def _after_seal(self) -> None:
        if self._thread is None:
            self._flush_sealed()
        else:
            with self._state:
                self._state.notify_all()

    def _flush_sealed(self) -> None:
        """Flush every sealed generation: segment written, manifest committed, WAL file deleted."""
        with self._work:
            while True:
                with self._state:
                    waiting = [s for s in self._spaces.values() if s.sealed]
                if not waiting:
                    return
                space = waiting[0]
                entry, index = space.write_oldest(self.options.row_group_rows)
                with self._state:
                    done = space.commit_oldest(entry)
                    self._indexes.put(space.manifest.namespace, entry.name, index)
                    self._state.notify_all()
                done.unlink(missing_ok=True)

    def _compact_namespace(
        self, space: NamespaceWriter, now: float, report: CompactionReport
    ) -> None:
        namespace = space.manifest.namespace
        groups = compaction.merge_groups(space.manifest.segments, self.options.compact_target_rows)
        for group in groups:
            entry, index = space.merge(group, self.options.row_group_rows)
            with self._state:
                space.commit_merge(group, entry, now)
                self._indexes.put(namespace, entry.name, index)
            report.merged.setdefault(namespace, []).extend(s.name for s in group)
            report.written.setdefault(namespace, []).append(entry.name)
        old = space.expired(now)
        if old:
            with self._state:
                space.commit_drop(old, now)
            report.dropped.setdefault(namespace, []).extend(s.name for s in old)
            report.rows_dropped += sum(s.rows for s in old)
        with self._state:
            due = space.commit_forget(self.options.retire_grace_seconds, now)
        space.delete_files(due)
        for name in due:
            self._indexes.forget(namespace, name)

    # -- reading ----------------------------------------------------------------------------

    def _manifest(self, namespace: str) -> Manifest:
        snapshot = self._snapshots({namespace}).get(namespace)
        if snapshot is None:
            raise TelemetryQueryError(f"no namespace {namespace} in {self.root}")
        return snapshot.manifest

    def _snapshots(self, names: set[str] | None) -> dict[str, Snapshot]:
        """Namespaces as of now: the writer's own state, or (another process) the files."""
        if self._lock_fd >= 0:
            with self._state:
                return {
                    name: Snapshot(space.directory, space.manifest, space.pending)
                    for name, space in self._spaces.items()
                    if names is None or name in names
                }
        return read_snapshots(self.root, names, self._manifests)

    def _query_engine(self) -> QueryEngine:
        with self._state:
            if self._engine is None:
                self._engine = QueryEngine(self.root, self.options.query_memory_bytes)
            return self._engine

    def _index(self, namespace: str, entry: SegmentEntry) -> SegmentIndex | None:
        return self._indexes.lookup(namespace, entry, writer=self._lock_fd >= 0)

    def _rebuild_indexes(self) -> None:
        with self._work:
            self._indexes.rebuild(self._spaces)

    # -- background -------------------------------------------------------------------------

    def _background(self) -> None:
        while True:
            with self._state:
                if self._stopping:
                    return
                self._state.wait(0.2)
                if self._stopping:
                    return
            try:
                self._background_round()
            except (
                BaseException
            ) as error:  # kept and raised to the next caller; writes stay durable
                logger.exception("telemetry background work failed")
                with self._state:
                    self._failure = error
                    self._state.notify_all()
                return

    def _background_round(self) -> None:
        now = time.monotonic()
        with self._state:
            spaces = list(self._spaces.values())
        for space in spaces:
            active = space.active
            if (
                active is not None
                and active.rows
                and now - active.since >= self.options.flush_seconds
            ):
                with space.appending, self._state:
                    space.seal()
        self._flush_sealed()
        self._rebuild_indexes()
        every = self.options.auto_compact_seconds
        if every is not None and now - self._last_compaction >= every:
            self.compact()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError("the telemetry store's background work failed") from self._failure


def _write_unit(namespace: str, declared: str | None, given: str | None) -> str | None:
    """The unit a write's epoch numbers are read in: the namespace's, or the one given."""
    if given is not None and declared is not None and given != declared:
        raise TelemetryInputError(
            f"namespace {namespace} reads epoch numbers as {declared}, not {given}: "
            f"send them in {declared} (or as ISO-8601 text)"
        )
    return declared or given
