"""The two grouped-matmul implementations agree: outputs and gradients, uneven and empty groups."""

import re
from dataclasses import replace
from functools import partial
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keel.model import grouped
from keel.model.config import ModelConfig
from keel.model.dispatch import dispatch_dropless
from keel.model.grouped import (
    BLOCKS,
    RAGGED,
    block_rows,
    blocked_swiglu,
    blocked_swiglu_routed,
    expert_swiglu_for,
    ragged_swiglu,
)
from keel.model.moe import ExpertParams, init_moe, moe_forward
from keel.model.router import route


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
    assert expert_swiglu_for("auto") is BLOCKS
    assert expert_swiglu_for("ragged") is RAGGED


def test_blocks_grow_with_the_rows_per_expert():
    assert block_rows(4096, 8) == 64  # a tiny CPU model
    assert block_rows(100, 8) == 64  # never below the minimum
    assert block_rows(16 * 2048 * 4, 32) == 512  # 1b-moe: 131,072 rows over 32 experts
    for rows, experts in [(4096, 8), (131_072, 32), (5000, 3)]:
        block = block_rows(rows, experts)
        assert block & (block - 1) == 0 and block * experts <= max(rows // 4, 64 * experts)


@pytest.mark.parametrize("skew", [0.0, 3.0])  # 3.0: most tokens to two experts, some to none
def test_blocks_from_the_tokens_equal_the_sorted_path(skew):
    """The single-device fast path (tokens straight into blocks) against dispatch_dropless over
    rows sorted by expert with ragged_dot, forward and gradients."""
    config = ModelConfig(d_model=16, n_routed_experts=8, top_k=2, expert_ffn_dim=12, init_std=0.3)
    params = init_moe(jax.random.key(0), config)
    params = replace(params, router=params.router.at[:, :2].add(skew))
    x = jax.random.normal(jax.random.key(1), (300, 16))
    routing = route(x, params.router, jnp.zeros(8), config.router, config.top_k)

    def loss(dispatch, experts, x):
        return jnp.sum(jnp.sin(dispatch(x, routing, experts)))

    def fast(x, routing, experts):
        return dispatch_dropless(x, routing, experts, BLOCKS)

    def sorted_ragged(x, routing, experts):
        return dispatch_dropless(x, routing, experts, RAGGED)

    got = fast(x, routing, params.experts)
    want = sorted_ragged(x, routing, params.experts)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    grads = [
        jax.grad(partial(loss, dispatch), argnums=(0, 1))(params.experts, x)
        for dispatch in (fast, sorted_ragged)
    ]
    for got_leaf, want_leaf in zip(*map(jax.tree.leaves, grads), strict=True):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-5)


def test_the_moe_layer_takes_the_fast_path_for_blocks():
    config = ModelConfig(d_model=16, n_routed_experts=4, top_k=2, expert_ffn_dim=8)
    params = init_moe(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (64, 16))
    bias = jnp.zeros(4)

    def loss(kind, params, x):
        y, stats = moe_forward(params, x, bias, replace(config, grouped_matmul=kind), None)
        return jnp.sum(y**2) + stats.z_loss

    blocks = jax.jit(partial(loss, "blocks")).lower(params, x).as_text()
    assert "stablehlo.sort" not in blocks  # no argsort: the tokens go straight into blocks
    for got, want in zip(
        *(jax.tree.leaves(jax.grad(partial(loss, kind), argnums=(0, 1))(params, x))
          for kind in ("blocks", "ragged")),
        strict=True,
    ):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["sorted", "routed"])
def test_the_blocks_backward_gathers_rows_and_scatters_none(form):
    """The rows' way into the blocks and out is a pair of gathers whose gradients are gathers
    (gather_rows): the backward scatters no rows (its only scatters add the blocks' weight
    gradients into each expert's; the layout's integer one is the forward's) and equals JAX's
    scatter-add gradient."""
    config = ModelConfig(d_model=16, n_routed_experts=4, top_k=3, expert_ffn_dim=8, init_std=0.3)
    experts = init_moe(jax.random.key(0), config).experts
    x = jax.random.normal(jax.random.key(1), (40, 16))
    if form == "sorted":
        sizes = jnp.array([9, 0, 17, 10], jnp.int32)  # 36 of the 40 rows: 4 rows of padding
        fn = partial(blocked_swiglu, group_sizes=sizes, block=8)
    else:
        ids = jax.random.randint(jax.random.key(2), (40, 3), 0, 4)
        fn = partial(blocked_swiglu_routed, expert_ids=ids, block=8)

    def loss(experts, x):
        return jnp.sum(jnp.sin(fn(experts, x)))

    gradient = jax.grad(loss, argnums=(0, 1))
    text = jax.jit(gradient).lower(experts, x).as_text()
    scattered = re.findall(r"stablehlo\.scatter\"\(.*?\) -> tensor<([^>]*)>", text, re.DOTALL)
    weights = {"x".join(map(str, leaf.shape)) + "xf32" for leaf in jax.tree.leaves(experts)}
    assert [shape for shape in scattered if shape.endswith("i32")]  # the layout's, found
    assert {shape for shape in scattered if not shape.endswith("i32")} <= weights
    with_scatters = jax.grad(partial(_scatter_gradients, fn), argnums=(0, 1))(experts, x)
    for got, want in zip(*map(jax.tree.leaves, (gradient(experts, x), with_scatters)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _plain_take(rows, index, spread):
    return jnp.take(rows, index, axis=0, mode="fill", fill_value=0)


def _scatter_gradients(fn, experts, x):
    """`loss` with gather_rows replaced by a plain take, whose gradient JAX makes a scatter-add."""
    with mock.patch.object(grouped, "gather_rows", _plain_take):
        return jnp.sum(jnp.sin(fn(experts, x)))
