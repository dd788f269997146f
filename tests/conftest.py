"""Simulate 8 CPU devices for the mesh tests. XLA reads the flag when JAX starts its CPU
backend, so it is set here, before any test module imports jax; single-device code still runs on
device 0, and training pins one device (KEEL_DEVICES=1) unless a test asks for a mesh. Also:
fixtures more than one test directory uses."""

import atexit
import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from mesh_support import gang_run, one_device_run  # noqa: F401  (fixtures, used by name)
from s3_support import s3, s3_server  # noqa: F401  (fixtures, used by name)

WIKITEXT_SAMPLE = Path(__file__).parents[1] / "keel/experiments/sample/wikitext2.jsonl.gz"

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
# Training that does not test meshes runs on one device (in this process and in the keel
# commands tests start); mesh tests name their devices, or clear this for their processes.
os.environ["KEEL_DEVICES"] = "1"
# One JAX compilation cache for the session (unless one is named): the suite's many `python -m
# keel train` processes then compile each program once.
if "KEEL_COMPILATION_CACHE" not in os.environ:
    _compilation_cache = tempfile.mkdtemp(prefix="keel-test-jax-cache-")
    atexit.register(shutil.rmtree, _compilation_cache, ignore_errors=True)
    os.environ["KEEL_COMPILATION_CACHE"] = _compilation_cache


@pytest.fixture(scope="session")
def wikitext_cache(tmp_path_factory) -> str:
    """A real token cache (vocabulary 512) of the bundled Wikipedia articles, built once."""
    from keel.data.documents import write_texts
    from keel.data.tokenize import TokenizeConfig, run_tokenize
    from keel.flow import RunOptions

    root = tmp_path_factory.mktemp("wikitext-cache")
    with gzip.open(WIKITEXT_SAMPLE, "rt") as lines:
        texts = [json.loads(line)["text"] for line in lines]
    docs = write_texts(root / "docs", texts)
    run_tokenize(docs, str(root / "cache"), TokenizeConfig(vocab_size=512), RunOptions(workers=1))
    return str(root / "cache")


@pytest.fixture(autouse=True)
def _keel_logging_restored():
    """A command run in-process (typer's CliRunner) sets up keel's log handler; put the logger
    back after each test, so a later test's captured output does not depend on test order."""
    import logging

    keel_logger = logging.getLogger("keel")
    saved = keel_logger.handlers[:], keel_logger.level, keel_logger.propagate
    yield
    keel_logger.handlers[:], keel_logger.level, keel_logger.propagate = saved


# -- parallel runs (pytest -n 2 --dist loadgroup, README's test command) -------------------------
# Each test belongs to a group that one worker runs whole: its file, so a module fixture (a
# training run, a Ray head) is built once, or a group shared across files by tests that share an
# expensive session fixture or a resource there is only one of (the test Slurm cluster, a Ray
# instance, the dashboard's browser). The mesh reference runs (one_device_run, gang_run,
# eight_device_run) are made once for all workers (tests/mesh_support.py, made_once), so the files
# that compare against them spread over both.
#
# The groups reach xdist through the scheduler below, not through `xdist_group` marks: with
# pytest 9.2 and pytest-xdist 3.8 the marks are silently ignored (xdist tags a test's nodeid with
# its group on the worker, and pytest 9.2 no longer lets it; pytest-dev/pytest-xdist#1386), and a
# group's tests then ran on both workers. Each worker writes the group of every test it collected
# (the mapping needs its fixtures and marks) into KEEL_TEST_GROUPS, a directory the controller
# makes before it starts them; the controller's scheduler reads it once every worker has
# collected, and deals out whole groups.
SHARED_GROUPS = {
    "slurm_cluster": "slurm",  # one slurmctld + slurmd on this host
    "trained_run": "interop",
}
GROUPS_DIRECTORY = "KEEL_TEST_GROUPS"
if "PYTEST_XDIST_WORKER" not in os.environ and GROUPS_DIRECTORY not in os.environ:
    _groups = tempfile.mkdtemp(prefix="keel-test-groups-")
    atexit.register(shutil.rmtree, _groups, ignore_errors=True)
    os.environ[GROUPS_DIRECTORY] = _groups


def group_of(item: pytest.Item) -> str:
    """The group of tests `item` runs with on one worker."""
    shared = [SHARED_GROUPS[name] for name in item.fixturenames if name in SHARED_GROUPS]
    if item.nodeid.startswith("tests/cluster/test_training_gang.py"):
        shared.append("slurm")  # the local gang too: one training gang at a time on 2 cores
    if item.nodeid.startswith("tests/dashboard/"):
        shared.append("dashboard")  # one prefix, one `keel dashboard`, one browser
    if item.get_closest_marker("ray"):
        shared.append("ray")  # Ray instances: one at a time, and memory
    return shared[0] if shared else item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    groups = {item.nodeid: group_of(item) for item in items}
    written = Path(os.environ[GROUPS_DIRECTORY], f"{worker}.json")
    staged = written.with_suffix(".partial")
    staged.write_text(json.dumps(groups))
    staged.replace(written)  # whole, before this worker reports its collection


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with each test's scope its group (group_of)."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # every worker has collected (and written) by now
                self.groups = {}
                for written in Path(os.environ[GROUPS_DIRECTORY]).glob("*.json"):
                    self.groups.update(json.loads(written.read_text()))
            return self.groups.get(nodeid) or nodeid.split("::")[0]

    return GroupScheduling(config, log)
