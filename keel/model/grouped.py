"""Grouped matrix products for the routed experts: rows sorted by expert, each group multiplied by
its own expert's weights.

Two implementations (GroupedSwiGLU: RAGGED and BLOCKS), each in the two forms the dispatch needs:
`sorted(experts, rows [m, d_e], group_sizes [E]) -> [m, d_e]` over rows already sorted by expert
(rows past sum(group_sizes) give zeros; the expert-parallel exchange delivers rows so), and
`routed(experts, x [tokens, d_e], expert_ids [tokens, k]) -> [tokens, k, d_e]` straight from the
tokens (one device). RAGGED's routed form sorts the assignments, runs `sorted` and unsorts;
BLOCKS' puts the tokens straight into their experts' blocks (no sort at all):
- "ragged": `jax.lax.ragged_dot`, a native grouped GEMM on GPUs and TPUs. XLA:CPU lowers it
  densely over the groups: measured on this project's 2-core CPU, [4096, 128] x 8 experts of
  [128, 128] took 15.7 ms forward (a dense [4096, 128] x [128, 128] product: 1.3 ms) and 90 ms
  for the gradient, which made it most of a tiny MoE's step time.
- "blocks": each group padded to a multiple of `block` rows, then one batched einsum over blocks
  with each block's expert weights gathered ([blocks, d_e, f] per matrix). The block grows with
  the rows (`block_rows`: about m / (8 E), at least 64), so padding stays under E x block ~ m / 8
  rows and the gathered weights under ~9x one layer's expert weights, whatever the model size.
  Rows enter the blocks and leave them through `gather_rows`, whose gradient is a gather as
  well (the layout knows each map's inverse), not a scatter-add.
"auto" picks "ragged" on TPU, where ragged_dot is a native grouped GEMM, and "blocks" on CPU
and GPU: jaxlib 0.10's GPU lowering of ragged_dot also multiplies every row by every expert
unless XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true (benchmarks/train_bench.py
compares both on a GPU: `--presets 1b-moe@ragged`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

MIN_BLOCK_ROWS = 64
BLOCKS_PER_EXPERT = 8
"""Target blocks per expert: fewer means more padding, more means more weights gathered."""


def block_rows(rows: int, n_groups: int) -> int:
    """Rows per block for `rows` rows over `n_groups` experts: a power of two near
    rows / (BLOCKS_PER_EXPERT x n_groups), at least MIN_BLOCK_ROWS."""
    target = max(rows // (BLOCKS_PER_EXPERT * max(n_groups, 1)), 1)
    return max(MIN_BLOCK_ROWS, 1 << (target.bit_length() - 1))


@dataclass(frozen=True)
class BlockLayout:
    """m rows placed in expert-aligned blocks of `block` rows (padded_rows in all)."""

    slot: jax.Array
    """[m] int32 each row's padded row; padded_rows for a row in no group."""
    source: jax.Array
    """[padded_rows] int32 the row in each padded row; m for padding."""
    block_group: jax.Array
    """[padded_rows / block] int32 each block's expert."""
    block: int


