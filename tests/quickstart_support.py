"""The outputs of a quickstart that already ran, for tests that start where a user's set-up left
off instead of paying for a cold quickstart (4-6 minutes on 2 cores) once more.

.ci/run runs the README's quickstart command first (a cold run, checked on its own) and points
$KEEL_DOCS_QUICKSTART_PREFIX at the keel-out it filled; outside CI the checkout's keel-out/ (where
the set-up command leaves it) may serve. Step outputs carry their own step records, so a copy is a
step cache a later `keel quickstart` finds, wherever it lies."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

QUICKSTART_PREFIX_ENV = "KEEL_DOCS_QUICKSTART_PREFIX"
REPO = Path(__file__).resolve().parents[1]


def earlier_quickstart(*, checkout_fallback: bool) -> Path | None:
    """The prefix of an earlier quickstart: $KEEL_DOCS_QUICKSTART_PREFIX, else (when
    checkout_fallback) this checkout's keel-out/; None when there is none."""
    named = os.environ.get(QUICKSTART_PREFIX_ENV)
    source = Path(named) if named else (REPO / "keel-out" if checkout_fallback else None)
    return source if source is not None and source.is_dir() else None


def copy_quickstart_outputs(
    source: Path, prefix: Path, keep: Callable[[Path], bool] = lambda _: True
) -> list[str]:
    """Copy the quickstart's committed step outputs under `source` (those `keep` accepts) and its
    telemetry store into `prefix`; returns the names copied."""
    from keel.steps.experiment import load_experiment
    from keel.steps.step import all_steps, output_path

    quickstart = load_experiment(REPO / "keel/experiments/quickstart.py")
    outputs = [Path(output_path(str(source), step)) for step in all_steps(quickstart)]
    copied = []
    for output in [*outputs, source / "telemetry"]:
        if output.is_dir() and keep(output):
            shutil.copytree(output, prefix / output.name)
            copied.append(output.name)
    return copied
