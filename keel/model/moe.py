"""The Mixture-of-Experts block: route, dispatch to SwiGLU experts, combine, add shared experts.

Shapes: x [tokens, d_model]; E routed experts of hidden width f_e = expert_ffn_dim working at
d_e = latent_dim (when > 0) or d_model. With a mesh whose EXPERT_AXIS has n > 1 devices, the
tokens and the experts are split over it (expert parallel); otherwise one device runs dropless.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from keel.core.errors import ConfigError
from keel.model.balance import balance_rule
from keel.model.config import ModelConfig
from keel.model.dispatch import (
    Drops,
    check_expert_parallel,
    dispatch_dropless,
    dispatch_expert_parallel,
    dispatch_ragged,
)
from keel.model.grouped import GroupedSwiGLU, expert_swiglu_for
from keel.model.layers import MlpParams, init_mlp, normal, swiglu
from keel.model.router import RouterStats, Routing, route, routing_stats
from keel.model.sharding import BATCH_SPEC, DATA_AXIS, EXPERT_AXIS, FSDP_AXIS, MESH_AXES


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExpertParams:
    """E SwiGLU experts stacked along axis 0."""

    w_gate: jax.Array
    """[E, d_e, f_e]"""
    w_up: jax.Array
    """[E, d_e, f_e]"""
    w_down: jax.Array
    """[E, f_e, d_e]"""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MoeParams:
    router: jax.Array
    """[d_model, E]"""
    experts: ExpertParams
    shared: MlpParams | None
    """Shared experts as one SwiGLU of hidden n_shared_experts * expert_ffn_dim, or None."""
    latent_down: jax.Array | None
    """[d_model, latent_dim], or None when latent_dim == 0."""
    latent_up: jax.Array | None
    """[latent_dim, d_model], or None when latent_dim == 0."""


def init_moe(key: jax.Array, config: ModelConfig) -> MoeParams:
    """float32 parameters of one MoE block; output projections (w_down, latent_up) scaled by
    1/sqrt(2 * n_layers) like layers.init_mlp."""
    d, e, f, std = config.d_model, config.n_routed_experts, config.expert_ffn_dim, config.init_std
    d_e = config.latent_dim or d
    out_std = std / (2 * config.n_layers) ** 0.5
    k_router, k_gate, k_up, k_down, k_shared, k_ldown, k_lup = jax.random.split(key, 7)
    shared = None
    if config.n_shared_experts:
        hidden = config.n_shared_experts * f
        shared = init_mlp(k_shared, d, hidden, std, config.n_layers)
    latent_down = latent_up = None
    if config.latent_dim:
        latent_down = normal(k_ldown, (d, config.latent_dim), std)
        latent_up = normal(k_lup, (config.latent_dim, d), out_std)
    return MoeParams(
        router=normal(k_router, (d, e), std),
        experts=ExpertParams(
            w_gate=normal(k_gate, (e, d_e, f), std),
            w_up=normal(k_up, (e, d_e, f), std),
            w_down=normal(k_down, (e, f, d_e), out_std),
        ),
        shared=shared,
        latent_down=latent_down,
        latent_up=latent_up,
    )


def moe_param_specs(params: MoeParams) -> MoeParams:
    """The same tree of PartitionSpecs: routed experts split along E over EXPERT_AXIS, the rest
    replicated. Wrap each in NamedSharding(mesh, spec) to place parameters."""
    replicated = jax.tree.map(lambda _: P(), params)
    experts = jax.tree.map(lambda _: P(EXPERT_AXIS), params.experts)
    return MoeParams(
        router=replicated.router,
        experts=experts,
        shared=replicated.shared,
        latent_down=replicated.latent_down,
        latent_up=replicated.latent_up,
    )


def _dropless(
    x: jax.Array, routing: Routing, experts: ExpertParams, fn: GroupedSwiGLU
) -> tuple[jax.Array, None]:
    return dispatch_dropless(x, routing, experts, fn), None


def _expert_parallel_dispatch(config: ModelConfig, n: int) -> Callable:
    """The dispatch over n > 1 expert devices that config.dropless names: fixed pools at the
    configured capacities ("off"), pools no routing can overflow ("pools": C_send = tokens * k,
    C_recv = n * C_send), or ragged_all_to_all ("ragged"; refused on CPU by validate)."""
    if config.dropless == "ragged":
        return partial(dispatch_ragged, axis_name=EXPERT_AXIS)
    worst = config.dropless == "pools"
    return partial(
        dispatch_expert_parallel,
        send_capacity=None if worst else config.send_capacity,
        receive_capacity=None if worst else config.receive_capacity,
        waves=config.dispatch_waves,
        axis_name=EXPERT_AXIS,
    )


def _block(
    params: MoeParams,
    x: jax.Array,
    bias: jax.Array,
    config: ModelConfig,
    dispatch: Callable,
    sequence_tokens: int | None,
) -> tuple[jax.Array, Routing, Drops | None]:
    """Route, dispatch, combine and add shared experts on this device's tokens."""
    routing = route(x, params.router, bias, config.router, config.top_k, sequence_tokens)
    h = x if params.latent_down is None else x @ params.latent_down.astype(x.dtype)
    expert_fn = expert_swiglu_for(config.grouped_matmul)
    routed, dropped = dispatch(h, routing, params.experts, expert_fn)
    if params.latent_up is not None:
        routed = routed @ params.latent_up.astype(x.dtype)
    y = routed if params.shared is None else routed + swiglu(params.shared, x)
    return y.astype(x.dtype), routing, dropped


