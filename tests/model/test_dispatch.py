"""Expert dispatch: the dropless single-device path against a dense reference, the
expert-parallel all-to-all path against the dropless one, and the capacity drop policy against
a plain numpy re-implementation."""

import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keel.core.errors import ConfigError
from keel.model.config import ModelConfig
from keel.model.dispatch import dispatch_dropless
from keel.model.grouped import RAGGED as expert_swiglu
from keel.model.moe import init_moe, moe_forward, moe_param_specs
from keel.model.router import route, router_metrics
from keel.model.sharding import EXPERT_AXIS, expert_mesh

D, E, T_LOCAL = 16, 8, 64


def tiny_config(**overrides) -> ModelConfig:
    base = ModelConfig(
        d_model=D, n_routed_experts=E, top_k=2, expert_ffn_dim=8, init_std=0.3, n_layers=2
    )
    return replace(base, **overrides).validate()


def tokens(n: int, seed: int = 1) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (n * T_LOCAL, D))


def test_dropless_matches_a_dense_reference():
    config = tiny_config(top_k=3)
    params = init_moe(jax.random.key(0), config)
    x = tokens(1)
    routing = route(x, params.router, jnp.zeros(E), config.router, config.top_k)
    y = dispatch_dropless(x, routing, params.experts, expert_swiglu)

    ex = params.experts
    hidden = jax.nn.silu(jnp.einsum("td,edf->tef", x, ex.w_gate))
    every = jnp.einsum("tef,efd->ted", hidden * jnp.einsum("td,edf->tef", x, ex.w_up), ex.w_down)
    chosen = jnp.take_along_axis(every, routing.experts[:, :, None], axis=1)
    expected = jnp.sum(chosen * routing.gates[:, :, None], axis=1)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def loss_and_stats(params, x, mesh, config):
    y, stats = moe_forward(params, x, jnp.zeros(E), config, mesh)
    return jnp.mean(y.astype(jnp.float32) ** 2) + 0.1 * stats.z_loss, (y, stats)


def assert_close(actual, expected):
    scale = float(jnp.max(jnp.abs(expected)))
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize(
    ("devices", "overrides"),
    [
        (4, {"n_shared_experts": 1}),
        (8, {"n_shared_experts": 2, "latent_dim": 8, "dispatch_waves": 2}),
    ],
)
def test_expert_parallel_matches_dropless(devices, overrides):
    # Capacities no routing can exceed: every assignment to one destination, all to one receiver.
    big = float(devices)
    config = tiny_config(send_capacity=big, receive_capacity=big, **overrides)
    params = init_moe(jax.random.key(0), config)
    x = tokens(devices)
    mesh = expert_mesh(devices)
    grad_fn = jax.value_and_grad(loss_and_stats, argnums=(0, 1), has_aux=True)

    (loss_ref, (y_ref, stats_ref)), grads_ref = jax.jit(grad_fn, static_argnums=(2, 3))(
        params, x, None, config
    )
    # As the trainer places them: experts split over EXPERT_AXIS, the rest replicated.
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    params_ep = jax.device_put(params, jax.tree.map(shard, moe_param_specs(params)))
    x_ep = jax.device_put(x, shard(P(EXPERT_AXIS)))
    (loss_ep, (y_ep, stats_ep)), grads_ep = jax.jit(grad_fn, static_argnums=(2, 3))(
        params_ep, x_ep, mesh, config
    )

    assert float(stats_ep.dropped) == 0.0
    assert float(stats_ep.assignments) == x.shape[0] * config.top_k
    np.testing.assert_array_equal(stats_ep.load, stats_ref.load)
    assert y_ep.sharding.is_equivalent_to(x_ep.sharding, 2)
    assert_close(y_ep, y_ref)
    assert_close(loss_ep, loss_ref)
    assert_close(stats_ep.z_loss, stats_ref.z_loss)
    leaves_ep, leaves_ref = jax.tree.leaves(grads_ep), jax.tree.leaves(grads_ref)
    # router, 3 expert and 3 shared matrices, latent_down/up when used, and x.
    assert len(leaves_ep) == len(leaves_ref) == 1 + 3 + 3 + 2 * bool(config.latent_dim) + 1
    for actual, expected in zip(leaves_ep, leaves_ref, strict=True):
        assert float(jnp.max(jnp.abs(expected))) > 0
        assert_close(actual, expected)


def reference_delivered(experts: np.ndarray, n: int, c_send: int, c_recv: int) -> np.ndarray:
    """The capacity policy in numpy: experts [T, k] global ids -> [T, k] bool, assignment
    computed. Per source and destination the first c_send in (token, slot) order are sent; per
    receiver the first c_recv in (source, slot) order are computed."""
    t_local, n_local = experts.shape[0] // n, E // n
    delivered = np.zeros(experts.shape, bool)
    received: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for source in range(n):
        sent_to = [0] * n
        for t in range(source * t_local, (source + 1) * t_local):
            for slot in range(experts.shape[1]):
                dest = experts[t, slot] // n_local
                if sent_to[dest] < c_send:
                    sent_to[dest] += 1
                    received[dest].append((t, slot))
    for rows in received:
        for t, slot in rows[:c_recv]:
            delivered[t, slot] = True
    return delivered


@pytest.mark.parametrize("devices", [4, 8])
def test_tight_capacity_drops_what_the_policy_says(devices):
    config = tiny_config(send_capacity=1.5, receive_capacity=0.6)
    params = init_moe(jax.random.key(0), config)
    x = tokens(devices, seed=2).at[:, 0].set(1.0)
    # Skew: experts 0 and 1 (both on device 0) get a large logit offset.
    params = replace(params, router=params.router.at[0, :2].add(2.0))
    mesh = expert_mesh(devices)

    y, stats = jax.jit(moe_forward, static_argnums=(3, 4))(params, x, jnp.zeros(E), config, mesh)

    routing = route(x, params.router, jnp.zeros(E), config.router, config.top_k)
    assignments = T_LOCAL * config.top_k
    c_send = math.ceil(1.5 * assignments / devices)
    c_recv = math.ceil(0.6 * assignments)
    delivered = reference_delivered(np.asarray(routing.experts), devices, c_send, c_recv)
    expected_drops = int((~delivered).sum())
    unlimited = reference_delivered(np.asarray(routing.experts), devices, c_send, 10**9)
    sent_drops = int((~unlimited).sum())
    assert 0 < sent_drops < expected_drops  # both the send and the receive limit bite

    assert float(stats.dropped) == expected_drops
    metrics = router_metrics(stats, jnp.zeros(E))
    np.testing.assert_allclose(metrics["drop_rate"], expected_drops / (x.shape[0] * 2), 1e-6)
    load = np.bincount(np.asarray(routing.experts).ravel(), minlength=E)
    np.testing.assert_array_equal(stats.load, load)  # load counts selections before drops

    # Dropped assignments contribute zero: dropless with their gates zeroed gives the same y.
    masked = replace(routing, gates=jnp.where(delivered, routing.gates, 0.0))
    expected = dispatch_dropless(x, masked, params.experts, expert_swiglu)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_uneven_splits_are_config_errors():
    config = tiny_config()
    params = init_moe(jax.random.key(0), config)
    with pytest.raises(ConfigError, match="n_routed_experts"):
        moe_forward(params, tokens(3), jnp.zeros(E), config, expert_mesh(3))
    with pytest.raises(ConfigError, match="tokens"):
        moe_forward(params, tokens(4)[:-2], jnp.zeros(E), config, expert_mesh(4))
