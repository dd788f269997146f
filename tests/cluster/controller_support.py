"""Driving a Controller from a test: tick it until a job's status says what the test waits for."""

from __future__ import annotations

import time
from collections.abc import Callable

from keel.cluster.controller import Controller
from keel.cluster.state import job_status


def tick_until(
    control: Controller, job: str, done: Callable[[dict], bool], seconds: float = 120.0
) -> dict:
    """Tick until `done(status of job)`; the status. Fails the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        control.tick()
        status = job_status(control.database, job)
        if done(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
