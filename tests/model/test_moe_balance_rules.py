"""The "histogram" balancing rule and the sequence-wise balance loss: the histogram rule evens
out a skewed router like the per-batch rules do, and the sequence-wise loss cuts capacity drops
on a router that is balanced over the batch but skewed within each sequence."""

from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mesh_support import run, tiny_moe
from test_router import E, K, skewed_router

from keel.core.config import apply_overrides
from keel.model.balance import initial_balance_state
from keel.model.config import ModelConfig, RouterConfig
from keel.model.moe import init_moe, moe_forward
from keel.model.router import (
    route,
    router_metrics,
    routing_stats,
    sequence_balance_loss,
    update_balance,
    update_bias,
)
from keel.model.sharding import MeshConfig, expert_mesh
from keel.train.checkpoint import Checkpoints, TrainState
from keel.train.config import TrainConfig
from keel.train.layout import initial_state


def test_histogram_rule_balances_a_skewed_router_like_the_per_batch_rule():
    config = RouterConfig(balance="histogram")  # 10,000 bins, window 8, bias_rate 1e-3
    x, w = skewed_router()
    state = jax.tree.map(lambda leaf: leaf[0], initial_balance_state(config, 1, E))
    assert state["window"].shape == (8, E, 10_000)

    def step(carry, _):
        bias, state = carry
        stats = routing_stats(route(x, w, bias, config, K), E)
        return update_balance(bias, state, stats, config), None

    (bias, state), _ = jax.jit(lambda c: jax.lax.scan(step, c, None, length=200))(
        (jnp.zeros(E), state)
    )
    metrics = router_metrics(routing_stats(route(x, w, bias, config, K), E), bias)
    assert float(metrics["load_max_over_mean"]) < 1.2
    assert float(metrics["load_entropy"]) > 0.98 * np.log(E)
    assert abs(float(jnp.mean(bias))) < 1e-6
    assert float(bias[0]) < 0 and float(bias[1]) < 0
    assert int(state["batches"]) == 200
    # Every slot of the window holds one batch's histogram: all T tokens, for every expert.
    np.testing.assert_array_equal(state["window"].sum(-1), x.shape[0])


SEQS, SEQ, D_MODEL = 4, 64, 16


def per_sequence_skew() -> jax.Array:
    """x [SEQS * SEQ, D_MODEL]: sequence s carries a constant feature 1 + s, which the router
    below turns into +3 on the logits of experts 2s and 2s + 1: over the batch every expert gets
    its share (the bias has nothing to fix), within a sequence two experts get nearly all."""
    x = jax.random.normal(jax.random.key(2), (SEQS, SEQ, D_MODEL))
    x = x.at[:, :, 1 : 1 + SEQS].set(jnp.eye(SEQS)[:, None, :])
    return x.reshape(SEQS * SEQ, D_MODEL)


def drop_rate_after_training(seq_balance_weight: float) -> float:
    """Train one MoE block (router and experts, Adam, 30 steps) to a fixed regression target on
    4 expert devices, one sequence each, with capacities 1.15 and the sign rule moving the
    bias; the drop rate of the trained block."""
    router = RouterConfig(seq_balance_weight=seq_balance_weight, bias_rate=1e-2)
    config = ModelConfig(
        d_model=D_MODEL,
        n_routed_experts=8,
        expert_ffn_dim=16,
        top_k=2,
        send_capacity=1.15,
        receive_capacity=1.15,
        router=router,
    ).validate()
    mesh = expert_mesh(SEQS)
    params = init_moe(jax.random.key(3), config)
    skew = jnp.zeros((D_MODEL, 8)).at[1 + jnp.arange(SEQS), 2 * jnp.arange(SEQS)].set(3.0)
    skew = skew.at[1 + jnp.arange(SEQS), 2 * jnp.arange(SEQS) + 1].set(3.0)
    params = replace(params, router=params.router + skew)
    x = per_sequence_skew()
    target = jnp.tanh(x @ jax.random.normal(jax.random.key(4), (D_MODEL, D_MODEL)))
    optimizer = optax.adam(3e-2)

    def loss_fn(params, bias):
        y, stats = moe_forward(params, x, bias, config, mesh, SEQ)
        return jnp.mean((y - target) ** 2) + seq_balance_weight * stats.seq_balance, stats

    def step(carry, _):
        params, opt_state, bias = carry
        (_, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, bias)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        bias = update_bias(bias, stats, router)
        return (optax.apply_updates(params, updates), opt_state, bias), None

    @jax.jit
    def train(params):
        carry = (params, optimizer.init(params), jnp.zeros(8))
        (params, _, bias), _ = jax.lax.scan(step, carry, None, length=30)
        _, stats = loss_fn(params, bias)
        return stats.dropped / stats.assignments

    return float(train(params))


