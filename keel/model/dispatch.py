"""Moving tokens to their experts and back: dropless on one device, fixed-capacity all-to-all
across the EXPERT_AXIS devices.

An assignment is one (token, k-slot) pair; there are tokens * top_k of them, taken in
(token, slot) order. `fn(experts, rows, group_sizes)` runs the experts on rows [m, d_in] sorted
by expert, group_sizes [experts] int32 rows per expert (rows past their sum are padding), and
returns [m, d_out]; every leaf of `experts` holds the experts along axis 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from keel.core.errors import ConfigError
from keel.model.router import Routing
from keel.model.sharding import EXPERT_AXIS

if TYPE_CHECKING:
    from keel.model.moe import ExpertParams

ExpertFn = Callable[["ExpertParams", jax.Array, jax.Array], jax.Array]


def _n_experts(experts: ExpertParams) -> int:
    return jax.tree.leaves(experts)[0].shape[0]


def _group_sizes(ids: jax.Array, n_groups: int) -> jax.Array:
    """[m] int ids in [0, n_groups], n_groups meaning "none" -> [n_groups] int32 counts."""
    return jnp.zeros((n_groups,), jnp.int32).at[ids].add(1, mode="drop")


def _combine(results: jax.Array, gates: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """results [tokens * k, d] in (token, slot) order, gates [tokens, k] -> [tokens, d]."""
    tokens, k = gates.shape
    per_slot = results.reshape(tokens, k, -1).astype(jnp.float32)
    return jnp.sum(per_slot * gates[..., None], axis=1).astype(dtype)


def dispatch_dropless(
    x: jax.Array, routing: Routing, experts: ExpertParams, fn: ExpertFn
) -> jax.Array:
    """One device, nothing dropped: x [tokens, d_in] -> [tokens, d_out] in x's dtype, the
    gate-weighted sum of each token's top_k expert outputs."""
    n_experts = _n_experts(experts)
    k = routing.experts.shape[1]
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]
    out_sorted = fn(experts, rows, _group_sizes(flat, n_experts))
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return _combine(out_sorted[inverse], routing.gates, x.dtype)


def exchange_capacities(
    tokens_per_device: int,
    top_k: int,
    n_devices: int,
    send_capacity: float,
    receive_capacity: float,
    waves: int = 1,
) -> tuple[int, int]:
    """(C_send, C_recv): rows each device may send to each destination, and received rows it
    computes. C_send = ceil(send_capacity * tokens * k / n) rounded up to a multiple of waves,
    C_recv = ceil(receive_capacity * tokens * k). Both are capped where a larger pool could
    never fill (tokens * k and n * C_send), which changes no drop."""
    assignments = tokens_per_device * top_k
    c_send = min(math.ceil(send_capacity * assignments / n_devices), assignments)
    c_send = max(1, math.ceil(c_send / waves)) * waves
    c_recv = min(math.ceil(receive_capacity * assignments), n_devices * c_send)
    return c_send, c_recv


def _exchange(buffer: jax.Array, axis_name: str, waves: int) -> jax.Array:
    """[n, C, ...] with row block i bound for device i -> [n, C, ...] with block s from device
    s; one all-to-all per wave over equal slices of C."""
    per_wave = buffer.shape[1] // waves
    parts = [
        jax.lax.all_to_all(
            buffer[:, w * per_wave : (w + 1) * per_wave], axis_name, 0, 0, tiled=False
        )
        for w in range(waves)
    ]
    return parts[0] if waves == 1 else jnp.concatenate(parts, axis=1)


def dispatch_expert_parallel(
    x: jax.Array,
    routing: Routing,
    experts: ExpertParams,
    fn: ExpertFn,
    *,
    send_capacity: float,
    receive_capacity: float,
    waves: int = 1,
    axis_name: str = EXPERT_AXIS,
) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map over `axis_name` (n devices): x [T_local, d_in] this device's tokens,
    routing with global expert ids, experts this device's E/n experts (device i holds experts
    i*E/n ... (i+1)*E/n - 1). Returns (y [T_local, d_out] in x's dtype, dropped [] float32, the
    assignments dropped over all devices).

    Send: per destination, the first C_send assignments in (token, slot) order go; the rest are
    dropped. Receive: the first C_recv valid rows in (source, slot) order are computed; the rest
    are dropped and reported back with the results. Dropped assignments contribute zero.
    """
    n = jax.lax.axis_size(axis_name)
    n_local = _n_experts(experts)
    tokens, k = routing.experts.shape
    assignments = tokens * k
    c_send, c_recv = exchange_capacities(tokens, k, n, send_capacity, receive_capacity, waves)
    pool = n * c_send

    # Send side: each assignment's place in its destination's pool.
    flat = routing.experts.reshape(-1)
    dest, local_id = flat // n_local, flat % n_local
    by_dest = jnp.argsort(dest, stable=True)
    counts = _group_sizes(dest, n)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(assignments, dtype=jnp.int32) - starts[dest[by_dest]]
    pos = jnp.zeros((assignments,), jnp.int32).at[by_dest].set(rank_sorted)
    sent = pos < c_send
    slot = jnp.where(sent, dest * c_send + pos, pool)
    source = (
        jnp.full((pool,), assignments, jnp.int32)
        .at[slot]
        .set(jnp.arange(assignments, dtype=jnp.int32), mode="drop")
    )
    occupied = source < assignments
    source = jnp.minimum(source, assignments - 1)
    send_rows = jnp.where(occupied[:, None], x[source // k], 0)
    send_ids = jnp.where(occupied, local_id[source], -1)

    recv_rows = _exchange(send_rows.reshape(n, c_send, -1), axis_name, waves).reshape(pool, -1)
    recv_ids = _exchange(send_ids.reshape(n, c_send), axis_name, waves).reshape(pool)

    # Receive side: keep the first c_recv valid rows, sorted by local expert.
    valid = recv_ids >= 0
    kept = valid & (jnp.cumsum(valid) <= c_recv)
    group = jnp.where(kept, recv_ids, n_local)
    order = jnp.argsort(group, stable=True)[:c_recv]
    out = fn(experts, recv_rows[order], _group_sizes(group, n_local))
    out = jnp.where(kept[order][:, None], out, 0)
    results = jnp.zeros((pool, out.shape[-1]), out.dtype).at[order].set(out)

    back = _exchange(results.reshape(n, c_send, -1), axis_name, waves).reshape(pool, -1)
    back_kept = _exchange(kept.astype(jnp.int32).reshape(n, c_send), axis_name, waves)

    # Combine: each assignment reads its slot's result if it was sent and computed.
    place = jnp.minimum(slot, pool - 1)
    delivered = sent & (back_kept.reshape(pool)[place] > 0)
    per_assignment = jnp.where(delivered[:, None], back[place], 0)
    dropped = jax.lax.psum(jnp.sum(~delivered).astype(jnp.float32), axis_name)
    return _combine(per_assignment, routing.gates, x.dtype), dropped


def check_expert_parallel(n_experts: int, tokens: int, n_expert: int, n_devices: int) -> None:
    """Raise ConfigError unless the experts split evenly over the `n_expert` devices of
    EXPERT_AXIS and the tokens over all `n_devices` devices of the mesh."""
    if n_experts % n_expert:
        raise ConfigError(
            f"model.n_routed_experts ({n_experts}) must be divisible by the {n_expert} devices "
            f"of mesh axis {EXPERT_AXIS!r}; change the expert count or mesh.expert"
        )
    if tokens % n_devices:
        raise ConfigError(
            f"the batch's {tokens} tokens must be divisible by the mesh's {n_devices} devices; "
            "change the batch size or sequence length"
        )