def moe_forward(
    params: MoeParams,
    x: jax.Array,
    bias: jax.Array,
    config: ModelConfig,
    mesh: Mesh | None,
    sequence_tokens: int | None = None,
) -> tuple[jax.Array, RouterStats]:
    """x [tokens, d_model] -> (y [tokens, d_model] in x's dtype, RouterStats over all tokens).

    Without a mesh (or on a one-device mesh) nothing is dropped. On a bigger mesh the tokens are
    split over every axis (sharding.BATCH_SPEC; y keeps that sharding) and each device routes its
    own; with one device on EXPERT_AXIS each then runs dropless, otherwise the experts are split
    along E over EXPERT_AXIS and reached by all-to-all inside each expert group (config.dropless,
    dispatch_waves), and capacity drops are counted in stats.dropped (stats.dropped_recv: those
    the receivers dropped). Parameters enter replicated but for the experts (XLA gathers
    fsdp-sharded ones). stats.bias_target is the balancing rule's statistic, reduced over
    devices by the rule. `sequence_tokens`: the rows of x are sequences of that many tokens
    (None: one sequence), for the sequence-wise balance loss (each device takes its own rows'
    sequences; with a sequence axis, its part of each sequence), averaged over devices.
    """
    n_experts = params.router.shape[-1]
    if mesh is None or mesh.size == 1:
        y, routing, _ = _block(params, x, bias, config, _dropless, sequence_tokens)
        return y, routing_stats(routing, n_experts)
    missing = [axis for axis in MESH_AXES if axis not in mesh.shape]
    if missing:
        raise ConfigError(
            f"the mesh has axes {tuple(mesh.shape)} but not {missing}; build it with "
            "keel.model.sharding.build_mesh"
        )
    n = mesh.shape[EXPERT_AXIS]
    check_expert_parallel(n_experts, x.shape[0], n, mesh.size)
    dispatch = _expert_parallel_dispatch(config, n) if n > 1 else _dropless
    rule = balance_rule(config.router.balance)

    def local(params: MoeParams, x: jax.Array, bias: jax.Array) -> tuple[jax.Array, RouterStats]:
        y, routing, drops = _block(params, x, bias, config, dispatch, sequence_tokens)
        own = routing_stats(routing, n_experts)
        dropped, dropped_recv = jnp.zeros((), jnp.float32), None
        if drops is not None:  # already summed over the expert group
            dropped_recv = jax.lax.psum(drops.receive, (DATA_AXIS, FSDP_AXIS))
            dropped = jax.lax.psum(drops.send, (DATA_AXIS, FSDP_AXIS)) + dropped_recv
        stats = RouterStats(
            load=jax.lax.psum(own.load, MESH_AXES),
            dropped=dropped,
            assignments=jax.lax.psum(own.assignments, MESH_AXES),
            z_loss=jax.lax.pmean(own.z_loss, MESH_AXES),
            bias_target=rule.reduce(own.bias_target, MESH_AXES),
            dropped_recv=dropped_recv,
            seq_balance=jax.lax.pmean(own.seq_balance, MESH_AXES),
        )
        return y, stats

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(moe_param_specs(params), BATCH_SPEC, P()),
        out_specs=(BATCH_SPEC, P()),
    )(params, x, bias)
