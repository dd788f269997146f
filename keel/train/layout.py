"""Where a run's state and batches live: the mesh, a sharding for every leaf of the TrainState,
and the batch's sharding; and the run's initial state, made directly in that layout.

Parameters follow keel.model.partition; each optimizer-state leaf that mirrors a parameter
(moments, momenta) takes that parameter's sharding, in host memory ("pinned_host") when
`optimizer.offload_state` is on; the rest (step counts, router bias, step, RNG key) is
replicated. Everything a user can get wrong about the mesh is checked in `check_mesh` before
anything is compiled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from keel.core.errors import ConfigError
from keel.model.balance import initial_balance_state
from keel.model.config import ModelConfig
from keel.model.partition import param_shardings
from keel.model.sharding import BATCH_SPEC, build_mesh, replicated
from keel.model.transformer import init_params, init_router_bias, param_labels
from keel.train.checkpoint import TrainState
from keel.train.config import TrainConfig
from keel.train.gang_programs import compiled_in_step
from keel.train.optim import build_optimizer

HOST_MEMORY = "pinned_host"
DEVICES_ENV = "KEEL_DEVICES"
"""Set to N, a one-process run uses only this process's first N devices (a test suite pins one
device this way while simulating eight; a shared machine leaves the rest to others)."""


@dataclass(frozen=True)
class RunLayout:
    mesh: Mesh
    state: TrainState
    """A NamedSharding per leaf of the run's TrainState."""
    opt_on_device: Any
    """The optimizer state's shardings in device memory (what the update computes with)."""
    batch: NamedSharding
    """[batch, ...] arrays: rows split over the batch axes (data, fsdp, expert)."""

    @property
    def offloaded(self) -> bool:
        return any(s.memory_kind == HOST_MEMORY for s in jax.tree.leaves(self.state.opt_state))


def check_mesh(config: TrainConfig, devices: int) -> tuple[int, int, int]:
    """(data, fsdp, expert) for `devices` devices; ConfigError for a mesh that does not fit the
    devices, an expert axis that does not divide the experts, a batch that does not split, or a
    sequence axis that does not split every phase's seq_len into its zigzag chunks."""
    data, fsdp, expert, sequence = config.mesh.resolve(devices)
    experts = config.model.n_routed_experts
    if expert > 1 and (not experts or experts % expert):
        raise ConfigError(
            f"mesh.expert ({expert}) must divide model.n_routed_experts ({experts}): every device "
            "of the expert axis holds an equal share of the experts"
        )
    if sequence > 1 and experts:
        raise ConfigError(
            f"mesh.sequence ({sequence}) splits only dense models' sequences for now; set "
            "mesh.sequence=1 for a model with routed experts"
        )
    rows = data * fsdp * expert
    for phase in config.phases:
        batch = phase.sequences_per_step(config.batch_size)
        if batch % rows:
            given = (
                f"phase {phase.name!r}'s batch_tokens // seq_len ({batch})"
                if phase.batch_tokens
                else f"batch_size ({batch})"
            )
            raise ConfigError(
                f"{given} must be a multiple of mesh data x fsdp x expert = {data} x {fsdp} x "
                f"{expert} = {rows}: each device takes an equal share of the sequences"
            )
        if phase.seq_len % (2 * sequence):
            raise ConfigError(
                f"phase {phase.name!r}'s seq_len ({phase.seq_len}) must be a multiple of 2 x "
                f"mesh.sequence = {2 * sequence}: ring attention gives each of the {sequence} "
                "devices two equal chunks of every sequence"
            )
    return data, fsdp, expert


def run_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """`devices`, or by default every device of every process (the first $KEEL_DEVICES of this
    process's when that is set)."""
    if devices is not None:
        return list(devices)
    limit = os.environ.get(DEVICES_ENV, "")
    if not limit:
        return jax.devices()
    if jax.process_count() > 1:
        raise ConfigError(f"{DEVICES_ENV} limits a one-process run; unset it for a gang")
    if not limit.isdigit() or not 1 <= int(limit) <= jax.local_device_count():
        raise ConfigError(
            f"{DEVICES_ENV}={limit!r}: expected a device count from 1 to the "
            f"{jax.local_device_count()} visible"
        )
    return jax.local_devices()[: int(limit)]


