"""Top-k routing with auxiliary-loss-free load balancing: a per-expert bias shifts which experts
are chosen, never how much they weigh.

Shapes: x [tokens, d_model], router_w [d_model, experts], bias [experts]. Scores, gates and the
bias are in score units (softmax probabilities or sigmoid outputs), always float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from keel.core.errors import ConfigError
from keel.model.balance import balance_rule, is_stateful, observe_statistic
from keel.model.config import RouterConfig


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Routing:
    """Which experts each token goes to, and with what weight."""

    experts: jax.Array
    """[tokens, top_k] int32 expert ids, best (by biased score) first."""
    gates: jax.Array
    """[tokens, top_k] float32 weights from the unbiased scores."""
    z_loss: jax.Array
    """[] float32 mean over tokens of logsumexp(logits)^2 (unweighted)."""
    bias_target: jax.Array
    """The balancing rule's statistic from these tokens (balance.py; the "quantile" rule's
    target bias [experts], zeros [experts] for "sign" and "none")."""
    seq_balance: jax.Array
    """[] float32 the sequence-wise balance loss (unweighted; seq_balance_loss), mean over these
    tokens' sequences; 0 when model.router.seq_balance_weight is 0 (not computed)."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RouterStats:
    """One MoE layer, one step, summed over all devices."""

    load: jax.Array
    """[experts] float32 selections per expert, before any capacity drop."""
    dropped: jax.Array
    """[] float32 assignments dropped by capacity (they contribute zero), send and receive."""
    assignments: jax.Array
    """[] float32 tokens * top_k."""
    z_loss: jax.Array
    """[] float32 router z-loss (unweighted; the caller multiplies by z_loss_weight)."""
    bias_target: jax.Array
    """The balancing rule's statistic reduced over devices (see Routing.bias_target)."""
    dropped_recv: jax.Array | None = None
    """[] float32 the part of `dropped` that receivers dropped (None: nothing exchanged); the
    rest was dropped by senders."""
    seq_balance: jax.Array | None = None
    """[] float32 the sequence-wise balance loss (unweighted), mean over sequences (None: not
    computed)."""


def route(
    x: jax.Array,
    router_w: jax.Array,
    bias: jax.Array,
    config: RouterConfig,
    top_k: int,
    sequence_tokens: int | None = None,
) -> Routing:
    """Choose top_k experts per token on scores + stop_gradient(bias); gate with the unbiased
    scores. Logits, scores and gates are float32 whatever x's dtype. With seq_balance_weight > 0
    the rows of x are read as sequences of `sequence_tokens` tokens (None: one sequence) for the
    sequence-wise balance loss."""
    n_experts = router_w.shape[-1]
    if not 1 <= top_k <= n_experts:
        raise ConfigError(
            f"model.top_k ({top_k}) must be between 1 and the number of experts ({n_experts})"
        )
    logits = x.astype(jnp.float32) @ router_w.astype(jnp.float32)
    if config.score == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif config.score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ConfigError(
            f"model.router.score must be 'softmax' or 'sigmoid', got {config.score!r}"
        )
    biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    _, experts = jax.lax.top_k(biased, top_k)
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if config.normalize_gates:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    rule = balance_rule(config.balance)
    bias_target = observe_statistic(
        rule, jax.lax.stop_gradient(scores), bias.astype(jnp.float32), top_k, config
    )
    seq_balance = jnp.zeros((), jnp.float32)
    if config.seq_balance_weight > 0:
        seq_balance = sequence_balance_loss(scores, experts, top_k, sequence_tokens)
    return Routing(
        experts=experts.astype(jnp.int32),
        gates=gates,
        z_loss=z_loss,
        bias_target=bias_target,
        seq_balance=seq_balance,
    )


