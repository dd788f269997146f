"""Rotary position embeddings (NeoX half-split layout) and their scaling for longer context.

`model.rope_scaling` picks how the rotation frequencies change when a model runs at a length
beyond the one it was trained at (`model.rope_original_len`, in tokens):

- "none": inverse frequencies theta ** (-2i / rotary_dim), i = 0 .. rotary_dim / 2 - 1;
- "linear": position interpolation (Chen et al. 2023): every frequency divided by rope_factor;
- "yarn": YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): frequencies that
  turn fewer than beta_slow times over the original length are interpolated (divided by the
  factor), those that turn more than beta_fast times are kept, with a linear ramp between; and
  the attention logits are sharpened by the paper's temperature, sqrt(1 / t) = 0.1 ln(s) + 1,
  multiplied into the cos and sin tables as the reference implementation does, so queries and
  keys each carry it (every logit between two rotated dimensions scales by its square).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from keel.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> jax.Array:
    """Radians per position of each rotated pair, [rotary_dim // 2] float32, after scaling."""
    half = config.rotary_dim // 2
    base = config.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / max(half, 1))
    if config.rope_scaling == "none":
        return base
    if config.rope_scaling == "linear":
        return base / config.rope_factor
    interpolated = jnp.asarray(yarn_ramp(config), jnp.float32)  # 1: divide by the factor
    return base / config.rope_factor * interpolated + base * (1.0 - interpolated)


def yarn_ramp(config: ModelConfig) -> np.ndarray:
    """YaRN's ramp over the rotated pairs [rotary_dim // 2]: 0 for the fast dimensions (more than
    beta_fast turns over rope_original_len: kept), 1 for the slow ones (fewer than beta_slow
    turns: interpolated), linear between the two correction dimensions."""
    half = config.rotary_dim // 2
    low = math.floor(_correction_dim(config.yarn_beta_fast, config))
    high = math.ceil(_correction_dim(config.yarn_beta_slow, config))
    low, high = max(low, 0), min(high, config.rotary_dim - 1)
    if low == high:
        high += 0.001  # the reference implementation's guard against a zero-width ramp
    return np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0.0, 1.0)


def _correction_dim(turns: float, config: ModelConfig) -> float:
    """The (fractional) pair index whose wavelength fits `turns` times into rope_original_len."""
    length = config.rope_original_len
    return (
        config.rotary_dim
        * math.log(length / (turns * 2 * math.pi))
        / (2 * math.log(config.rope_theta))
    )


def attention_scale(config: ModelConfig) -> float:
    """The factor on queries and keys (each): 0.1 ln(rope_factor) + 1 for YaRN, else 1."""
    if config.rope_scaling != "yarn" or config.rope_factor <= 1.0:
        return 1.0
    return 0.1 * math.log(config.rope_factor) + 1.0


def rope_tables(seq_len: int, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin [seq_len, rotary_dim // 2] (float32) for positions 0..seq_len-1, scaled by
    config.rope_scaling (YaRN's temperature included: attention_scale times each)."""
    inverse = inverse_frequencies(config)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inverse[None, :]
    scale = attention_scale(config)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first 2 * cos.shape[-1] dims of x [batch, seq, heads, head_dim]; the rest pass."""
    half = cos.shape[-1]
    if half == 0:
        return x
    x32 = x.astype(jnp.float32)
    first, second, rest = x32[..., :half], x32[..., half : 2 * half], x32[..., 2 * half :]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = jnp.concatenate(
        [first * cos - second * sin, second * cos + first * sin, rest], axis=-1
    )
    return rotated.astype(x.dtype)
