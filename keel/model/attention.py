"""Grouped-query causal self-attention with (partial) rotary embeddings and QK-norm.

Shapes: x [batch, seq, d_model]; queries [batch, seq, n_heads, head_dim]; keys and values
[batch, seq, n_kv_heads, head_dim], each key/value head shared by n_heads / n_kv_heads query
heads. RoPE rotates the first `rotary_dim` dimensions of every head (NeoX half-split layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from keel.model.attend import attend
from keel.model.config import ModelConfig
from keel.model.layers import normal, rms_norm


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionParams:
    wq: jax.Array
    """[d_model, n_heads * head_dim]"""
    wk: jax.Array
    """[d_model, n_kv_heads * head_dim]"""
    wv: jax.Array
    """[d_model, n_kv_heads * head_dim]"""
    wo: jax.Array
    """[n_heads * head_dim, d_model]"""
    q_norm: jax.Array
    """[head_dim] QK-norm scale (ones, unused when config.qk_norm is off)"""
    k_norm: jax.Array
    """[head_dim]"""


def init_attention(key: jax.Array, config: ModelConfig) -> AttentionParams:
    k_q, k_k, k_v, k_o = jax.random.split(key, 4)
    d, hd, std = config.d_model, config.head_dim, config.init_std
    return AttentionParams(
        wq=normal(k_q, (d, config.n_heads * hd), std),
        wk=normal(k_k, (d, config.n_kv_heads * hd), std),
        wv=normal(k_v, (d, config.n_kv_heads * hd), std),
        wo=normal(k_o, (config.n_heads * hd, d), std / (2 * config.n_layers) ** 0.5),
        q_norm=jnp.ones((hd,), jnp.float32),
        k_norm=jnp.ones((hd,), jnp.float32),
    )


def rope_tables(seq_len: int, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin [seq_len, rotary_dim // 2] (float32) for positions 0..seq_len-1."""
    half = config.rotary_dim // 2
    inverse = config.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / max(half, 1))
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inverse[None, :]
    return jnp.cos(angles), jnp.sin(angles)


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


def attention(
    params: AttentionParams,
    x: jax.Array,
    config: ModelConfig,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal self-attention: x [batch, seq, d_model] -> [batch, seq, d_model]. With
    `segment_ids` [batch, seq], a position attends only to earlier positions of its own segment
    (document). `config.attention` picks the implementation (keel.model.attend)."""
    batch, seq, _ = x.shape
    hd = config.head_dim
    q = (x @ params.wq).reshape(batch, seq, config.n_heads, hd)
    k = (x @ params.wk).reshape(batch, seq, config.n_kv_heads, hd)
    v = (x @ params.wv).reshape(batch, seq, config.n_kv_heads, hd)
    if config.qk_norm:
        q = rms_norm(q, params.q_norm, config.norm_eps)
        k = rms_norm(k, params.k_norm, config.norm_eps)
    cos, sin = rope_tables(seq, config)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = attend(q, k, v, segment_ids, config.attention)  # [batch, seq, n_heads, head_dim]
    return out.reshape(batch, seq, config.n_heads * hd) @ params.wo
