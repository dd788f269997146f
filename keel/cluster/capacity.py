"""Capacity reports: what each cluster offers, asked of its backend and written to `clusters`.

The controller asks every `report_every` ticks, after polling its tasks (so what ended is free
in the report), puts the reports into its reservation ledger (keel.cluster.ledger) and writes
them here, inside its tick's transaction, for `keel cluster status` and job commands to read.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Mapping

import orjson

from keel.cluster.backend import Capacity, TaskBackend
from keel.core.errors import KeelError

logger = logging.getLogger(__name__)


def take_capacities(backends: Mapping[str, TaskBackend]) -> dict[str, Capacity]:
    """Each backend's capacity now, by cluster name; a backend that cannot answer is left out
    (its last report stands) with a warning."""
    capacities = {}
    for name, backend in backends.items():
        try:
            capacities[name] = backend.capacity()
        except KeelError as error:  # keep the last report; retry next time
            logger.warning("cluster %s reported no capacity: %s", name, error)
    return capacities


def write_capacities(
    database: sqlite3.Connection,
    capacities: Mapping[str, Capacity],
    backends: Mapping[str, TaskBackend],
    regions: Mapping[str, str],
    tick: int,
) -> None:
    """Upsert one `clusters` row per report (inside the caller's transaction); a region set in
    the configuration wins over the one the backend reports."""
    now = time.time()
    database.executemany(
        "INSERT INTO clusters (name, backend, region, total, free, reported_at, reported_tick) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
        "backend = excluded.backend, region = excluded.region, "
        "total = excluded.total, free = excluded.free, "
        "reported_at = excluded.reported_at, reported_tick = excluded.reported_tick",
        [
            (
                name,
                backends[name].name,
                regions.get(name, capacity.region),
                orjson.dumps(dict(capacity.total)).decode(),
                orjson.dumps(dict(capacity.free)).decode(),
                now,
                tick,
            )
            for name, capacity in capacities.items()
        ],
    )
