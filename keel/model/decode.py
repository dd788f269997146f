"""The forward pass over a key/value cache: prefill a prompt, then one token per call.

`forward` (transformer.py) recomputes attention over the whole sequence; generation instead keeps
each layer's keys and values and feeds only the new tokens. `forward_cached` runs `n` new tokens
at positions start..start+n-1: it writes their keys and values into the cache and attends over
every cached position up to each query's own. A prefill is one call with the prompt at start 0;
decoding is one call per token with n = 1. The mathematics is `forward`'s (same norms, RoPE,
GQA, MoE dispatch without drops), so the logits match it up to float rounding.

Shapes: the cache of one stack of blocks holds k and v [layers, batch, max_len, n_kv_heads,
head_dim]; tokens [batch, n]; logits [batch, n, vocab] float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from keel.model.attention import AttentionParams, project_qkv
from keel.model.config import ModelConfig
from keel.model.layers import rms_norm, swiglu
from keel.model.moe import moe_forward
from keel.model.rope import apply_rope, rope_tables
from keel.model.transformer import (
    DenseBlockParams,
    ModelParams,
    MoeBlockParams,
    output_logits,
)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerCache:
    """Keys and values of one stack of blocks (the dense or the MoE stack)."""

    k: jax.Array
    """[layers, batch, max_len, n_kv_heads, head_dim]"""
    v: jax.Array
    """[layers, batch, max_len, n_kv_heads, head_dim]"""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    dense: LayerCache | None
    """The n_dense_blocks dense blocks' cache; None when there are none."""
    moe: LayerCache | None
    """The n_moe_layers MoE blocks' cache; None for a dense model."""

    @property
    def max_len(self) -> int:
        """Positions the cache holds (prompt and generated tokens together)."""
        stack = self.dense if self.dense is not None else self.moe
        return stack.k.shape[2]


def init_cache(
    config: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32
) -> KVCache:
    """An empty (zero) cache for `batch` sequences of up to `max_len` tokens."""

    def stack(layers: int) -> LayerCache | None:
        if not layers:
            return None
        shape = (layers, batch, max_len, config.n_kv_heads, config.head_dim)
        return LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    return KVCache(dense=stack(config.n_dense_blocks), moe=stack(config.n_moe_layers))


def _cached_attention(
    params: AttentionParams,
    x: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    start: jax.Array,
    config: ModelConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [batch, n, d_model] at positions start..start+n-1 -> (out [batch, n, d_model], the
    layer's k and v caches [batch, max_len, n_kv_heads, head_dim] with the new keys written)."""
    batch, n, _ = x.shape
    hd, max_len = config.head_dim, k_cache.shape[1]
    q, k, v = project_qkv(params, x, config)
    cos, sin = rope_tables(max_len, config)
    cos = jax.lax.dynamic_slice_in_dim(cos, start, n)
    sin = jax.lax.dynamic_slice_in_dim(sin, start, n)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
    query_positions = start + jnp.arange(n)
    visible = jnp.arange(max_len)[None, :] <= query_positions[:, None]  # [n, max_len]
    mask = jnp.broadcast_to(visible, (batch, 1, n, max_len))
    out = jax.nn.dot_product_attention(
        q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask=mask
    )
    return out.reshape(batch, n, config.n_heads * hd) @ params.wo, k_cache, v_cache


def forward_cached(
    params: ModelParams,
    tokens: jax.Array,
    config: ModelConfig,
    router_bias: jax.Array | None,
    cache: KVCache,
    start: jax.Array,
) -> tuple[jax.Array, KVCache]:
    """tokens [batch, n] at positions start..start+n-1 (start: [] int32, start + n <= max_len)
    -> (logits [batch, n, vocab] float32, the cache holding these tokens' keys and values too).
    Parameters compute in their own dtype (float32 as checkpoints hold them)."""
    batch, n = tokens.shape
    eps = config.norm_eps
    h = params.embed[tokens]

    def attend(
        h: jax.Array, block: DenseBlockParams | MoeBlockParams, k: jax.Array, v: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        out, k, v = _cached_attention(
            block.attn, rms_norm(h, block.attn_norm, eps), k, v, start, config
        )
        return h + out, k, v

    def dense_block(h: jax.Array, layer: tuple) -> tuple[jax.Array, LayerCache]:
        block, k, v = layer
        h, k, v = attend(h, block, k, v)
        return h + swiglu(block.mlp, rms_norm(h, block.mlp_norm, eps)), LayerCache(k, v)

    def moe_block(h: jax.Array, layer: tuple) -> tuple[jax.Array, LayerCache]:
        block, bias, k, v = layer
        h, k, v = attend(h, block, k, v)
        x = rms_norm(h, block.mlp_norm, eps).reshape(batch * n, config.d_model)
        y, _ = moe_forward(block.moe, x, bias, config, None)
        return h + y.reshape(batch, n, config.d_model), LayerCache(k, v)

    dense_cache = moe_cache = None
    if params.dense is not None:
        h, dense_cache = jax.lax.scan(dense_block, h, (params.dense, cache.dense.k, cache.dense.v))
    if params.moe is not None:
        h, moe_cache = jax.lax.scan(
            moe_block, h, (params.moe, router_bias, cache.moe.k, cache.moe.v)
        )
    return output_logits(params, h, config), KVCache(dense=dense_cache, moe=moe_cache)
