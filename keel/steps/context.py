"""Which step is running in this thread: lets work inside a step name itself by its final output.

A step function writes into a staging directory that is renamed on success; anything it reports
elsewhere (a training run's metrics to telemetry) should carry the path the output will have, not
the staging one. The executor sets it around each step function; threads do not share it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

_OUTPUT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "keel_step_output", default=None
)


@contextmanager
def running_step(output: str) -> Iterator[None]:
    token = _OUTPUT.set(output)
    try:
        yield
    finally:
        _OUTPUT.reset(token)


def step_output() -> str | None:
    """The final output path of the step running in this thread, or None outside a step."""
    return _OUTPUT.get()
