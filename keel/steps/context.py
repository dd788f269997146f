"""Which step is running in this thread: lets work inside a step name itself by its final output,
and find the work an earlier, interrupted attempt of the same step left.

A step function writes into a staging directory that is renamed on success; anything it reports
elsewhere (a training run's metrics to telemetry) should carry the path the output will have, not
the staging one. Each attempt gets a fresh staging directory, so work meant to survive a kill (a
training run's checkpoints) goes into the step's work directory instead: kept across attempts of
the same step identity, removed once the output is committed. The executor (and keel/cluster's
step job) sets both around each step function; threads do not share them.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

_OUTPUT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "keel_step_output", default=None
)
_WORK: contextvars.ContextVar[str | None] = contextvars.ContextVar("keel_step_work", default=None)


@contextmanager
def running_step(output: str, work_dir: str | None = None) -> Iterator[None]:
    """Within this block the running step's final output is `output` and its work directory
    `work_dir` (None: the step has none)."""
    output_token, work_token = _OUTPUT.set(output), _WORK.set(work_dir)
    try:
        yield
    finally:
        _OUTPUT.reset(output_token)
        _WORK.reset(work_token)


def step_output() -> str | None:
    """The final output path of the step running in this thread, or None outside a step."""
    return _OUTPUT.get()


def step_work_dir() -> str | None:
    """The running step's work directory (it may not exist yet), or None outside a step: the
    place for what a rerun of the same step must find after a kill. Removed once the step's
    output is committed."""
    return _WORK.get()