def sequence_balance_loss(
    scores: jax.Array, experts: jax.Array, top_k: int, sequence_tokens: int | None
) -> jax.Array:
    """DeepSeek-V3's complementary sequence-wise balance loss (unweighted), mean over sequences.

    scores [tokens, E] (the rows: consecutive sequences of `sequence_tokens`, None or more than
    the rows: one sequence), experts [tokens, top_k]. Per sequence of T tokens:
    sum_i f_i * P_i, f_i = E / (top_k * T) * tokens routed to i (no gradient), P_i = mean over
    the tokens of s_i / sum_j s_j. 1 when every sequence spreads evenly; up to E / top_k."""
    n_tokens, n_experts = scores.shape
    per = n_tokens if sequence_tokens is None else min(sequence_tokens, n_tokens)
    if n_tokens % per:
        raise ValueError(f"{n_tokens} routed tokens are not whole sequences of {per}")
    normalized = scores / jnp.sum(scores, axis=-1, keepdims=True)
    share = jnp.mean(normalized.reshape(-1, per, n_experts), axis=1)  # [sequences, E]
    chosen = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32).sum(axis=1)  # [tokens, E]
    counts = chosen.reshape(-1, per, n_experts).sum(axis=1)
    f = jax.lax.stop_gradient(counts * n_experts / (top_k * per))
    return jnp.mean(jnp.sum(f * share, axis=-1))


def routing_stats(routing: Routing, n_experts: int) -> RouterStats:
    """RouterStats of one device's routing with nothing dropped (the single-device path; the
    expert-parallel path sums these over devices and adds its drops)."""
    load = jnp.zeros((n_experts,), jnp.float32).at[routing.experts.reshape(-1)].add(1.0)
    return RouterStats(
        load=load,
        dropped=jnp.zeros((), jnp.float32),
        assignments=jnp.asarray(routing.experts.size, jnp.float32),
        z_loss=routing.z_loss,
        bias_target=routing.bias_target,
        seq_balance=routing.seq_balance,
    )


def update_bias(bias: jax.Array, stats: RouterStats, config: RouterConfig) -> jax.Array:
    """One balancing step on bias [experts] by the rule model.router.balance names (balance.py),
    returned centred (top-k ignores a common shift); "none" leaves it unchanged."""
    if config.balance == "none":
        return bias
    rule = balance_rule(config.balance)
    new = rule.update(bias.astype(jnp.float32), stats.load, stats.bias_target, config)
    return (new - jnp.mean(new)).astype(bias.dtype)


def update_balance(
    bias: jax.Array, state: Any, stats: RouterStats, config: RouterConfig
) -> tuple[jax.Array, Any]:
    """update_bias for any rule, with the rule's persistent state (None for a rule without):
    (the new bias [experts], centred, the new state)."""
    rule = balance_rule(config.balance)
    if not is_stateful(rule) or config.balance == "none":
        return update_bias(bias, stats, config), state
    new, state = rule.update_state(
        bias.astype(jnp.float32), stats.load, stats.bias_target, state, config
    )
    return (new - jnp.mean(new)).astype(bias.dtype), state


def router_metrics(stats: RouterStats, bias: jax.Array) -> dict[str, jax.Array]:
    """Scalars for one layer (plus "load", the [experts] histogram): how even the load is, how
    much capacity dropped (in all, by senders, by receivers), and where the bias sits."""
    load = stats.load.astype(jnp.float32)
    total = jnp.maximum(jnp.sum(load), 1.0)
    share = load / total
    bias = bias.astype(jnp.float32)
    assignments = jnp.maximum(stats.assignments, 1.0)
    dropped_recv = (
        jnp.zeros_like(stats.dropped) if stats.dropped_recv is None else stats.dropped_recv
    )
    return {
        "load_entropy": -jnp.sum(xlogy(share, share)),
        "load_max_over_mean": jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9),
        "drop_rate": stats.dropped / assignments,
        "drop_rate_send": (stats.dropped - dropped_recv) / assignments,
        "drop_rate_recv": dropped_recv / assignments,
        "z_loss": stats.z_loss,
        "bias_mean": jnp.mean(bias),
        "bias_std": jnp.std(bias),
        "bias_max_abs": jnp.max(jnp.abs(bias)),
        "load": load,
    }
