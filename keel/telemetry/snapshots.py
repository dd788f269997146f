"""Namespaces as a reading process sees them: the manifest and the WAL rows not yet in a segment.

A process that is not the writer reads the files for every query. WAL files are read before the
manifest, so a generation flushed in between is found in its segment, never lost and never counted
twice. Manifests are parsed once per content: the file is read each time (one small read), and
parsed again only when its bytes differ from the last ones parsed (a parse with the schema's IPC
decoding is ~10x the read).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa

from keel.telemetry import wal
from keel.telemetry.manifest import MANIFEST, Manifest, parse_manifest
from keel.telemetry.query import Snapshot


class ManifestCache:
    """The last parsed manifest of each namespace directory, keyed by its file's bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parsed: dict[Path, tuple[bytes, Manifest]] = {}

    def load(self, directory: Path) -> Manifest | None:
        """The namespace's manifest as on disk now, or None if it has none."""
        try:
            text = (directory / MANIFEST).read_bytes()
        except FileNotFoundError:
            return None
        with self._lock:
            cached = self._parsed.get(directory)
        if cached is not None and cached[0] == text:
            return cached[1]
        manifest = parse_manifest(text)
        with self._lock:
            self._parsed[directory] = (text, manifest)
        return manifest


def read_snapshots(
    root: Path, names: set[str] | None, manifests: ManifestCache
) -> dict[str, Snapshot]:
    """The named namespaces under `root` (None: all, without their WAL rows: for schemas)."""
    found: dict[str, Snapshot] = {}
    if not root.is_dir():
        return found
    for directory in sorted(root.iterdir()):
        if (names is not None and directory.name not in names) or not directory.is_dir():
            continue
        pending: list[tuple[int, list[pa.Table]]] = []
        if names is not None:
            for number in wal.generations(directory / "wal"):
                try:
                    tables = wal.read_wal(wal.generation_path(directory / "wal", number)).tables
                except FileNotFoundError:
                    continue  # flushed meanwhile: the manifest read below names its segment
                pending.append((number, tables))
        manifest = manifests.load(directory)
        if manifest is None:
            continue
        rows = tuple(t for n, ts in pending if n > manifest.flushed_generation for t in ts)
        found[directory.name] = Snapshot(directory, manifest, rows)
    return found
