"""The two grouped-matmul implementations agree: outputs and gradients, uneven and empty groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keel.model.grouped import block_rows, blocked_swiglu, expert_swiglu_for, ragged_swiglu
from keel.model.moe import ExpertParams


@pytest.mark.parametrize("sizes", [[37, 0, 64, 1, 90, 8], [200, 0, 0, 0, 0, 0], [0] * 6])
def test_blocks_equal_ragged_dot_with_uneven_groups(sizes):
    rows, width, hidden = 200, 8, 12
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(6, width, hidden), (6, width, hidden), (6, hidden, width)]
    experts = ExpertParams(*(jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=False)))
    x = jax.random.normal(keys[3], (rows, width))
    group_sizes = jnp.array(sizes, jnp.int32)  # sum <= rows: the rest are not in any group

    def loss(fn, experts, x):
        return jnp.sum(jnp.sin(fn(experts, x, group_sizes)))

    want = ragged_swiglu(experts, x, group_sizes)
    got = blocked_swiglu(experts, x, group_sizes, block=16)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[sum(sizes) :]))
    grads_want = jax.grad(lambda e, x: loss(ragged_swiglu, e, x), argnums=(0, 1))(experts, x)
    grads_got = jax.grad(
        lambda e, x: loss(lambda *a: blocked_swiglu(*a, block=16), e, x), argnums=(0, 1)
    )(experts, x)
    for got_leaf, want_leaf in zip(
        jax.tree.leaves(grads_got), jax.tree.leaves(grads_want), strict=True
    ):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=2e-3, atol=2e-3)  # summation order


def test_auto_picks_blocks_on_cpu():
    assert jax.default_backend() == "cpu"
    assert expert_swiglu_for("auto") is blocked_swiglu
    assert expert_swiglu_for("ragged") is ragged_swiglu


def test_blocks_grow_with_the_rows_per_expert():
    assert block_rows(4096, 8) == 64  # a tiny CPU model
    assert block_rows(100, 8) == 64  # never below the minimum
    assert block_rows(16 * 2048 * 4, 32) == 512  # 1b-moe: 131,072 rows over 32 experts
    for rows, experts in [(4096, 8), (131_072, 32), (5000, 3)]:
        block = block_rows(rows, experts)
        assert block & (block - 1) == 0 and block * experts <= max(rows // 4, 64 * experts)
