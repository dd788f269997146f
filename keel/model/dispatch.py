"""Moving tokens to their experts and back: dropless on one device, fixed-capacity all-to-all
in waves across the EXPERT_AXIS devices, or ragged all-to-all (dropless, GPU/TPU).

An assignment is one (token, k-slot) pair; there are tokens * top_k of them, taken in
(token, slot) order. `fn` is a grouped.GroupedSwiGLU: the exchanges run `fn.sorted(experts,
rows, group_sizes)` on rows [m, d_in] sorted by expert, group_sizes [experts] int32 rows per
expert (rows past their sum are padding) -> [m, d_out]; one device runs `fn.routed(experts, x,
expert_ids)` straight from the tokens. Every leaf of `experts` holds the experts along axis 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from keel.core.errors import ConfigError
from keel.model.grouped import GroupedSwiGLU, count_groups, expert_count
from keel.model.router import Routing
from keel.model.sharding import EXPERT_AXIS

if TYPE_CHECKING:
    from keel.model.moe import ExpertParams


def _combine(results: jax.Array, gates: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """results [tokens * k, d] in (token, slot) order (or [tokens, k, d]), gates [tokens, k] ->
    [tokens, d]."""
    tokens, k = gates.shape
    per_slot = results.reshape(tokens, k, -1).astype(jnp.float32)
    return jnp.sum(per_slot * gates[..., None], axis=1).astype(dtype)


def dispatch_dropless(
    x: jax.Array, routing: Routing, experts: ExpertParams, fn: GroupedSwiGLU
) -> jax.Array:
    """One device, nothing dropped: x [tokens, d_in] -> [tokens, d_out] in x's dtype, the
    gate-weighted sum of each token's top_k expert outputs (fn.routed: with grouped.BLOCKS the
    tokens go straight into their experts' blocks, no sort)."""
    return _combine(fn.routed(experts, x, routing.experts), routing.gates, x.dtype)


def exchange_capacities(
    tokens_per_device: int,
    top_k: int,
    n_devices: int,
    send_capacity: float | None,
    receive_capacity: float | None,
    waves: int = 1,
) -> tuple[int, int]:
    """(C_send, C_recv): rows each device may send to each destination, and received rows it
    computes over all waves. C_send = ceil(send_capacity * tokens * k / n) rounded up to a
    multiple of waves, C_recv = ceil(receive_capacity * tokens * k). Both are capped where a
    larger pool could never fill (tokens * k and n * C_send), which changes no drop. Each wave
    sends C_send / waves rows per destination and computes at most ceil(C_recv / waves). A
    capacity of None is no limit: the pools of the worst case (C_send = tokens * k rounded up,
    C_recv = n * C_send), which drop nothing."""
    assignments = tokens_per_device * top_k
    c_send = assignments
    if send_capacity is not None:
        c_send = min(math.ceil(send_capacity * assignments / n_devices), assignments)
    c_send = max(1, math.ceil(c_send / waves)) * waves
    c_recv = n_devices * c_send
    if receive_capacity is not None:
        c_recv = min(math.ceil(receive_capacity * assignments), c_recv)
    return c_send, c_recv


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Drops:
    """Assignments the expert-parallel exchange dropped, summed over the expert group."""

    send: jax.Array
    """[] float32: past their destination's C_send slots on the sending device."""
    receive: jax.Array
    """[] float32: sent, but past the receiver's per-wave C_recv / waves rows."""


