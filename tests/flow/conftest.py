"""Shared fixtures for keel/flow tests: one local worker pool per test module keeps them fast."""

import pytest

from keel.flow import LocalBackend


@pytest.fixture(scope="module")
def pool():
    with LocalBackend(workers=2) as backend:
        yield backend
