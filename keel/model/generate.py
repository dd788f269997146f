"""Text generation from token ids: a jitted prefill, then one jitted call per new token over the
key/value cache (decode.py), sampling with temperature and nucleus (top-p) truncation.

Deterministic for a seed: the token at position p is drawn with the key fold_in(key(seed), p),
so the same prompt, parameters and settings give the same tokens on every run. Temperature 0 is
greedy (argmax). Shapes: prompt [batch, prompt_len] int32; the result [batch, <= max_tokens].
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from keel.core.errors import UsageError
from keel.model.config import ModelConfig
from keel.model.decode import KVCache, forward_cached, init_cache
from keel.model.transformer import ModelParams


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the logits."""

    max_tokens: int = 64
    """New tokens to generate at most (fewer when every sequence reaches `stop_id`)."""
    temperature: float = 1.0
    """Logits are divided by it before sampling; 0 picks the most likely token (greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: only the most likely tokens whose probabilities sum to top_p remain."""
    seed: int = 0

    def validate(self) -> SamplingConfig:
        if self.max_tokens < 1:
            raise UsageError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        return self


@dataclass(frozen=True)
class Generation:
    tokens: np.ndarray
    """[batch, generated] int32: the new tokens (the prompt excluded; stop_id included)."""
    prefill_seconds: float
    """Wall time of the prompt's forward pass and the first token, compilation included."""
    decode_seconds: float
    """Wall time of the one-token steps after the first such step (which compiles)."""
    decode_steps: int
    """The one-token steps `decode_seconds` covers."""

    @property
    def decode_tokens_per_second(self) -> float:
        """New tokens per second over the timed one-token steps, every sequence of the batch
        counted (0 when fewer than three tokens were generated)."""
        if self.decode_steps < 1 or self.decode_seconds <= 0:
            return 0.0
        return self.decode_steps * self.tokens.shape[0] / self.decode_seconds


def sample_token(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits [batch, vocab] float32 -> token ids [batch] int32."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        choice = jax.random.categorical(key, sorted_logits, axis=-1)
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("config", "temperature", "top_p"), donate_argnames=("cache",))
def _step(
    params: ModelParams,
    tokens: jax.Array,
    router_bias: jax.Array | None,
    cache: KVCache,
    start: jax.Array,
    key: jax.Array,
    *,
    config: ModelConfig,
    temperature: float,
    top_p: float,
) -> tuple[jax.Array, KVCache]:
    """Feed tokens [batch, n] at `start`; the next token [batch] (drawn with the key of its
    position start + n) and the updated cache."""
    logits, cache = forward_cached(params, tokens, config, router_bias, cache, start)
    position_key = jax.random.fold_in(key, start + tokens.shape[1])
    return sample_token(logits[:, -1], position_key, temperature, top_p), cache


def generate(
    params: ModelParams,
    config: ModelConfig,
    router_bias: jax.Array | None,
    prompt: np.ndarray,
    sampling: SamplingConfig,
    stop_id: int | None = None,
) -> Generation:
    """Generate up to sampling.max_tokens tokens after `prompt` [batch, prompt_len]; stop early
    once every sequence has produced `stop_id`."""
    sampling = sampling.validate()
    prompt = np.asarray(prompt, np.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise UsageError("the prompt is empty: give at least one token")
    batch, prompt_len = prompt.shape
    cache = init_cache(config, batch, prompt_len + sampling.max_tokens)
    key = jax.random.key(sampling.seed)
    settings = {"config": config, "temperature": sampling.temperature, "top_p": sampling.top_p}
    began = time.perf_counter()
    token, cache = _step(
        params, jnp.asarray(prompt), router_bias, cache, jnp.int32(0), key, **settings
    )
    out = [np.asarray(token)]
    prefilled = time.perf_counter()
    compiled = prefilled  # set again after the first one-token step, which compiles
    done = _stopped(out[-1], stop_id)
    for position in range(prompt_len, prompt_len + sampling.max_tokens - 1):
        if done.all():
            break
        token, cache = _step(
            params, token[:, None], router_bias, cache, jnp.int32(position), key, **settings
        )
        out.append(np.asarray(token))
        done |= _stopped(out[-1], stop_id)
        if position == prompt_len:
            compiled = time.perf_counter()
    finished = time.perf_counter()
    timed_steps = max(len(out) - 2, 0)
    return Generation(np.stack(out, axis=1), prefilled - began, finished - compiled, timed_steps)


def _stopped(tokens: np.ndarray, stop_id: int | None) -> np.ndarray:
    """[batch] bool: which sequences just produced `stop_id` (none without one)."""
    if stop_id is None:
        return np.zeros(tokens.shape, bool)
    return tokens == stop_id
