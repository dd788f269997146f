"""The experiment record a process works for: `keel run --experiment ID` (or `EXPERIMENT = "ID"`
in the experiment file) sets KEEL_EXPERIMENT, and the work it starts (steps, training runs, step
jobs on a cluster, which inherit KEEL_* settings) reads it here to write the id into its records.

The id is provenance only: it never enters a step's identity, so outputs are shared (cached)
across experiments.
"""

from __future__ import annotations

import os

EXPERIMENT_ENV = "KEEL_EXPERIMENT"


def current_experiment() -> str | None:
    """The id of the experiment record this process works for, or None outside one."""
    return os.environ.get(EXPERIMENT_ENV) or None
