"""Layer 1: the telemetry store: namespaced tables (metrics, logs, events) in immutable, indexed
Parquet segments on local disk, written through a write-ahead log and queried with DuckDB SQL.

    from keel.telemetry import TelemetryStore
    with TelemetryStore("keel-out/telemetry") as store:
        store.write("train.metrics", [{"ts": "2026-11-30T10:00:00", "run": "a", "loss": 2.5}])
        store.query('SELECT run, min(loss) FROM "train.metrics" GROUP BY run')

See docs/telemetry.md.

The names below load their modules on first use (PEP 562): a module that only reports into a
store (keel.telemetry.sink, imported by every flow worker) does not pay for the store, DuckDB
and the query engine (~0.1-0.2 s) unless it writes.
"""

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "CompactionReport": "keel.telemetry.compaction",
    "NamespaceOptions": "keel.telemetry.schema",
    "QueryLimitError": "keel.telemetry.schema",
    "QueryLimits": "keel.telemetry.schema",
    "StoreBusyError": "keel.telemetry.schema",
    "TelemetryInputError": "keel.telemetry.schema",
    "TelemetryQueryError": "keel.telemetry.schema",
    "check_namespace": "keel.telemetry.schema",
    "StoreOptions": "keel.telemetry.store",
    "TelemetryStore": "keel.telemetry.store",
}
__all__ = [  # the names of _EXPORTS, written out for readers and linters
    "CompactionReport",
    "NamespaceOptions",
    "QueryLimitError",
    "QueryLimits",
    "StoreBusyError",
    "StoreOptions",
    "TelemetryInputError",
    "TelemetryQueryError",
    "TelemetryStore",
    "check_namespace",
]

if TYPE_CHECKING:
    from keel.telemetry.compaction import CompactionReport
    from keel.telemetry.schema import (
        NamespaceOptions,
        QueryLimitError,
        QueryLimits,
        StoreBusyError,
        TelemetryInputError,
        TelemetryQueryError,
        check_namespace,
    )
    from keel.telemetry.store import StoreOptions, TelemetryStore


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'keel.telemetry' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
