"""The trained run the interop tests read (keel sample, keel export, parity with transformers)."""

from dataclasses import replace
from pathlib import Path

import jax
import pytest
from mesh_support import small_dense

from keel.train.trainer import train


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, wikitext_cache) -> Path:
    """A tiny dense run of 2 steps on the test cache (checkpoint at step 2), trained once."""
    output = tmp_path_factory.mktemp("interop") / "run"
    config = small_dense(f"data=[{{cache: {wikitext_cache}}}]", "steps=2", "checkpoint_every=2",
                         "phases.0.schedule.warmup_steps=1")  # fmt: skip
    train(replace(config, eval_every=1000), str(output), devices=jax.devices()[:1])
    return output