def test_sequence_balance_loss_halves_drops_on_a_router_skewed_per_sequence():
    without = drop_rate_after_training(0.0)
    with_term = drop_rate_after_training(1.0)
    assert without > 0.2, without
    assert with_term <= 0.5 * without, (with_term, without)


def test_sequence_balance_loss_values():
    """1 for sequences spread evenly, E / K when each sends everything to its top K experts."""
    even = jnp.full((SEQ, 8), 1 / 8)
    experts = jnp.stack([jnp.arange(SEQ) % 8, (jnp.arange(SEQ) + 1) % 8], axis=1)
    np.testing.assert_allclose(sequence_balance_loss(even, experts, 2, SEQ // 2), 1.0, 1e-6)
    peaked = jnp.zeros((SEQ, 8)).at[:, :2].set(0.5)
    fixed = jnp.broadcast_to(jnp.array([0, 1]), (SEQ, 2))
    np.testing.assert_allclose(sequence_balance_loss(peaked, fixed, 2, SEQ), 4.0, 1e-6)


def histogram_run(wikitext_cache) -> TrainConfig:
    """tiny-moe cut to one MoE layer and 4 x 64 tokens, 2 steps on one device, under the
    histogram rule (1000 bins, a window of 3) with the sequence-wise loss."""
    return apply_overrides(
        tiny_moe(wikitext_cache, MeshConfig(data=1, fsdp=1, expert=1)),
        [
            "model.n_layers=1",
            "model.n_dense_layers=0",
            "batch_size=4",
            "phases.0.schedule.warmup_steps=1",
            "steps=2",
            "eval_every=2",
            "checkpoint_every=2",
            "model.router.balance=histogram",
            "model.router.histogram_bins=1000",
            "model.router.histogram_window=3",
            "model.router.seq_balance_weight=0.01",
        ],
    )


def restored(config: TrainConfig, run_dir: Path) -> TrainState:
    """The latest checkpoint of run_dir, laid out for `config` on one device."""
    like, _, _ = initial_state(config, lambda _: 0.0, jax.devices()[:1])
    checkpoints = Checkpoints(str(run_dir), every=1, keep=3)
    try:
        return checkpoints.restore(like)
    finally:
        checkpoints.close()


def test_the_histogram_state_trains_and_is_checkpointed_and_the_sequence_loss_logged(
    wikitext_cache, tmp_path
):
    config = histogram_run(wikitext_cache)
    rows = run(config, tmp_path / "run", 1)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(1.0 <= row["seq_balance_loss"] <= 4.0 for row in rows)  # top 2 of 8 experts

    state = restored(config, tmp_path / "run")
    layers = config.model.n_moe_layers
    np.testing.assert_array_equal(state.balance_state["batches"], [2] * layers)
    window = np.asarray(state.balance_state["window"])
    assert window.shape == (layers, 3, 8, 1000)
    tokens = config.batch_size * 64
    np.testing.assert_array_equal(window[:, :2].sum(-1), tokens)  # one batch per used slot
    np.testing.assert_array_equal(window[:, 2], 0.0)


def test_a_checkpoint_without_rule_state_resumes_under_the_histogram_rule(wikitext_cache, tmp_path):
    """A sign run's checkpoint (no balance_state, like an older keel's) restores under the
    histogram rule with everything else as saved and the rule's state fresh."""
    histogram = histogram_run(wikitext_cache)
    sign = apply_overrides(histogram, ["model.router.balance=sign"])
    saved, _, _ = initial_state(sign, lambda _: 0.0, jax.devices()[:1])
    saved = replace(saved, router_bias=saved.router_bias + 0.25, step=saved.step + 7)
    checkpoints = Checkpoints(str(tmp_path / "run"), every=1, keep=3)
    checkpoints.save(saved)
    checkpoints.close()

    state = restored(histogram, tmp_path / "run")
    assert int(state.step) == 7
    np.testing.assert_array_equal(state.router_bias, saved.router_bias)
    assert state.balance_state["window"].shape == (histogram.model.n_moe_layers, 3, 8, 1000)
    assert float(state.balance_state["window"].sum()) == 0.0
    assert int(state.balance_state["batches"].sum()) == 0


def test_histograms_add_over_expert_devices():
    router = RouterConfig(balance="histogram", histogram_bins=100)
    config = ModelConfig(d_model=16, n_routed_experts=8, expert_ffn_dim=8, router=router)
    params = init_moe(jax.random.key(0), config.validate())
    x = jax.random.normal(jax.random.key(1), (4 * 32, 16))
    forward = jax.jit(moe_forward, static_argnums=(3, 4))
    _, stats = forward(params, x, jnp.zeros(8), config, expert_mesh(4))
    _, whole = forward(params, x, jnp.zeros(8), config, None)
    np.testing.assert_array_equal(stats.bias_target, whole.bias_target)
    np.testing.assert_array_equal(stats.bias_target.sum(-1), x.shape[0])  # every token, per expert
