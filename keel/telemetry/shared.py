"""One writer per store directory and process, shared by every part that reports into it.

A flow stage and the trainer in one process may both write to the same local store; a second
`TelemetryStore` on the same root would find the writer lock taken (by its own process). A
`SharedStore` handle is counted: the first opens the store, the last one's close closes it.
"""

from __future__ import annotations

import os
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa

from keel.telemetry.compaction import CompactionReport
from keel.telemetry.store import TelemetryStore


class SharedStore:
    """A handle on a store that this process shares: one writer per root and process, however
    many parts of the program (a flow stage, the trainer) report into it. Closing the last handle
    closes the store."""

    _open: ClassVar[dict[Path, tuple[TelemetryStore, int]]] = {}
    _guard = threading.Lock()

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        with SharedStore._guard:
            store, handles = SharedStore._open.get(self.root, (None, 0))
            if store is None:
                store = TelemetryStore(self.root)
            SharedStore._open[self.root] = (store, handles + 1)
        self.store: TelemetryStore | None = store

    def write(
        self,
        namespace: str,
        data: pa.Table | pa.RecordBatch | list[dict[str, Any]],
        time_unit: str | None = None,
    ) -> int:
        return self._store().write(namespace, data, time_unit=time_unit)

    def query(self, sql: str) -> pa.Table:
        return self._store().query(sql)

    def tail(self, namespace: str, limit: int = 20, after: datetime | None = None) -> pa.Table:
        return self._store().tail(namespace, limit, after)

    def namespaces(self) -> dict[str, pa.Schema]:
        return self._store().namespaces()

    def compact(self, namespace: str | None = None) -> CompactionReport:
        return self._store().compact(namespace)

    def close(self) -> None:
        if self.store is None:
            return
        with SharedStore._guard:  # held through the close: a new handle waits for the release
            store, handles = SharedStore._open[self.root]
            if handles == 1:
                del SharedStore._open[self.root]
                store.close()
            else:
                SharedStore._open[self.root] = (store, handles - 1)
            self.store = None

    def _store(self) -> TelemetryStore:
        if self.store is None:
            raise RuntimeError(f"the handle on telemetry store {self.root} is closed")
        return self.store

    def __enter__(self) -> SharedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
