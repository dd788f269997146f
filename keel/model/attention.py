"""Grouped-query causal self-attention with (partial) rotary embeddings and QK-norm.

Shapes: x [batch, seq, d_model]; queries [batch, seq, n_heads, head_dim]; keys and values
[batch, seq, n_kv_heads, head_dim], each key/value head shared by n_heads / n_kv_heads query
heads. RoPE rotates the first `rotary_dim` dimensions of every head (NeoX half-split layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from keel.model.attend import attend
from keel.model.config import ModelConfig
from keel.model.layers import normal, rms_norm
from keel.model.rope import apply_rope, rope_tables


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


def attention(
    params: AttentionParams,
    x: jax.Array,
    config: ModelConfig,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    mesh: Mesh | None = None,
) -> jax.Array:
    """Causal self-attention: x [batch, seq, d_model] -> [batch, seq, d_model]. With
    `segment_ids` [batch, seq], a position attends only to earlier positions of its own segment
    (document). `config.attention` picks the implementation (keel.model.attend). `positions`
    [seq] int: each token's position when the tokens are permuted (ring attention's zigzag
    order on a mesh with a sequence axis); default 0..seq-1."""
    batch, seq, _ = x.shape
    q, k, v = project_qkv(params, x, config)
    cos, sin = rope_tables(seq, config)
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = attend(q, k, v, segment_ids, config.attention, mesh)  # [batch, seq, n_heads, head_dim]
    return out.reshape(batch, seq, config.n_heads * config.head_dim) @ params.wo


def project_qkv(
    params: AttentionParams, x: jax.Array, config: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [batch, seq, d_model] -> q [batch, seq, n_heads, head_dim] and k, v [batch, seq,
    n_kv_heads, head_dim], q and k RMS-normed when config.qk_norm (before RoPE)."""
    batch, seq, _ = x.shape
    hd = config.head_dim
    q = (x @ params.wq).reshape(batch, seq, config.n_heads, hd)
    k = (x @ params.wk).reshape(batch, seq, config.n_kv_heads, hd)
    v = (x @ params.wv).reshape(batch, seq, config.n_kv_heads, hd)
    if config.qk_norm:
        q = rms_norm(q, params.q_norm, config.norm_eps)
        k = rms_norm(k, params.k_norm, config.norm_eps)
    return q, k, v
