"""The fuzz suite's servers: one real telemetry server and one real controller API for the whole
suite, on 127.0.0.1 (its helpers are in fuzz_support.py: a module named conftest would clash
with tests/cli's)."""

import pytest

from keel.cluster import state
from keel.cluster.api import ControllerServer
from keel.telemetry import StoreOptions, TelemetryStore
from keel.telemetry.server import TelemetryServer


@pytest.fixture(scope="session")
def telemetry(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-telemetry")
    with (
        TelemetryStore(root, StoreOptions(background=False)) as store,
        TelemetryServer(store, max_request_bytes=1 << 20) as server,
    ):
        yield server


@pytest.fixture(scope="session")
def controller(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-controller")
    state.connect(root / "state.db").close()  # as a running controller has it: counts never race
    server = ControllerServer(root).start()
    yield server
    server.stop()
