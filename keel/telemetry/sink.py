"""Reporting into the store from other layers: the trainer's metrics and flow's stage counters.

Metrics go in long form, one row per (run, step, metric), so runs with different metrics (a dense
and an MoE model, different layer counts) share one table and a query picks metrics by name:

    SELECT step, value FROM "train.metrics" WHERE run = 'runs/a' AND name = 'loss' ORDER BY step

Nested values are flattened into dotted names: router.load_max_over_mean.3 is layer 3's value.
The target is a store directory or a server URL (`keel logs serve`); a token comes from the
KEEL_TELEMETRY_TOKEN environment variable.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from keel.telemetry.client import Telemetry

TOKEN_ENV = "KEEL_TELEMETRY_TOKEN"
TARGET_ENV = "KEEL_TELEMETRY"
METRICS_NAMESPACE = "train.metrics"
FLOW_NAMESPACE = "flow.stage"
METRICS_SCHEMA = pa.schema(
    [
        ("ts", pa.timestamp("us")),
        ("run", pa.string()),
        ("step", pa.int64()),
        ("name", pa.string()),
        ("value", pa.float64()),
    ]
)


def open_target(target: str) -> Telemetry:
    """A client for a store directory or server URL, with the token from the environment."""
    from keel.telemetry.client import connect  # the store and its engine: only when writing

    return connect(target, token=os.environ.get(TOKEN_ENV))


def now() -> datetime:
    """Wall-clock time as the stores keep it: UTC, without a time zone."""
    return datetime.now(UTC).replace(tzinfo=None)


def flatten(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted name, number) for every number in nested dicts and lists; text is skipped."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten(value, f"{name}.")
        elif isinstance(value, list | tuple):
            yield from flatten({str(i): v for i, v in enumerate(value)}, f"{name}.")
        elif isinstance(value, bool | int | float):
            yield name, float(value)


class MetricsSink:
    """Writes one step's metrics per call to `train.metrics` (rows: ts, run, step, name, value).
    With an empty target it writes nothing, so callers need no branch. A context manager."""

    def __init__(self, target: str, run: str) -> None:
        self.client = open_target(target) if target else None
        self.run = run

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        if self.client is None:
            return
        pairs = [(name, value) for name, value in flatten(values) if name != "step"]
        stamp = now()
        table = pa.table(
            {
                "ts": pa.array([stamp] * len(pairs), pa.timestamp("us")),
                "run": [self.run] * len(pairs),
                "step": pa.array([step] * len(pairs), pa.int64()),
                "name": [name for name, _ in pairs],
                "value": pa.array([value for _, value in pairs], pa.float64()),
            },
            schema=METRICS_SCHEMA,
        )
        self.client.write(METRICS_NAMESPACE, table)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def write_record(target: str, namespace: str, record: Mapping[str, Any]) -> None:
    """One row (a dict of scalars) with the current time as `ts`, to a namespace."""
    client = open_target(target)
    try:
        client.write(namespace, [{"ts": now(), **record}])
    finally:
        client.close()