def ragged_swiglu(experts, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """SwiGLU experts with `jax.lax.ragged_dot`: rows [m, d_e] sorted by expert -> [m, d_e]."""
    gate = jax.lax.ragged_dot(rows, experts.w_gate, group_sizes)
    up = jax.lax.ragged_dot(rows, experts.w_up, group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, experts.w_down, group_sizes)


def expert_count(experts) -> int:
    """Experts in `experts` (every leaf holds them along axis 0)."""
    return jax.tree.leaves(experts)[0].shape[0]


def count_groups(ids: jax.Array, n_groups: int) -> jax.Array:
    """[m] int ids in [0, n_groups], n_groups meaning "none" -> [n_groups] int32 counts."""
    return jnp.zeros((n_groups,), jnp.int32).at[ids].add(1, mode="drop")


def block_layout(
    ids: jax.Array, n_groups: int, block: int, group_sizes: jax.Array | None = None
) -> BlockLayout:
    """Where rows go in expert-aligned blocks: ids [m] int group of each row in [0, n_groups]
    (n_groups: in no group). Each group's rows keep their order and fill a run of whole blocks;
    the groups' runs follow one another by group.

    Rows in any order: ranks within groups come from a running count of one-hot ids
    ([m, n_groups] int32, 4 MiB for 131,072 rows over 8 groups), no sort: the layout needs no
    rows in expert order. Rows sorted by group: pass group_sizes [n_groups] int32, and each
    rank is the row's distance from its group's first row (no count)."""
    m = ids.shape[0]
    padded_rows = -(-(m + n_groups * (block - 1)) // block) * block
    if group_sizes is None:
        one_hot = jax.nn.one_hot(ids, n_groups, dtype=jnp.int32)  # a zero row for "no group"
        rank = jnp.sum(jnp.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1
        group_sizes = jnp.sum(one_hot, axis=0)
    else:
        starts = jnp.cumsum(group_sizes) - group_sizes
        rank = jnp.arange(m, dtype=jnp.int32) - starts[jnp.minimum(ids, n_groups - 1)]
    padded_sizes = -(-group_sizes // block) * block
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes
    valid = ids < n_groups
    slot = jnp.where(valid, padded_starts[jnp.minimum(ids, n_groups - 1)] + rank, padded_rows)
    source = (
        jnp.full((padded_rows,), m, jnp.int32)
        .at[slot]
        .set(jnp.arange(m, dtype=jnp.int32), mode="drop")
    )
    n_blocks = padded_rows // block
    block_group = jnp.searchsorted(padded_ends, jnp.arange(n_blocks) * block, side="right")
    block_group = jnp.minimum(block_group, n_groups - 1)  # trailing empty blocks: any weights
    return BlockLayout(slot=slot, source=source, block_group=block_group, block=block)


def swiglu_blocks(experts, blocks: jax.Array, block_group: jax.Array) -> jax.Array:
    """blocks [n_blocks, block, d_e] -> [n_blocks, block, d_e]: each block through the SwiGLU
    of its expert block_group [n_blocks], one batched product per matrix with each block's
    weights gathered ([n_blocks, d_e, f_e])."""

    def per_block(x: jax.Array, weights: jax.Array) -> jax.Array:
        return jnp.einsum("qbi,qio->qbo", x, weights[block_group])

    hidden = jax.nn.silu(per_block(blocks, experts.w_gate)) * per_block(blocks, experts.w_up)
    return per_block(hidden, experts.w_down)


@jax.custom_vjp
def gather_rows(x: jax.Array, index: jax.Array, spread: jax.Array) -> jax.Array:
    """x [n, d] -> [len(index), d]: row p is x[index[p]], zeros where index[p] >= n. `spread`
    [n, fan] int lists, for each row r of x, every p with index[p] == r (entries >= len(index)
    where fewer): the inverse map, which the layouts here know. The gradient is then a gather
    too (dx[r] = the sum over spread[r] of dy), where JAX's own is a scatter-add, which XLA:CPU
    runs row by row and GPUs with atomics (tiny-moe's dispatch, forward + backward on 2 cores:
    28.4 ms with scatter-adds, 18.2 ms with these gathers)."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _gather_rows_forward(x, index, spread):
    return gather_rows(x, index, spread), spread


def _gather_rows_backward(spread, dy):
    dx = jnp.take(dy, spread, axis=0, mode="fill", fill_value=0).sum(axis=1)
    return dx, None, None


gather_rows.defvjp(_gather_rows_forward, _gather_rows_backward)


def _through_blocks(experts, rows: jax.Array, layout: BlockLayout, fan: int = 1) -> jax.Array:
    """The padded rows (rows[layout.source // fan], zero for padding) run through their
    experts -> [padded_rows, d_e]. Each row of `rows` fills `fan` consecutive slots of
    layout.slot (the routed form: a token's k assignments)."""
    spread = layout.slot.reshape(rows.shape[0], fan)
    buffer = gather_rows(rows, layout.source // fan, spread)
    width = buffer.shape[-1]
    out = swiglu_blocks(experts, buffer.reshape(-1, layout.block, width), layout.block_group)
    return out.reshape(buffer.shape[0], -1)


def blocked_swiglu(
    experts, rows: jax.Array, group_sizes: jax.Array, block: int | None = None
) -> jax.Array:
    """SwiGLU experts over expert-aligned blocks of `block` rows (default: block_rows): rows
    [m, d_e] sorted by expert -> [m, d_e]."""
    m = rows.shape[0]
    n_groups = group_sizes.shape[0]
    ids = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")
    layout = block_layout(ids, n_groups, block or block_rows(m, n_groups), group_sizes)
    out = _through_blocks(experts, rows, layout)
    return gather_rows(out, layout.slot, layout.source[:, None])


def blocked_swiglu_routed(
    experts, x: jax.Array, expert_ids: jax.Array, block: int | None = None
) -> jax.Array:
    """SwiGLU experts straight from the tokens: x [tokens, d_e], expert_ids [tokens, k] ->
    [tokens, k, d_e], each token's output from each of its k experts. The same blocks as
    blocked_swiglu with no rows sorted first: one gather from x into the blocks and one out of
    them (no argsort, no scatter of rows, no unsorting)."""
    tokens, k = expert_ids.shape
    n_groups = expert_count(experts)
    ids = expert_ids.reshape(-1)
    layout = block_layout(ids, n_groups, block or block_rows(ids.shape[0], n_groups))
    out = _through_blocks(experts, x, layout, fan=k)  # padding: past the tokens
    every = gather_rows(out, layout.slot, layout.source[:, None])  # every row is routed
    return every.reshape(tokens, k, -1)


SortedFn = Callable[[Any, jax.Array, jax.Array], jax.Array]
"""(experts, rows [m, d_e] sorted by expert, group_sizes [E] int32) -> [m, d_e]."""


@dataclass(frozen=True)
class GroupedSwiGLU:
    """One grouped SwiGLU in both forms (module doc)."""

    name: str
    sorted: SortedFn
    routed: Callable[[Any, jax.Array, jax.Array], jax.Array]
    """(experts, x [tokens, d_e], expert_ids [tokens, k] int) -> [tokens, k, d_e]."""


def routed_by_sorting(sorted_fn: SortedFn) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """The routed form of any sorted form: the (token, slot) assignments stably sorted by
    expert, the token rows gathered in that order, `sorted_fn`, and the outputs unsorted (both
    through gather_rows: the permutation and its inverse are known, so no scatter-add)."""

    def routed(experts, x: jax.Array, expert_ids: jax.Array) -> jax.Array:
        tokens, k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        rows = gather_rows(x, order // k, inverse.reshape(tokens, k))  # a token's k sorted places
        out = sorted_fn(experts, rows, count_groups(flat, expert_count(experts)))
        return gather_rows(out, inverse, order[:, None]).reshape(tokens, k, -1)

    return routed


RAGGED = GroupedSwiGLU("ragged", ragged_swiglu, routed_by_sorting(ragged_swiglu))
BLOCKS = GroupedSwiGLU("blocks", blocked_swiglu, blocked_swiglu_routed)


def expert_swiglu_for(kind: str) -> GroupedSwiGLU:
    """The grouped SwiGLU for `kind` ("auto", "ragged" or "blocks")."""
    if kind == "auto":
        kind = "ragged" if jax.default_backend() == "tpu" else "blocks"
    return BLOCKS if kind == "blocks" else RAGGED
