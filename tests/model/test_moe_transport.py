"""The expert-parallel transport: experts run per wave (less memory, same output), send and
receive drops each counted as a numpy re-implementation of the policy says, dropless pools, and
ragged_all_to_all refused on CPU. Runs on the 8 simulated CPU devices conftest.py sets up."""

import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keel.core.errors import ConfigError
from keel.model.config import ModelConfig
from keel.model.dispatch import dispatch_dropless
from keel.model.grouped import RAGGED
from keel.model.moe import init_moe, moe_forward
from keel.model.router import route, router_metrics
from keel.model.sharding import expert_mesh

D, E = 16, 8
forward = jax.jit(moe_forward, static_argnums=(3, 4))


def tiny_config(**overrides) -> ModelConfig:
    base = ModelConfig(
        d_model=D, n_routed_experts=E, top_k=2, expert_ffn_dim=32, init_std=0.3, n_layers=2
    )
    return replace(base, **overrides).validate()


def skewed(config: ModelConfig, devices: int, t_local: int, push: float):
    """(params, x [devices * t_local, D]): a constant feature pushes experts 0 and 1 up."""
    params = init_moe(jax.random.key(0), config)
    params = replace(params, router=params.router.at[0, :2].add(push))
    x = jax.random.normal(jax.random.key(2), (devices * t_local, D)).at[:, 0].set(1.0)
    return params, x


def test_three_waves_hold_under_half_the_memory_of_one_and_give_the_same_output():
    devices, t_local = 8, 96
    x = jax.random.normal(jax.random.key(1), (devices * t_local, D))
    temp_bytes, outputs = {}, {}
    for waves in (1, 3):
        config = tiny_config(send_capacity=8.0, receive_capacity=8.0, dispatch_waves=waves)
        params = init_moe(jax.random.key(0), config)
        args = (params, x, jnp.zeros(E), config, expert_mesh(devices))
        temp_bytes[waves] = forward.lower(*args).compile().memory_analysis().temp_size_in_bytes
        outputs[waves] = forward(*args)
    assert temp_bytes[3] <= 0.5 * temp_bytes[1], temp_bytes
    (y1, stats1), (y3, stats3) = outputs[1], outputs[3]
    assert float(stats1.dropped) == float(stats3.dropped) == 0.0
    np.testing.assert_allclose(y3, y1, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(y1))))


def reference_drops(
    experts: np.ndarray, n: int, c_send: int, recv_per_wave: int, waves: int
) -> tuple[np.ndarray, int, int]:
    """The policy in numpy: experts [T, k] global ids -> (delivered [T, k] bool, send drops,
    receive drops). Per source and destination the first c_send assignments in (token, slot)
    order are sent, the i-th of them in wave i // (c_send / waves); per receiver and wave the
    first recv_per_wave received rows in (source, slot) order are computed."""
    t_local, n_local, per_wave = experts.shape[0] // n, E // n, c_send // waves
    delivered = np.zeros(experts.shape, bool)
    received = [[[] for _ in range(waves)] for _ in range(n)]
    send_drops = 0
    for source in range(n):
        sent_to = [0] * n
        for t in range(source * t_local, (source + 1) * t_local):
            for slot in range(experts.shape[1]):
                dest = experts[t, slot] // n_local
                if sent_to[dest] == c_send:
                    send_drops += 1
                    continue
                received[dest][sent_to[dest] // per_wave].append((t, slot))
                sent_to[dest] += 1
    receive_drops = 0
    for per_dest in received:
        for rows in per_dest:
            receive_drops += max(0, len(rows) - recv_per_wave)
            for t, slot in rows[:recv_per_wave]:
                delivered[t, slot] = True
    return delivered, send_drops, receive_drops


@pytest.mark.parametrize(("devices", "waves"), [(4, 1), (8, 3)])
def test_send_and_receive_drops_follow_the_policy(devices, waves):
    t_local = 48
    config = tiny_config(send_capacity=1.5, receive_capacity=0.6, dispatch_waves=waves)
    params, x = skewed(config, devices, t_local, push=2.0)

    y, stats = forward(params, x, jnp.zeros(E), config, expert_mesh(devices))

    routing = route(x, params.router, jnp.zeros(E), config.router, config.top_k)
    assignments = t_local * config.top_k
    c_send = math.ceil(math.ceil(1.5 * assignments / devices) / waves) * waves
    recv_per_wave = math.ceil(math.ceil(0.6 * assignments) / waves)
    delivered, send_drops, receive_drops = reference_drops(
        np.asarray(routing.experts), devices, c_send, recv_per_wave, waves
    )
    assert send_drops > 0 and receive_drops > 0  # both limits bite
    assert float(stats.dropped_recv) == receive_drops
    assert float(stats.dropped) == send_drops + receive_drops
    metrics = router_metrics(stats, jnp.zeros(E))
    total = x.shape[0] * config.top_k
    np.testing.assert_allclose(metrics["drop_rate_send"], send_drops / total, rtol=1e-6)
    np.testing.assert_allclose(metrics["drop_rate_recv"], receive_drops / total, rtol=1e-6)

    # Dropped assignments contribute zero: dropless with their gates zeroed gives the same y.
    masked = replace(routing, gates=jnp.where(delivered, routing.gates, 0.0))
    expected = dispatch_dropless(x, masked, params.experts, RAGGED)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_dropless_pools_drop_nothing_where_capacity_drops():
    devices, t_local = 8, 64
    capped = tiny_config(send_capacity=1.15, receive_capacity=1.15)
    params, x = skewed(capped, devices, t_local, push=3.0)
    mesh = expert_mesh(devices)

    _, capped_stats = forward(params, x, jnp.zeros(E), capped, mesh)
    assert float(capped_stats.dropped / capped_stats.assignments) > 0.2

    y_one, _ = forward(params, x, jnp.zeros(E), capped, None)
    # 3 waves: C_send (tokens * k = 128) rounds up to 129, which must not cap C_recv.
    for waves in (1, 3):
        dropless = replace(capped, dropless="pools", dispatch_waves=waves)
        y, stats = forward(params, x, jnp.zeros(E), dropless, mesh)
        assert float(stats.dropped) == 0.0, waves
        scale = float(jnp.max(jnp.abs(y_one)))
        np.testing.assert_allclose(y, y_one, rtol=1e-5, atol=1e-5 * scale)


def test_ragged_exchange_is_refused_on_cpu():
    with pytest.raises(ConfigError, match=r"ragged_all_to_all.*pools"):
        tiny_config(dropless="ragged")  # validated before anything is traced
