"""Reference runs for the mesh and gang tests, shared by tests/train and tests/cluster.

Every run is 20 steps of tiny-moe (vocabulary cut to the test cache's 512 ids, sequences of 64,
the default router bias step) in float32 with capacities so high that nothing drops,
checkpointed at steps 10 and 20. The one-device run and the 2-process x 4-device gang (fsdp 2 x
expert 4) are made once a session: under pytest-xdist by the first worker that needs them, the
others read their metrics (`made_once`), so the tests that compare against them need not share
one worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from filelock import FileLock

from keel.core.config import apply_overrides, dump_config
from keel.model.sharding import MeshConfig
from keel.train.config import TrainConfig
from keel.train.presets import preset
from keel.train.trainer import train

STEPS = 20
KEEL = [sys.executable, "-m", "keel"]
ALL_DEVICES = MeshConfig()
GANG_MESH = MeshConfig(data=1, fsdp=2, expert=4)
FOUR_DEVICES = "--xla_force_host_platform_device_count=4"
# Unreachable-coordinator tests wait this long for the coordinator, not the default
# REACH_TIMEOUT_SECONDS; what the default would add to the time they measure is checked against
# the 60 s bound instead (within_60_s_at_the_default_reach_timeout).
SHORT_REACH_TIMEOUT = {"KEEL_COORDINATOR_TIMEOUT": "3"}


def tiny_moe(cache: str, mesh: MeshConfig = ALL_DEVICES, **changes) -> TrainConfig:
    config = apply_overrides(
        preset("tiny-moe"),
        [
            "model.vocab_size=512",
            "phases.0.seq_len=64",
            "phases.0.schedule.warmup_steps=4",
            "model.send_capacity=8",
            "model.receive_capacity=8",
            # The model's default bias step, not tiny-moe's 10x faster one: the sign rule turns
            # a routing score one rounding apart (another reduction order) into a full bias
            # step, and at 1e-2 that alone moves the loss by 3e-4 within 20 steps.
            "model.router.bias_rate=0.001",
        ],
    )
    config = replace(
        config,
        steps=STEPS,
        mesh=mesh,
        eval_every=STEPS,
        eval_batches=1,
        checkpoint_every=10,
        **changes,
    )
    return config.with_data((cache,))


def small_dense(*overrides: str) -> TrainConfig:
    """tiny-dense cut down to seconds a run: 1 layer, the test cache's 512 ids, 4 x 64 tokens a
    step, a 5-step warmup; `overrides` (key=value) on top."""
    return apply_overrides(
        preset("tiny-dense"),
        [
            "model.n_layers=1",
            "model.vocab_size=512",
            "batch_size=4",
            "phases.0.seq_len=64",
            "phases.0.schedule.warmup_steps=5",
            *overrides,
        ],
    )


def run(config: TrainConfig, output: Path, devices: int) -> list[dict]:
    """Train in this process on its first `devices` devices; the metrics lines."""
    train(config, str(output), devices=jax.devices()[:devices])
    return metrics(output)


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def assert_same_losses(got: list[dict], want: list[dict], rtol: float = 1e-5) -> None:
    assert [row["step"] for row in got] == [row["step"] for row in want]
    assert all(row["drop_rate"] == 0.0 for row in got), [row["drop_rate"] for row in got]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=rtol)


def gang_env() -> dict[str, str]:
    """This environment for a gang member: four devices, without the suite's one-device pin."""
    env = {key: value for key, value in os.environ.items() if key != "KEEL_DEVICES"}
    return {**env, "XLA_FLAGS": FOUR_DEVICES}


def write_config(config: TrainConfig, path: Path) -> Path:
    dump_config(config, str(path))
    return path


def within_60_s_at_the_default_reach_timeout(seconds: float) -> bool:
    """Whether a failure that took `seconds` with SHORT_REACH_TIMEOUT's wait would take under
    60 s with the default wait (keel.train.distributed.REACH_TIMEOUT_SECONDS) instead."""
    from keel.train.distributed import REACH_TIMEOUT_SECONDS

    short = float(SHORT_REACH_TIMEOUT["KEEL_COORDINATOR_TIMEOUT"])
    assert seconds >= short, seconds  # it did wait
    return seconds - short + REACH_TIMEOUT_SECONDS < 60


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[], Any]) -> Any:
    """`make()` (JSON data) once per test session: alone, or under pytest-xdist once for all
    workers, by the first that asks (the others wait for it and read its result from the
    session's shared temporary directory)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make()
    shared = tmp_path_factory.getbasetemp().parent  # the workers' basetemps are siblings
    result = shared / f"{name}.json"
    with FileLock(str(result) + ".lock"):
        if not result.exists():
            made = make()
            result.with_suffix(".tmp").write_text(json.dumps(made))
            result.with_suffix(".tmp").rename(result)
        return json.loads(result.read_text())


@pytest.fixture(scope="session")
def one_device_run(wikitext_cache, tmp_path_factory) -> list[dict]:
    def make() -> list[dict]:
        return run(tiny_moe(wikitext_cache), tmp_path_factory.mktemp("one-device") / "run", 1)

    return made_once(tmp_path_factory, "one-device-run", make)


@pytest.fixture(scope="session")
def gang_run(wikitext_cache, tmp_path_factory) -> tuple[list[dict], str, str]:
    """(metrics, stdout, stderr) of `keel train --processes 2` on 2 processes x 4 devices, with
    a compilation cache of its own (so process 0 compiles every program) and debug logs."""

    def make() -> tuple[list[dict], str, str]:
        root = tmp_path_factory.mktemp("gang")
        config_file = write_config(tiny_moe(wikitext_cache, GANG_MESH), root / "run.yaml")
        command = [*KEEL, "train", str(config_file), "--processes", "2", "--output", "run"]
        env = {
            **gang_env(),
            "KEEL_COMPILATION_CACHE": str(root / "jax-cache"),
            "KEEL_LOG_LEVEL": "debug",
        }
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return metrics(root / "run"), done.stdout, done.stderr

    got_metrics, stdout, stderr = made_once(tmp_path_factory, "gang-run", make)
    return got_metrics, stdout, stderr
