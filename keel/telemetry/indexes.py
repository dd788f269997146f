"""A store's sidecar indexes by (namespace, segment name): loaded once, checked against the
segment checksum the manifest records, and rebuilt by the writer when missing or stale."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from keel.telemetry import segment
from keel.telemetry.manifest import SegmentEntry
from keel.telemetry.namespace import NamespaceWriter
from keel.telemetry.sidecar import SegmentIndex, load_index

logger = logging.getLogger(__name__)


class SegmentIndexes:
    """Indexes of a store's segments. A missing or stale one is answered None (the query scans
    the segment whole) and, in the writing process, queued in `stale` for `rebuild`."""

    def __init__(self, root: Path, state: threading.Condition) -> None:
        self._root = root
        self._state = state  # the store's: guards `stale` and the writer's namespaces
        self._loaded: dict[tuple[str, str], SegmentIndex] = {}
        self.stale: set[tuple[str, str]] = set()

    def put(self, namespace: str, name: str, index: SegmentIndex) -> None:
        self._loaded[(namespace, name)] = index

    def forget(self, namespace: str, name: str) -> None:
        self._loaded.pop((namespace, name), None)

    def lookup(self, namespace: str, entry: SegmentEntry, *, writer: bool) -> SegmentIndex | None:
        """The segment's index if its sidecar is whole and matches `entry.checksum`, else None
        (queued for a rebuild when `writer`, the process holding the writer lock)."""
        key = (namespace, entry.name)
        cached = self._loaded.get(key)
        if cached is not None and cached.checksum == entry.checksum:
            return cached
        path = segment.index_path(self._root / namespace / "segments", entry.name)
        index = load_index(path, entry.checksum)
        if index is not None:
            self._loaded[key] = index
            return index
        logger.warning(
            "index of segment %s/%s is missing or stale: scanning it", namespace, entry.name
        )
        if writer:
            with self._state:
                self.stale.add(key)
                self._state.notify_all()
        return None

    def rebuild(self, spaces: dict[str, NamespaceWriter]) -> None:
        """Rebuild every stale index of a segment still in its manifest (caller holds the
        store's work lock; `spaces` is the writer's namespaces, read under the state lock)."""
        while True:
            with self._state:
                if not self.stale:
                    return
                namespace, name = next(iter(self.stale))
                space = spaces.get(namespace)
                entry = (
                    next((s for s in space.manifest.segments if s.name == name), None)
                    if space
                    else None
                )
            if space is not None and entry is not None:
                index = segment.rebuild_index(
                    space.directory / "segments",
                    entry,
                    space.manifest.options,
                    space.manifest.schema,
                )
                self._loaded[(namespace, name)] = index
            with self._state:
                self.stale.discard((namespace, name))
                self._state.notify_all()
