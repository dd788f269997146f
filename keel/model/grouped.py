"""Grouped matrix products for the routed experts: rows sorted by expert, each group multiplied by
its own expert's weights.

Two implementations of one contract, `expert_fn(experts, rows [m, d_e], group_sizes [E]) ->
[m, d_e]` (rows past sum(group_sizes) give zeros):
- "ragged": `jax.lax.ragged_dot`, a native grouped GEMM on GPUs and TPUs. XLA:CPU lowers it
  densely over the groups: measured on this project's 2-core CPU, [4096, 128] x 8 experts of
  [128, 128] took 15.7 ms forward (a dense [4096, 128] x [128, 128] product: 1.3 ms) and 90 ms
  for the gradient, which made it most of a tiny MoE's step time.
- "blocks": each group padded to a multiple of `block` rows, then one batched einsum over blocks
  with each block's expert weights gathered ([blocks, d_e, f] per matrix). The block grows with
  the rows (`block_rows`: about m / (8 E), at least 64), so padding stays under E x block ~ m / 8
  rows and the gathered weights under ~9x one layer's expert weights, whatever the model size.
"auto" picks "ragged" on TPU, where ragged_dot is a native grouped GEMM, and "blocks" on CPU
and GPU: jaxlib 0.10's GPU lowering of ragged_dot also multiplies every row by every expert
unless XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true (benchmarks/train_bench.py
compares both on a GPU: `--presets 1b-moe@ragged`).
"""

from __future__ import annotations

from collections.abc import Callable

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


def ragged_swiglu(experts, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """SwiGLU experts with `jax.lax.ragged_dot`: rows [m, d_e] sorted by expert -> [m, d_e]."""
    gate = jax.lax.ragged_dot(rows, experts.w_gate, group_sizes)
    up = jax.lax.ragged_dot(rows, experts.w_up, group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, experts.w_down, group_sizes)


def blocked_swiglu(
    experts, rows: jax.Array, group_sizes: jax.Array, block: int | None = None
) -> jax.Array:
    """SwiGLU experts over expert-aligned blocks of `block` rows (default: block_rows)."""
    m, width = rows.shape
    n_groups = group_sizes.shape[0]
    block = block or block_rows(m, n_groups)
    padded_rows = -(-(m + n_groups * (block - 1)) // block) * block
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    padded_sizes = -(-group_sizes // block) * block
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes

    index = jnp.arange(m)
    group = jnp.searchsorted(ends, index, side="right")  # n_groups for rows past the groups
    valid = group < n_groups
    safe = jnp.minimum(group, n_groups - 1)
    destination = jnp.where(valid, padded_starts[safe] + index - starts[safe], padded_rows)
    buffer = jnp.zeros((padded_rows, width), rows.dtype).at[destination].set(rows, mode="drop")

    n_blocks = padded_rows // block
    block_group = jnp.searchsorted(padded_ends, jnp.arange(n_blocks) * block, side="right")
    block_group = jnp.minimum(block_group, n_groups - 1)  # trailing empty blocks: any weights
    blocks = buffer.reshape(n_blocks, block, width)

    def per_block(x: jax.Array, weights: jax.Array) -> jax.Array:
        return jnp.einsum("qbi,qio->qbo", x, weights[block_group])

    hidden = jax.nn.silu(per_block(blocks, experts.w_gate)) * per_block(blocks, experts.w_up)
    out = per_block(hidden, experts.w_down).reshape(padded_rows, -1)
    return jnp.take(out, destination, axis=0, mode="fill", fill_value=0)


def expert_swiglu_for(kind: str) -> Callable:
    """The grouped SwiGLU for `kind` ("auto", "ragged" or "blocks")."""
    if kind == "auto":
        kind = "ragged" if jax.default_backend() == "tpu" else "blocks"
    return blocked_swiglu if kind == "blocks" else ragged_swiglu
