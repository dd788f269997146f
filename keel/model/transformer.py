"""The decoder-only transformer: parameters, initialisation, and the forward pass.

Blocks of one kind are stacked along a leading layer axis and run with `jax.lax.scan`, so a model
compiles one dense block and one MoE block whatever its depth:

    tokens [batch, seq] -> embed -> dense blocks x n_dense_layers -> MoE blocks x n_moe_layers
        -> RMSNorm -> logits [batch, seq, vocab] (float32)

A block is pre-norm: h += attention(norm(h)); h += mlp_or_moe(norm(h)). Parameters are float32
(the master copy); `compute_dtype` casts them for the forward pass (bfloat16 on accelerators).
The router bias [n_moe_layers, experts] is state, not a parameter: no gradient reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from keel.model.attention import AttentionParams, attention, init_attention
from keel.model.config import ModelConfig
from keel.model.layers import MlpParams, init_mlp, normal, rms_norm, swiglu
from keel.model.moe import MoeParams, init_moe, moe_forward
from keel.model.router import RouterStats
from keel.model.sharding import ACTIVATION_SPEC, SEQUENCE_AXIS, axis_size


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DenseBlockParams:
    attn_norm: jax.Array
    """[d_model] (stacked: [layers, d_model], likewise below)"""
    attn: AttentionParams
    mlp_norm: jax.Array
    mlp: MlpParams


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MoeBlockParams:
    attn_norm: jax.Array
    attn: AttentionParams
    mlp_norm: jax.Array
    moe: MoeParams


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ModelParams:
    embed: jax.Array
    """[vocab, d_model]"""
    dense: DenseBlockParams | None
    """The first n_dense_blocks blocks, stacked; None when there are none."""
    moe: MoeBlockParams | None
    """The n_moe_layers MoE blocks, stacked; None for a dense model."""
    final_norm: jax.Array
    """[d_model]"""
    unembed: jax.Array | None
    """[d_model, vocab]; None with tied embeddings (logits = h @ embed.T)."""


def init_params(key: jax.Array, config: ModelConfig) -> ModelParams:
    """Fresh float32 parameters, a pure function of (key, config)."""
    config.validate()
    k_embed, k_dense, k_moe, k_out = jax.random.split(key, 4)
    d = config.d_model
    ones = jnp.ones((d,), jnp.float32)

    def dense_block(k: jax.Array) -> DenseBlockParams:
        k_attn, k_mlp = jax.random.split(k)
        mlp = init_mlp(k_mlp, d, config.ffn_dim, config.init_std, config.n_layers)
        return DenseBlockParams(ones, init_attention(k_attn, config), ones, mlp)

    def moe_block(k: jax.Array) -> MoeBlockParams:
        k_attn, k_moe_layer = jax.random.split(k)
        return MoeBlockParams(
            ones, init_attention(k_attn, config), ones, init_moe(k_moe_layer, config)
        )

    dense = None
    if config.n_dense_blocks:
        dense = jax.vmap(dense_block)(jax.random.split(k_dense, config.n_dense_blocks))
    moe = None
    if config.n_moe_layers:
        moe = jax.vmap(moe_block)(jax.random.split(k_moe, config.n_moe_layers))
    return ModelParams(
        embed=normal(k_embed, (config.vocab_size, d), config.init_std),
        dense=dense,
        moe=moe,
        final_norm=ones,
        unembed=None
        if config.tied_embeddings
        else normal(k_out, (d, config.vocab_size), config.init_std),
    )


def init_router_bias(config: ModelConfig) -> jax.Array | None:
    """Zero router bias [n_moe_layers, n_routed_experts]; None for a dense model (no array of
    size zero, which checkpoints cannot hold)."""
    if not config.is_moe:
        return None
    return jnp.zeros((config.n_moe_layers, config.n_routed_experts), jnp.float32)


def forward(
    params: ModelParams,
    tokens: jax.Array,
    config: ModelConfig,
    router_bias: jax.Array | None,
    *,
    mesh: Mesh | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    compute_dtype: jnp.dtype = jnp.float32,
    remat: bool = False,
) -> tuple[jax.Array, RouterStats | None]:
    """tokens [batch, seq] int -> (logits [batch, seq, vocab] float32, router stats stacked over
    MoE layers, or None for a dense model). `mesh` turns on expert parallelism (see moe.py) and,
    with a sequence axis, ring attention: then the tokens come in keel.model.ring.zigzag_order
    and `positions` [seq] says each one's position (the logits keep that order)."""
    batch, seq = tokens.shape
    if positions is None and axis_size(mesh, SEQUENCE_AXIS) > 1:
        raise ValueError(
            "a mesh with a sequence axis needs the tokens in keel.model.ring.zigzag_order and "
            "their positions (as keel.train.step lays them out)"
        )
    params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    eps = config.norm_eps
    h = _batch_split(params.embed[tokens], mesh)

    def attend(h: jax.Array, block: DenseBlockParams | MoeBlockParams) -> jax.Array:
        x = rms_norm(h, block.attn_norm, eps)
        return h + attention(block.attn, x, config, segment_ids, positions, mesh)

    def dense_block(h: jax.Array, block: DenseBlockParams) -> tuple[jax.Array, None]:
        h = attend(h, block)
        return _batch_split(h + swiglu(block.mlp, rms_norm(h, block.mlp_norm, eps)), mesh), None

    def moe_block(
        h: jax.Array, layer: tuple[MoeBlockParams, jax.Array]
    ) -> tuple[jax.Array, RouterStats]:
        block, bias = layer
        h = attend(h, block)
        x = rms_norm(h, block.mlp_norm, eps).reshape(batch * seq, config.d_model)
        y, stats = moe_forward(block.moe, x, bias, config, mesh, seq)
        return _batch_split(h + y.reshape(batch, seq, config.d_model), mesh), stats

    if remat:
        dense_block, moe_block = jax.checkpoint(dense_block), jax.checkpoint(moe_block)
    if params.dense is not None:
        h, _ = jax.lax.scan(dense_block, h, params.dense)
    stats = None
    if params.moe is not None:
        h, stats = jax.lax.scan(moe_block, h, (params.moe, router_bias))
    return _batch_split(output_logits(params, h, config), mesh), stats


def output_logits(params: ModelParams, h: jax.Array, config: ModelConfig) -> jax.Array:
    """The last hidden states h [batch, seq, d_model] -> logits [batch, seq, vocab] float32:
    the final norm, then the unembedding (the embedding's transpose when tied)."""
    h = rms_norm(h, params.final_norm, config.norm_eps)
    unembed = params.embed.T if params.unembed is None else params.unembed
    return jnp.einsum("bsd,dv->bsv", h, unembed, preferred_element_type=jnp.float32)


def _batch_split(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Activations stay split by batch row over the batch axes and by token over the sequence
    axis: XLA gathers the (fsdp-sharded) weights to them rather than moving activations to the
    weights' layout."""
    if mesh is None or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, ACTIVATION_SPEC))


def param_labels(params: ModelParams) -> ModelParams:
    """The optimizer's label per leaf: "matrix" for attention, MLP and expert weights (Muon
    applies), "embedding" for the embeddings, the output projection and the router (AdamW with
    weight decay), "vector" for norm scales (AdamW, no decay)."""

    def label(path: tuple, leaf: jax.Array) -> str:
        names = {getattr(entry, "name", None) for entry in path}
        if names & {"embed", "unembed", "router"}:
            return "embedding"
        return "vector" if path[-1].name.endswith("norm") else "matrix"

    return jax.tree_util.tree_map_with_path(label, params)
