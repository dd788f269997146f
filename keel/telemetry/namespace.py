"""The writer's side of one namespace: its WAL generations and the disk work that changes it.

A `NamespaceWriter` holds the manifest as last committed, the active WAL generation (rows being
appended) and the sealed generations waiting for their flush. Its methods do the disk work (write a
segment, merge segments, drop expired ones) and commit the manifest; the caller (the store) holds
its state lock around `commit_*`, so a query never sees the manifest and the pending rows out of
step. Flushes, merges and drops of one store run one at a time (the store's work lock).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from keel.telemetry import compaction, segment, wal
from keel.telemetry.manifest import Manifest, SegmentEntry, load_manifest, save_manifest
from keel.telemetry.schema import NamespaceOptions, resolve_options
from keel.telemetry.sidecar import SegmentIndex


@dataclass
class Generation:
    """Rows of one WAL generation that are not in a segment yet."""

    number: int
    tables: list[pa.Table] = field(default_factory=list)
    rows: int = 0
    bytes: int = 0
    since: float = 0.0  # time.monotonic() of the first row


@dataclass
class NamespaceWriter:
    directory: Path
    manifest: Manifest
    next_generation: int
    active: Generation | None = None
    log: wal.WalWriter | None = None
    sealed: list[Generation] = field(default_factory=list)
    appending: threading.Lock = field(default_factory=threading.Lock)  # one WAL append at a time

    @property
    def segments_directory(self) -> Path:
        return self.directory / "segments"

    @property
    def pending(self) -> tuple[pa.Table, ...]:
        """Rows not in a segment yet, oldest first."""
        generations = [*self.sealed, *([self.active] if self.active else [])]
        return tuple(table for generation in generations for table in generation.tables)

    @classmethod
    def create(
        cls, directory: Path, namespace: str, schema: pa.Schema, options: NamespaceOptions | None
    ) -> NamespaceWriter:
        (directory / "wal").mkdir(parents=True, exist_ok=True)
        (directory / "segments").mkdir(exist_ok=True)
        manifest = Manifest(namespace, schema, resolve_options(schema, options))
        save_manifest(directory, manifest)
        return cls(directory, manifest, next_generation=0)

    @classmethod
    def recover(cls, directory: Path) -> NamespaceWriter:
        """The namespace as its last writer left it: WAL generations not yet in a segment are
        sealed for flushing (torn tails cut), files that no manifest names are removed."""
        manifest = load_manifest(directory)
        if manifest is None:
            raise FileNotFoundError(directory / "manifest.json")
        log_directory = directory / "wal"
        sealed = []
        numbers = wal.generations(log_directory)
        for number in numbers:
            path = wal.generation_path(log_directory, number)
            if number <= manifest.flushed_generation:
                path.unlink()
                continue
            contents = wal.read_wal(path)
            wal.truncate_torn_tail(path, contents)
            if contents.tables:
                rows = sum(t.num_rows for t in contents.tables)
                sealed.append(Generation(number, contents.tables, rows, contents.valid_bytes))
            else:
                path.unlink()
        known = {s.name for s in manifest.segments} | {name for name, _ in manifest.retired}
        for path in (directory / "segments").iterdir():
            if path.name.startswith(".") or path.name.split(".")[0] not in known:
                path.unlink()
        next_number = max([manifest.flushed_generation, *numbers]) + 1
        return cls(directory, manifest, next_number, sealed=sealed)

    def open_generation(self, now: float) -> None:
        """Start a new active generation and its WAL file (caller holds `appending`)."""
        number = self.next_generation
        self.next_generation += 1
        self.log = wal.WalWriter(wal.generation_path(self.directory / "wal", number))
        self.active = Generation(number, since=now)

    def seal(self) -> None:
        """Hand the active generation to the flusher (caller holds `appending` and the state)."""
        if self.active is None:
            return
        if self.active.rows:
            self.sealed.append(self.active)
        self.log.close()
        self.log, self.active = None, None

    def write_oldest(self, row_group_rows: int) -> tuple[SegmentEntry, SegmentIndex]:
        """Write the oldest sealed generation as a segment (not yet committed)."""
        generation = self.sealed[0]
        return segment.write_segment(
            self.segments_directory,
            pa.concat_tables(generation.tables),
            self.manifest.options,
            row_group_rows,
            name=segment.new_segment_name(generation.number, generation.number),
        )

    def commit_oldest(self, entry: SegmentEntry) -> Path:
        """Name the flushed segment in the manifest; return the WAL file now safe to delete."""
        generation = self.sealed.pop(0)
        self._commit(
            self.manifest.with_segments(
                (*self.manifest.segments, entry), flushed_generation=generation.number
            )
        )
        return wal.generation_path(self.directory / "wal", generation.number)

    def merge(
        self, group: list[SegmentEntry], row_group_rows: int
    ) -> tuple[SegmentEntry, SegmentIndex]:
        """One segment holding a run of segments' rows, each run kept in its own sort order, so
        the merged file still clusters keys within each stretch of time (not yet committed)."""
        table = pa.concat_tables(
            [pq.read_table(segment.segment_path(self.segments_directory, s.name)) for s in group]
        ).cast(self.manifest.schema)  # Parquet keeps timestamp[s] as [ms]: back to the schema
        name = segment.new_segment_name(int(group[0].name[:12]), int(group[-1].name[13:25]))
        return segment.write_segment(
            self.segments_directory,
            table,
            self.manifest.options,
            row_group_rows,
            name=name,
            sort=False,
        )

    def commit_merge(self, group: list[SegmentEntry], entry: SegmentEntry, now: float) -> None:
        merged = {s.name for s in group}
        kept = []
        for current in self.manifest.segments:
            if current.name == group[0].name:
                kept.append(entry)
            elif current.name not in merged:
                kept.append(current)
        self._retire(tuple(kept), merged, now)

    def expired(self, now: float) -> list[SegmentEntry]:
        return compaction.expired(
            self.manifest.segments, self.manifest.options.retention_days, int(now * 1e9)
        )

    def commit_drop(self, old: list[SegmentEntry], now: float) -> None:
        gone = {s.name for s in old}
        self._retire(tuple(s for s in self.manifest.segments if s.name not in gone), gone, now)

    def commit_forget(self, grace_seconds: float, now: float) -> list[str]:
        """Forget retired segments older than the grace period; return their names to delete."""
        due = [name for name, at in self.manifest.retired if now - at >= grace_seconds]
        if due:
            remaining = tuple(item for item in self.manifest.retired if item[0] not in due)
            self._commit(self.manifest.with_segments(self.manifest.segments, retired=remaining))
        return due

    def delete_files(self, names: list[str]) -> None:
        for name in names:
            segment.segment_path(self.segments_directory, name).unlink(missing_ok=True)
            segment.index_path(self.segments_directory, name).unlink(missing_ok=True)

    def _retire(self, segments: tuple[SegmentEntry, ...], names: set[str], now: float) -> None:
        retired = (*self.manifest.retired, *((n, now) for n in sorted(names)))
        self._commit(self.manifest.with_segments(segments, retired=retired))

    def _commit(self, manifest: Manifest) -> None:
        save_manifest(self.directory, manifest)
        self.manifest = manifest
