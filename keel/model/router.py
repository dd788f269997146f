"""Top-k routing with auxiliary-loss-free load balancing: a per-expert bias shifts which experts
are chosen, never how much they weigh.

Shapes: x [tokens, d_model], router_w [d_model, experts], bias [experts]. Scores, gates and the
bias are in score units (softmax probabilities or sigmoid outputs), always float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from keel.core.errors import ConfigError
from keel.model.config import RouterConfig

QUANTILE_RATE_SCALE = 100.0
"""The "quantile" rule moves the bias a fraction min(1, QUANTILE_RATE_SCALE * bias_rate) of the
way to its target each update: 0.1 at the default bias_rate 1e-3, so the error shrinks ~10x in
about 25 updates. The "sign" rule moves at most bias_rate per update, which closes a score gap
of 0.3 in ~150 updates; both balance a strongly skewed router within a few hundred updates."""


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
    """[experts] float32: the "quantile" rule's target bias from these tokens (zeros otherwise)."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RouterStats:
    """One MoE layer, one step, summed over all devices."""

    load: jax.Array
    """[experts] float32 selections per expert, before any capacity drop."""
    dropped: jax.Array
    """[] float32 assignments dropped by capacity (they contribute zero)."""
    assignments: jax.Array
    """[] float32 tokens * top_k."""
    z_loss: jax.Array
    """[] float32 router z-loss (unweighted; the caller multiplies by z_loss_weight)."""
    bias_target: jax.Array
    """[experts] float32 the "quantile" rule's target bias (zeros when unused)."""


def route(
    x: jax.Array, router_w: jax.Array, bias: jax.Array, config: RouterConfig, top_k: int
) -> Routing:
    """Choose top_k experts per token on scores + stop_gradient(bias); gate with the unbiased
    scores. Logits, scores and gates are float32 whatever x's dtype."""
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
    if config.balance == "quantile" and top_k < n_experts:
        bias_target = quantile_bias_target(jax.lax.stop_gradient(scores), bias, top_k)
    else:
        bias_target = jnp.zeros((n_experts,), jnp.float32)
    return Routing(
        experts=experts.astype(jnp.int32), gates=gates, z_loss=z_loss, bias_target=bias_target
    )


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
    )


def quantile_bias_target(scores: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
    """[tokens, experts] unbiased scores -> [experts]: for each expert e, the bias that would
    give it exactly tokens * top_k / experts selections with the other experts' biases fixed.

    Expert e is selected for token t iff m_te + b_e > 0, where the margin m_te = s_te minus the
    top_k-th largest biased score among the other experts; so b*_e = -quantile(m_.e, 1 - k/E).
    """
    n_experts = scores.shape[-1]
    biased = scores + bias.astype(jnp.float32)
    top, top_ids = jax.lax.top_k(biased, top_k + 1)
    kth, next_after = top[:, top_k - 1 : top_k], top[:, top_k : top_k + 1]
    # An expert inside the biased top-k sees the (k+1)-th value as its k-th best rival.
    selected = jnp.any(top_ids[:, :top_k, None] == jnp.arange(n_experts), axis=1)
    threshold = jnp.where(selected, next_after, kth)
    margins = scores - threshold
    return -jnp.quantile(margins, 1.0 - top_k / n_experts, axis=0)


def update_bias(bias: jax.Array, stats: RouterStats, config: RouterConfig) -> jax.Array:
    """One balancing step on bias [experts], returned centred (top-k ignores a common shift).

    "sign": bias + bias_rate * sign(mean(load) - load) (DeepSeek-V3). "quantile": bias moves
    min(1, QUANTILE_RATE_SCALE * bias_rate) of the way to stats.bias_target. "none": unchanged.
    """
    if config.balance == "none":
        return bias
    if config.balance == "sign":
        load = stats.load.astype(jnp.float32)
        new = bias + config.bias_rate * jnp.sign(jnp.mean(load) - load)
    elif config.balance == "quantile":
        rate = min(1.0, QUANTILE_RATE_SCALE * config.bias_rate)
        new = bias + rate * (stats.bias_target - bias)
    else:
        raise ConfigError(
            f"model.router.balance must be 'sign', 'quantile' or 'none', got {config.balance!r}"
        )
    return (new - jnp.mean(new)).astype(bias.dtype)


def router_metrics(stats: RouterStats, bias: jax.Array) -> dict[str, jax.Array]:
    """Scalars for one layer (plus "load", the [experts] histogram): how even the load is, how
    much capacity dropped, and where the bias sits."""
    load = stats.load.astype(jnp.float32)
    total = jnp.maximum(jnp.sum(load), 1.0)
    share = load / total
    bias = bias.astype(jnp.float32)
    return {
        "load_entropy": -jnp.sum(xlogy(share, share)),
        "load_max_over_mean": jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9),
        "drop_rate": stats.dropped / jnp.maximum(stats.assignments, 1.0),
        "z_loss": stats.z_loss,
        "bias_mean": jnp.mean(bias),
        "bias_std": jnp.std(bias),
        "bias_max_abs": jnp.max(jnp.abs(bias)),
        "load": load,
    }
