"""Helpers for driving the real `keel` command in subprocesses, as a user would."""

from pathlib import Path

import pytest
from cli_support import KeelCli


@pytest.fixture
def cli(tmp_path: Path) -> KeelCli:
    return KeelCli(tmp_path)
