"""The trained run the interop tests read (keel sample, keel export, keel eval, parity with
transformers). Nothing here reaches the network: the Hugging Face libraries run offline (set
before any test imports them; subprocesses inherit it)."""

import os
from dataclasses import replace
from pathlib import Path

import jax
import pytest
from mesh_support import small_dense

from keel.train.trainer import train

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, wikitext_cache) -> Path:
    """A tiny dense run of 2 steps on the test cache (checkpoint at step 2), trained once."""
    output = tmp_path_factory.mktemp("interop") / "run"
    config = small_dense(f"data=[{{cache: {wikitext_cache}}}]", "steps=2", "checkpoint_every=2",
                         "phases.0.schedule.warmup_steps=1")  # fmt: skip
    train(replace(config, eval_every=1000), str(output), devices=jax.devices()[:1])
    return output
