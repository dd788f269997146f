"""The whole model: expert-parallel equals single-device (loss and gradients), sizes, masking."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from keel.model.config import ModelConfig
from keel.model.loss import cross_entropy, segment_ids, target_mask
from keel.model.partition import param_shardings
from keel.model.sharding import BATCH_SPEC, MeshConfig, build_mesh
from keel.model.size import model_size
from keel.model.transformer import forward, init_params, init_router_bias

MOE = ModelConfig(
    vocab_size=97,
    d_model=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=48,
    rotary_fraction=0.5,
    n_routed_experts=8,
    top_k=2,
    n_shared_experts=1,
    expert_ffn_dim=16,
    n_dense_layers=1,
    send_capacity=8.0,  # room for every assignment: nothing drops
    receive_capacity=8.0,
)


def batch(seed: int, rows: int = 8, seq: int = 16) -> jnp.ndarray:
    return jax.random.randint(jax.random.key(seed), (rows, seq + 1), 0, MOE.vocab_size)


def loss_and_grads(params, bias, window, config, mesh):
    def loss_fn(params):
        logits, stats = forward(params, window[:, :-1], config, bias, mesh=mesh)
        parts = cross_entropy(logits, window[:, 1:], jnp.ones(window[:, 1:].shape))
        return parts.cross_entropy + 1e-3 * stats.z_loss.sum(), stats

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)


@pytest.fixture(scope="module")
def one_device_moe():
    """The one-device reference of the sharded cases: params, router bias, batch, (loss, stats),
    gradients (computed once for every mesh shape)."""
    params = init_params(jax.random.key(0), MOE)
    bias = jax.random.normal(jax.random.key(1), (MOE.n_moe_layers, MOE.n_routed_experts)) * 0.1
    window = batch(2)
    return params, bias, window, *loss_and_grads(params, bias, window, MOE, None)


# Each of the three axes alone at its widest (data 8; fsdp 4 with data 2; expert 4 with fsdp 2)
# and all three together.
@pytest.mark.parametrize("shape", [(1, 2, 4), (2, 2, 2), (8, 1, 1), (2, 4, 1)])
def test_sharded_mesh_matches_single_device_loss_and_gradients(shape, one_device_moe):
    """(data, fsdp, expert): every layout computes the one-device loss and gradients."""
    params, bias, window, (loss, stats), grads = one_device_moe
    data, fsdp, expert = shape
    mesh = build_mesh(MeshConfig(data, fsdp, expert), jax.devices()[: data * fsdp * expert])
    sharded = jax.device_put(params, param_shardings(params, mesh))
    window_sharded = jax.device_put(window, NamedSharding(mesh, BATCH_SPEC))
    (ep_loss, ep_stats), ep_grads = loss_and_grads(sharded, bias, window_sharded, MOE, mesh)

    assert float(ep_stats.dropped.sum()) == 0.0
    np.testing.assert_allclose(ep_loss, loss, rtol=1e-5)
    np.testing.assert_array_equal(ep_stats.load, stats.load)
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(ep_grads), jax.tree.leaves(grads), strict=True
    ):
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=str(path))


@pytest.mark.parametrize(
    "config",
    [
        MOE,
        replace(MOE, n_routed_experts=0, tied_embeddings=False),
        replace(MOE, latent_dim=8, n_shared_experts=0, n_dense_layers=0),
    ],
    ids=["moe", "dense-untied", "moe-latent"],
)
def test_model_size_counts_every_parameter(config):
    params = init_params(jax.random.key(0), config)
    counted = sum(leaf.size for leaf in jax.tree.leaves(params))
    size = model_size(config)
    assert size.total == counted
    assert size.active <= size.total
    if config.is_moe:
        unused = (config.n_routed_experts - config.top_k) * 3 * (config.latent_dim or 32) * 16
        assert size.total - size.active == config.n_moe_layers * unused


def test_documents_do_not_see_each_other_with_segment_masking():
    config = replace(MOE, n_routed_experts=0)
    params = init_params(jax.random.key(0), config)
    eos = 3
    first = jnp.array([[5, 6, 7, eos, 8, 9, 10, 11]])
    other = jnp.array([[12, 13, 14, eos, 8, 9, 10, 11]])  # same second document
    bias = init_router_bias(config)
    outputs = [
        forward(params, tokens, config, bias, segment_ids=segment_ids(tokens, eos))[0]
        for tokens in (first, other)
    ]
    np.testing.assert_allclose(outputs[0][:, 4:], outputs[1][:, 4:], rtol=1e-5, atol=1e-6)
    assert not np.allclose(outputs[0][:, :4], outputs[1][:, :4])
    unmasked = [forward(params, tokens, config, bias)[0] for tokens in (first, other)]
    assert not np.allclose(unmasked[0][:, 4:], unmasked[1][:, 4:])
    assert target_mask(first, eos).tolist() == [[1, 1, 1, 0, 1, 1, 1, 1]]


def test_compute_in_bfloat16_keeps_float32_logits_close():
    params = init_params(jax.random.key(0), MOE)
    bias = init_router_bias(MOE)
    tokens = batch(3)[:, :-1]
    full, _ = forward(params, tokens, MOE, bias)
    half, _ = forward(params, tokens, MOE, bias, compute_dtype=jnp.bfloat16)
    assert half.dtype == jnp.float32
    assert float(jnp.abs(full - half).max()) < 0.05 * float(jnp.abs(full).max()) + 0.05
