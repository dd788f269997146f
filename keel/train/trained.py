"""A trained model read back from a run directory: its config, the parameters and router bias of
one checkpoint, and the tokenizer it was trained with (`keel sample`, `keel export`).

The run is only read (its checkpoints opened read-only; for a URL, the one checkpoint is
downloaded). The checkpoint is restored onto this process's first device whatever mesh the run
trained on; the optimizer state is restored with it (Orbax restores the whole state) and dropped.
The tokenizer is the one of the run's first token cache (every cache of a run shares one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import numpy as np

from keel.core import paths
from keel.core.config import load_config
from keel.core.errors import UsageError
from keel.data.token_cache import TokenCache
from keel.model.config import ModelConfig
from keel.model.sharding import MeshConfig
from keel.model.transformer import ModelParams
from keel.train.checkpoint import Checkpoints, committed_checkpoint_steps
from keel.train.config import TrainConfig
from keel.train.layout import initial_state
from keel.train.run_dir import CONFIG_FILE


@dataclass(frozen=True)
class TrainedModel:
    run: str
    step: int
    config: TrainConfig
    params: ModelParams
    """float32 parameters on one device."""
    router_bias: jax.Array | None
    """[n_moe_layers, n_routed_experts] float32; None for a dense model."""
    tokenizer_path: str
    """The run's tokenizer.json (Hugging Face tokenizers format)."""
    eos_id: int
    """The end-of-document id the run's token caches put between documents."""

    @property
    def model(self) -> ModelConfig:
        return self.config.model


def checkpoint_step(run: str, step: int | None) -> int:
    """`step` (default: the latest) after checking the run has that checkpoint; UsageError (one
    line) for a directory holding no run, a run with no checkpoint or without that step."""
    steps = committed_checkpoint_steps(run)
    if not steps:
        raise UsageError(f"{run} holds no checkpoint yet; train it first (keel train)")
    if step is None:
        return steps[-1]
    if step not in steps:
        listed = ", ".join(map(str, steps))
        raise UsageError(f"{run} has no checkpoint at step {step}; its checkpoints: {listed}")
    return step


def load_trained(run: str, step: int | None = None) -> TrainedModel:
    """The model of `run` (a run directory, local or a URL) at checkpoint `step` (default: the
    latest)."""
    step = checkpoint_step(run, step)
    config = load_config(paths.join(run, CONFIG_FILE), TrainConfig)
    tokenizer_path, eos_id = _tokenizer(config, run)
    one_device = replace(config, mesh=MeshConfig(data=1, fsdp=1, expert=1), batch_size=1)
    like, _, _ = initial_state(one_device, lambda _: 0.0, jax.devices()[:1])
    source = Checkpoints(run, every=1, keep=1, read_step=step)
    try:
        state = source.restore(like, step)
    finally:
        source.close()
    return TrainedModel(run, step, config, state.params, state.router_bias, tokenizer_path, eos_id)


def _tokenizer(config: TrainConfig, run: str) -> tuple[str, int]:
    """The run's tokenizer.json and end-of-document id, from its first token cache."""
    sources = config.data or tuple(s for phase in config.phases for s in phase.mixture)
    if not sources:
        raise UsageError(f"{run}: its {CONFIG_FILE} names no token cache, so no tokenizer")
    cache_path = sources[0].cache
    if not paths.exists(paths.join(cache_path, "manifest.json")):
        raise UsageError(
            f"{run} was trained on {cache_path}, which is gone: its tokenizer.json is needed"
        )
    cache = TokenCache(cache_path)
    return cache.tokenizer_path(), cache.eos_id


def as_numpy(tree: object) -> object:
    """Every array of a pytree as a host numpy array."""
    return jax.tree.map(np.asarray, tree)
