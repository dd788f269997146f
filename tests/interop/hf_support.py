"""Random keel models for the Hugging Face export tests (no torch needed here)."""

from dataclasses import replace

import jax

from keel.data.token_cache import TokenCache
from keel.model.config import ModelConfig
from keel.model.transformer import init_params, init_router_bias
from keel.train.presets import preset
from keel.train.trained import TrainedModel


def random_trained(model: ModelConfig, cache: str) -> TrainedModel:
    """A randomly initialised model of `model`'s shape with the test cache's tokenizer."""
    config = replace(preset("tiny-dense"), model=model)
    params = init_params(jax.random.key(0), model)
    opened = TokenCache(cache)
    bias = init_router_bias(model)
    return TrainedModel("random", 0, config, params, bias, opened.tokenizer_path(), opened.eos_id)
