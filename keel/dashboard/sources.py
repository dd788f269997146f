"""What the dashboard reads: a prefix directory (`--root`, e.g. keel-out) or a telemetry server.

A prefix holds the step store (committed outputs and .keel/ control records), the telemetry store
at `<prefix>/telemetry` (where `keel run` and the quickstart report) and the controller's state at
`<prefix>/cluster` (`keel job`'s default root, keel-out/cluster). With `--url` only telemetry is
there: runs and their metrics, log search and SQL; steps, data stages and jobs are empty.
Experiment records (keel.records) are the project's `experiments/` directory, read with either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from keel.core.errors import UsageError
from keel.records.record import records_root
from keel.telemetry.client import Telemetry, connect

TELEMETRY_DIR = "telemetry"
CLUSTER_DIR = "cluster"


@dataclass(frozen=True)
class Sources:
    """`root`: the prefix (None with --url). `telemetry`: the store or server (None when the
    prefix has no telemetry store yet). `label`: what the page's title says it shows.
    `records`: the experiment records directory (None when there is none)."""

    root: Path | None
    telemetry: Telemetry | None
    label: str
    records: Path | None = None

    @property
    def cluster_root(self) -> Path | None:
        """The controller's state directory under the prefix, if there is one."""
        if self.root is None or not (self.root / CLUSTER_DIR).is_dir():
            return None
        return self.root / CLUSTER_DIR

    def close(self) -> None:
        if self.telemetry is not None:
            self.telemetry.close()


def open_sources(
    root: str | None, url: str | None, token: str | None = None, experiments: str | None = None
) -> Sources:
    """Sources for `--root DIR` or `--url URL` (one of them; neither: ./keel-out), with the
    records of `--experiments DIR` (default: ./experiments when it exists)."""
    if root is not None and url is not None:
        raise UsageError("give --root or --url, not both")
    records = _records(experiments)
    if url is not None:
        return Sources(None, connect(url, token=token), url, records)
    prefix = Path(root or "keel-out")
    if not prefix.is_dir():
        raise UsageError(
            f"{prefix}: no such directory: pass the prefix your runs wrote (e.g. --root keel-out)"
        )
    prefix = prefix.resolve()
    store = prefix / TELEMETRY_DIR
    telemetry = connect(str(store), token=token) if store.is_dir() else None
    return Sources(prefix, telemetry, os.fspath(prefix), records)


def _records(experiments: str | None) -> Path | None:
    """The records directory `--experiments` names (it must exist), else ./experiments if any."""
    if experiments is None:
        default = records_root()
        return default if default.is_dir() else None
    path = Path(experiments)
    if not path.is_dir():
        raise UsageError(
            f"{path}: no such directory: pass the experiments/ directory that "
            "`keel experiment new` made"
        )
    return path.resolve()


def sql_text(value: str) -> str:
    """`value` as a SQL string literal."""
    return "'" + value.replace("'", "''") + "'"
