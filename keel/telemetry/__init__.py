"""Layer 1: the telemetry store: namespaced tables (metrics, logs, events) in immutable, indexed
Parquet segments on local disk, written through a write-ahead log and queried with DuckDB SQL.

    from keel.telemetry import TelemetryStore
    with TelemetryStore("keel-out/telemetry") as store:
        store.write("train.metrics", [{"ts": "2026-11-30T10:00:00", "run": "a", "loss": 2.5}])
        store.query('SELECT run, min(loss) FROM "train.metrics" GROUP BY run')

See docs/telemetry.md.
"""

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

__all__ = [
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
