"""Routing and auxiliary-loss-free balancing: which experts are chosen, with what gates, and
whether the bias updates even out a skewed router."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keel.core.errors import ConfigError
from keel.model.config import ModelConfig, RouterConfig
from keel.model.router import (
    RouterStats,
    route,
    router_metrics,
    routing_stats,
    update_bias,
)

T, D, E, K = 512, 16, 8, 2


def skewed_router() -> tuple[jax.Array, jax.Array]:
    """x [T, D] with a constant feature that pushes the logits of experts 0 and 1 up by 3."""
    x = jax.random.normal(jax.random.key(0), (T, D)).at[:, 0].set(1.0)
    w = jax.random.normal(jax.random.key(1), (D, E)) / np.sqrt(D)
    return x, w.at[0, :2].add(3.0)


def balance(config: RouterConfig, steps: int) -> jax.Array:
    """Iterate route -> update_bias on fixed tokens (no training); return the final bias."""
    x, w = skewed_router()

    def step(bias, _):
        return update_bias(bias, routing_stats(route(x, w, bias, config, K), E), config), None

    bias, _ = jax.jit(lambda b: jax.lax.scan(step, b, None, length=steps))(jnp.zeros(E))
    return bias


@pytest.mark.parametrize(
    ("balance_rule", "score"),
    [("sign", "softmax"), ("quantile", "softmax"), ("quantile", "sigmoid"), ("none", "softmax")],
)
def test_bias_updates_balance_a_skewed_router(balance_rule, score):
    config = RouterConfig(balance=balance_rule, score=score)  # default bias_rate 1e-3
    x, w = skewed_router()
    start = router_metrics(routing_stats(route(x, w, jnp.zeros(E), config, K), E), jnp.zeros(E))
    assert start["load_max_over_mean"] > 3.0

    bias = balance(config, steps=400)
    metrics = router_metrics(routing_stats(route(x, w, bias, config, K), E), bias)
    if balance_rule == "none":
        assert float(metrics["load_max_over_mean"]) > 2.0
        assert np.all(np.asarray(bias) == 0.0)
    else:
        assert float(metrics["load_max_over_mean"]) < 1.2
        assert float(metrics["load_entropy"]) > 0.98 * np.log(E)
        assert abs(float(jnp.mean(bias))) < 1e-6  # centred
        assert float(bias[0]) < 0 and float(bias[1]) < 0  # the favoured experts pushed down


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def test_gates_come_from_unbiased_scores_and_bias_gets_no_gradient():
    x, w = skewed_router()
    x, bias = x[:32], jnp.zeros(E).at[7].set(10.0)  # expert 7 wins every token's first slot
    routing = route(x, w, bias, RouterConfig(normalize_gates=False), K)
    scores = softmax(np.asarray(x, np.float64) @ np.asarray(w, np.float64))

    assert np.all(np.asarray(routing.experts[:, 0]) == 7)
    np.testing.assert_allclose(routing.gates[:, 0], scores[:, 7], rtol=1e-5)
    expected = np.take_along_axis(scores, np.asarray(routing.experts), axis=1)
    np.testing.assert_allclose(routing.gates, expected, rtol=1e-5)

    normalized = route(x, w, bias, RouterConfig(normalize_gates=True), K)
    np.testing.assert_allclose(normalized.gates, expected / expected.sum(1, keepdims=True), 1e-5)
    grad = jax.grad(lambda b: jnp.sum(route(x, w, b, RouterConfig(), K).gates ** 2))(bias)
    assert np.all(np.asarray(grad) == 0.0)


def test_sigmoid_scores_and_z_loss():
    x, w = skewed_router()
    x = x[:32].astype(jnp.bfloat16)  # logits are float32 whatever x's dtype
    routing = route(x, w, jnp.zeros(E), RouterConfig(score="sigmoid", normalize_gates=False), K)
    logits = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w, np.float64)
    top = np.argsort(-logits, axis=1, kind="stable")[:, :K]
    assert routing.gates.dtype == jnp.float32
    np.testing.assert_array_equal(np.sort(routing.experts, 1), np.sort(top, 1))
    chosen = np.take_along_axis(logits, np.asarray(routing.experts), 1)
    np.testing.assert_allclose(routing.gates, 1 / (1 + np.exp(-chosen)), rtol=1e-5)
    lse = np.log(np.exp(logits).sum(1))
    np.testing.assert_allclose(routing.z_loss, np.mean(lse**2), rtol=1e-5)


def test_quantile_target_gives_an_expert_its_even_share():
    """Moving one expert's bias to its target, others fixed, gives it T * K / E selections."""
    x, w = skewed_router()
    config = RouterConfig(balance="quantile")
    bias = jnp.asarray(np.random.default_rng(0).normal(0, 0.05, E), jnp.float32)
    target = route(x, w, bias, config, K).bias_target
    for expert in (0, 5):
        moved = bias.at[expert].set(target[expert])
        load = routing_stats(route(x, w, moved, config, K), E).load
        assert abs(float(load[expert]) - T * K / E) <= 1.0


def test_router_metrics_values():
    stats = RouterStats(
        load=jnp.array([3.0, 1.0, 0.0, 0.0]),
        dropped=jnp.array(1.0),
        assignments=jnp.array(4.0),
        z_loss=jnp.array(0.5),
        bias_target=jnp.zeros(4),
    )
    metrics = router_metrics(stats, jnp.array([0.1, -0.3, 0.1, 0.1]))
    p = np.array([0.75, 0.25])
    np.testing.assert_allclose(metrics["load_entropy"], -np.sum(p * np.log(p)), rtol=1e-6)
    np.testing.assert_allclose(metrics["load_max_over_mean"], 3.0)
    np.testing.assert_allclose(metrics["drop_rate"], 0.25)
    np.testing.assert_allclose(metrics["bias_mean"], 0.0, atol=1e-7)
    np.testing.assert_allclose(metrics["bias_max_abs"], 0.3, rtol=1e-6)
    np.testing.assert_allclose(metrics["bias_std"], np.std([0.1, -0.3, 0.1, 0.1]), rtol=1e-5)
    np.testing.assert_array_equal(metrics["load"], [3.0, 1.0, 0.0, 0.0])


def test_top_k_above_expert_count_is_a_config_error():
    with pytest.raises(ConfigError, match="top_k"):
        ModelConfig(n_routed_experts=4, top_k=5).validate()
    x, w = skewed_router()
    with pytest.raises(ConfigError, match="top_k"):
        route(x, w, jnp.zeros(E), RouterConfig(), E + 1)
