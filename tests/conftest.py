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


# -- parallel runs (pytest -n 2, README's test command) -------------------------------------------
# pytest-xdist with --dist loadgroup sends each xdist_group to one worker. Every test is grouped by
# its file, so a module fixture (a training run, a Ray head) is built once; tests that share an
# expensive session fixture, or a resource there is only one of (the test Slurm cluster, a Ray
# instance), share a group across files. Without xdist the marks do nothing. The mesh reference
# runs (one_device_run, gang_run, eight_device_run) are made once for all workers
# (tests/mesh_support.py, made_once), so the files that compare against them spread over both.
# Caution: with pytest 9.2 and pytest-xdist 3.8 the groups are not honoured (xdist's nodeid
# suffix no longer takes, pytest-dev/pytest-xdist#1386): each test goes to either worker.
SHARED_GROUPS = {
    "slurm_cluster": "slurm",  # one slurmctld + slurmd on this host
    "trained_run": "interop",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        shared = [SHARED_GROUPS[name] for name in item.fixturenames if name in SHARED_GROUPS]
        if item.nodeid.startswith("tests/cluster/test_training_gang.py"):
            shared.append("slurm")  # the local gang too: one training gang at a time on 2 cores
        if item.nodeid.startswith("tests/dashboard/"):
            shared.append("dashboard")  # one prefix, one `keel dashboard`, one browser
        if item.get_closest_marker("ray"):
            shared.append("ray")  # Ray instances: one at a time, and memory
        group = shared[0] if shared else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