def _send_slots(dest: jax.Array, n: int, c_send: int) -> tuple[jax.Array, jax.Array]:
    """dest [A] destination device per assignment -> (slot [A] int32 in [0, n * c_send], the
    assignment's row in the send pool or n * c_send when dropped; source [n * c_send] int32,
    the assignment in each slot or A when empty). Per destination the first c_send assignments
    in (token, slot) order are sent."""
    assignments = dest.shape[0]
    pool = n * c_send
    by_dest = jnp.argsort(dest, stable=True)
    counts = count_groups(dest, n)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(assignments, dtype=jnp.int32) - starts[dest[by_dest]]
    pos = jnp.zeros((assignments,), jnp.int32).at[by_dest].set(rank_sorted)
    slot = jnp.where(pos < c_send, dest * c_send + pos, pool)
    source = (
        jnp.full((pool,), assignments, jnp.int32)
        .at[slot]
        .set(jnp.arange(assignments, dtype=jnp.int32), mode="drop")
    )
    return slot, source


def dispatch_expert_parallel(
    x: jax.Array,
    routing: Routing,
    experts: ExpertParams,
    fn: GroupedSwiGLU,
    *,
    send_capacity: float | None,
    receive_capacity: float | None,
    waves: int = 1,
    axis_name: str = EXPERT_AXIS,
) -> tuple[jax.Array, Drops]:
    """Inside shard_map over `axis_name` (n devices): x [T_local, d_in] this device's tokens,
    routing with global expert ids, experts this device's E/n experts (device i holds experts
    i*E/n ... (i+1)*E/n - 1). Returns (y [T_local, d_out] in x's dtype, Drops over all devices).

    Send: per destination, the first C_send assignments in (token, slot) order go; the rest are
    dropped. The pools travel in `waves` equal slices of C_send / waves rows per destination,
    one after another (a `jax.lax.scan`): each wave's rows are exchanged, the receiver runs its
    experts on the first ceil(C_recv / waves) valid rows of that wave in (source, slot) order
    (the rest are receive drops), and the results go back and are added into y before the next
    wave starts, so only one wave's received rows are alive at a time. With waves > 1 each wave
    is rematerialised in the backward pass (jax.checkpoint): its exchange and experts run again
    there rather than every wave's activations being kept, which is what makes the saving hold
    for training too. Dropped assignments contribute zero.
    """
    n = jax.lax.axis_size(axis_name)
    n_local = expert_count(experts)
    tokens, k = routing.experts.shape
    assignments = tokens * k
    c_send, c_recv = exchange_capacities(tokens, k, n, send_capacity, receive_capacity, waves)
    per_wave = c_send // waves
    recv_per_wave = -(-c_recv // waves)
    flat = routing.experts.reshape(-1)
    slot, source = _send_slots(flat // n_local, n, c_send)
    local_id = flat % n_local
    gates = routing.gates.reshape(-1)
    # [waves, n, per_wave]: wave w carries slots w * per_wave ... of every destination's pool.
    wave_sources = source.reshape(n, waves, per_wave).transpose(1, 0, 2)

    def wave(y: jax.Array, sources: jax.Array) -> tuple[jax.Array, jax.Array]:
        occupied = sources < assignments
        safe = jnp.minimum(sources, assignments - 1)
        rows = jnp.where(occupied[..., None], x[safe // k], 0)
        ids = jnp.where(occupied, local_id[safe], -1)
        recv_rows = jax.lax.all_to_all(rows, axis_name, 0, 0).reshape(n * per_wave, -1)
        recv_ids = jax.lax.all_to_all(ids, axis_name, 0, 0).reshape(n * per_wave)

        valid = recv_ids >= 0
        kept = valid & (jnp.cumsum(valid) <= recv_per_wave)
        group = jnp.where(kept, recv_ids, n_local)
        order = jnp.argsort(group, stable=True)[:recv_per_wave]
        out = fn.sorted(experts, recv_rows[order], count_groups(group, n_local))
        out = jnp.where(kept[order][:, None], out, 0)
        results = jnp.zeros((n * per_wave, out.shape[-1]), out.dtype).at[order].set(out)

        back = jax.lax.all_to_all(results.reshape(n, per_wave, -1), axis_name, 0, 0)
        back_kept = jax.lax.all_to_all(kept.reshape(n, per_wave), axis_name, 0, 0)
        delivered = occupied & back_kept
        weighted = back.astype(jnp.float32) * jnp.where(delivered, gates[safe], 0.0)[..., None]
        y = y.at[jnp.where(delivered, safe // k, tokens)].add(weighted, mode="drop")
        return y, jnp.sum(occupied & ~back_kept)

    d_out = jax.eval_shape(
        lambda: fn.sorted(
            experts, jnp.zeros((1, x.shape[-1]), x.dtype), jnp.zeros((n_local,), jnp.int32)
        )
    ).shape[-1]
    # zeros_like: the carry varies over the mesh axes x varies over (shard_map's type check).
    y0 = jnp.zeros_like(x, jnp.float32, shape=(tokens, d_out))
    if waves == 1:
        y, recv_dropped = wave(y0, wave_sources[0])
    else:
        y, recv_dropped = jax.lax.scan(jax.checkpoint(wave), y0, wave_sources)
    send_dropped = jnp.sum(slot == n * c_send)
    drops = Drops(
        send=jax.lax.psum(send_dropped.astype(jnp.float32), axis_name),
        receive=jax.lax.psum(jnp.sum(recv_dropped).astype(jnp.float32), axis_name),
    )
    return y.astype(x.dtype), drops


def dispatch_ragged(
    x: jax.Array,
    routing: Routing,
    experts: ExpertParams,
    fn: GroupedSwiGLU,
    *,
    axis_name: str = EXPERT_AXIS,
) -> tuple[jax.Array, Drops]:
    """Dropless expert parallel with `jax.lax.ragged_all_to_all` (GPU and TPU; XLA:CPU does not
    implement it): exactly the routed rows travel, sorted by destination, into a receive buffer
    of the worst case's n * T_local * k rows. Same contract as dispatch_expert_parallel; the
    Drops are zeros."""
    n = jax.lax.axis_size(axis_name)
    n_local = expert_count(experts)
    tokens, k = routing.experts.shape
    assignments = tokens * k
    flat = routing.experts.reshape(-1)
    dest = flat // n_local
    by_dest = jnp.argsort(dest, stable=True)
    send_sizes = count_groups(dest, n)
    send_offsets = jnp.cumsum(send_sizes) - send_sizes
    recv_sizes = jax.lax.all_to_all(send_sizes, axis_name, 0, 0, tiled=True)
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    # Where this device's slice lands on each receiver, and where each source wants its results.
    remote_recv_offsets = jax.lax.all_to_all(recv_offsets, axis_name, 0, 0, tiled=True)
    remote_send_offsets = jax.lax.all_to_all(send_offsets, axis_name, 0, 0, tiled=True)

    def there(operand: jax.Array, output: jax.Array) -> jax.Array:
        return jax.lax.ragged_all_to_all(
            operand, output, send_offsets, send_sizes, remote_recv_offsets, recv_sizes,
            axis_name=axis_name,
        )  # fmt: skip

    worst = n * assignments
    recv_rows = there(x[by_dest // k], jnp.zeros((worst, x.shape[-1]), x.dtype))
    recv_ids = there((flat % n_local)[by_dest], jnp.full((worst,), n_local, flat.dtype))
    order = jnp.argsort(recv_ids, stable=True)
    out = fn.sorted(experts, recv_rows[order], count_groups(recv_ids, n_local))
    results = jnp.zeros_like(out).at[order].set(out)
    back = jax.lax.ragged_all_to_all(
        results, jnp.zeros((assignments, out.shape[-1]), out.dtype),
        recv_offsets, recv_sizes, remote_send_offsets, send_sizes, axis_name=axis_name,
    )  # fmt: skip
    per_assignment = jnp.zeros_like(back).at[by_dest].set(back)
    none = jnp.zeros((), jnp.float32)
    return _combine(per_assignment, routing.gates, x.dtype), Drops(send=none, receive=none)


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