def plan_layout(
    config: TrainConfig,
    optimizer: optax.GradientTransformation,
    devices: Sequence[jax.Device] | None = None,
    params: Any | None = None,
) -> RunLayout:
    """The layout of this run on `devices` (default: `run_devices()`); `params` is the model's
    parameter shapes (jax.ShapeDtypeStruct leaves) when the caller has already traced them."""
    devices = run_devices(devices)
    check_mesh(config, len(devices))
    mesh = build_mesh(config.mesh, devices)
    if params is None:
        params = param_shapes(config)
    params_layout = param_shardings(params, mesh)
    opt_device = _opt_shardings(optimizer, params, params_layout, mesh)
    opt_kept = opt_device
    if config.optimizer.offload_state:
        in_host = param_shardings(params, mesh, HOST_MEMORY)
        opt_kept = _opt_shardings(optimizer, params, in_host, mesh)
    whole = replicated(mesh)
    state = TrainState(
        params=params_layout,
        opt_state=opt_kept,
        router_bias=None if init_router_bias(config.model) is None else whole,
        step=whole,
        rng=whole,
        balance_state=jax.tree.map(lambda _: whole, fresh_balance_state(config.model)),
    )
    return RunLayout(mesh, state, opt_device, NamedSharding(mesh, BATCH_SPEC))


def fresh_balance_state(model: ModelConfig) -> Any:
    """TrainState.balance_state of a fresh run (None unless the balancing rule keeps state)."""
    return initial_balance_state(model.router, model.n_moe_layers, model.n_routed_experts)


def param_shapes(config: TrainConfig) -> Any:
    """The model's parameters as jax.ShapeDtypeStruct leaves: traced, nothing allocated."""
    return jax.eval_shape(lambda: init_params(jax.random.key(0), config.model))


def _opt_shardings(
    optimizer: optax.GradientTransformation, params: Any, shardings: Any, mesh: Mesh
) -> Any:
    """Shardings of the optimizer state: every subtree shaped like the parameters (optax's
    moments; in a partitioned optimizer with MaskedNode holes) takes `shardings`, every other
    leaf (counts, scalars) is replicated."""
    treedef = jax.tree.structure(params)
    whole = replicated(mesh)

    def hole(node: Any) -> bool:
        return isinstance(node, optax.MaskedNode)

    def mirrors(node: Any) -> bool:
        return not hole(node) and jax.tree.structure(node, is_leaf=hole) == treedef

    def place(node: Any) -> Any:
        if not mirrors(node):
            return whole
        return jax.tree.map(
            lambda leaf, sharding: leaf if hole(leaf) else sharding, node, shardings, is_leaf=hole
        )

    return jax.tree.map(place, jax.eval_shape(optimizer.init, params), is_leaf=mirrors)


def initial_state(
    config: TrainConfig, learning_rate: Callable, devices: Sequence[jax.Device] | None = None
) -> tuple[TrainState, optax.GradientTransformation, RunLayout]:
    """The run's fresh state, made on its devices in its layout (no leaf is ever whole on one
    device), the optimizer, and the layout."""
    key = jax.random.key(config.seed)
    shapes = param_shapes(config)
    optimizer = build_optimizer(config.optimizer, learning_rate, param_labels(shapes))
    layout = plan_layout(config, optimizer, devices, shapes)
    init = jax.jit(partial(init_params, config=config.model), out_shardings=layout.state.params)
    params = compiled_in_step(init, "init")(key)  # a gang compiles it once (gang_programs)
    opt_state = jax.jit(optimizer.init, out_shardings=layout.state.opt_state)(params)
    whole = replicated(layout.mesh)
    bias = init_router_bias(config.model)
    state = TrainState(
        params=params,
        opt_state=opt_state,
        router_bias=None if bias is None else jax.device_put(bias, whole),
        step=jax.device_put(jnp.zeros((), jnp.int32), whole),
        rng=jax.device_put(jax.random.key_data(key), whole),
        balance_state=jax.device_put(fresh_balance_state(config.model), whole),
    )
    return state, optimizer, layout


def place_batch(layout: RunLayout, rows: Callable[[slice], np.ndarray], shape: tuple) -> jax.Array:
    """A global [batch, ...] array from `rows(slice) -> the rows' numpy values`; each process
    reads only the rows its own devices hold."""
    return jax.make_array_from_callback(shape, layout.batch, lambda index: rows(index[0]))


def shard_bytes(tree: Any) -> int:
    """Bytes of `tree`'s arrays held by one device (the largest, over this process's devices)."""
    per_device: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)
