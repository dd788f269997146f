"""Auxiliary-loss-free balancing rules as one registry: a rule is one object holding what it
observes on a device's tokens, how that statistic reduces across devices, and how it moves the
per-expert router bias after a step.

A rule's statistic is any pytree of float32 arrays (the built-in rules use [experts], "histogram"
[experts, bins]); it travels in RouterStats.bias_target. Adding a rule: define a `BalanceRule` and
call `register_balance_rule(rule)`; `model.router.balance: NAME` then selects it. A rule that
remembers more than the bias across steps (a `StatefulBalanceRule`, like "histogram") also says
its initial state; that state lives in TrainState.balance_state, one per MoE layer, and is saved
in checkpoints.

Shapes: scores [tokens, experts] unbiased router scores (float32), bias [experts], load [experts]
selections per expert summed over all devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp

from keel.core.errors import ConfigError

if TYPE_CHECKING:
    from keel.model.config import RouterConfig

QUANTILE_RATE_SCALE = 100.0
"""The "quantile" rule moves the bias a fraction min(1, QUANTILE_RATE_SCALE * bias_rate) of the
way to its target each update: 0.1 at the default bias_rate 1e-3, so the error shrinks ~10x in
about 25 updates. The "sign" rule moves at most bias_rate per update, which closes a score gap
of 0.3 in ~150 updates; both balance a strongly skewed router within a few hundred updates."""


class BalanceRule(Protocol):
    """One balancing rule; `name` is what model.router.balance says."""

    name: str

    def observe(self, scores: jax.Array, bias: jax.Array, top_k: int) -> Any:
        """This device's statistic from its tokens' unbiased scores (outside the gradient)."""
        ...

    def reduce(self, statistic: Any, axes: Sequence[str]) -> Any:
        """The statistic over all devices, inside shard_map over mesh `axes`."""
        ...

    def update(
        self, bias: jax.Array, load: jax.Array, statistic: Any, config: RouterConfig
    ) -> jax.Array:
        """The new bias [experts] (update_bias centres it afterwards)."""
        ...


class _LoadOnly:
    """For rules that need only the load: no statistic of their own (zeros [experts])."""

    def observe(self, scores: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
        return _no_statistic(scores)

    def reduce(self, statistic: jax.Array, axes: Sequence[str]) -> jax.Array:
        return statistic


def _no_statistic(scores: jax.Array) -> jax.Array:
    return jnp.zeros((scores.shape[-1],), jnp.float32)


@dataclass(frozen=True)
class NoBalance(_LoadOnly):
    """The bias never moves."""

    name: str = "none"

    def update(self, bias, load, statistic, config) -> jax.Array:
        return bias


@dataclass(frozen=True)
class SignBalance(_LoadOnly):
    """DeepSeek-V3: bias + bias_rate * sign(mean(load) - load)."""

    name: str = "sign"

    def update(self, bias, load, statistic, config) -> jax.Array:
        load = load.astype(jnp.float32)
        return bias + config.bias_rate * jnp.sign(jnp.mean(load) - load)


@dataclass(frozen=True)
class QuantileBalance:
    """The bias moves min(1, QUANTILE_RATE_SCALE * bias_rate) of the way to the bias that would
    give each expert tokens * top_k / experts selections (quantile_bias_target), averaged over
    devices."""

    name: str = "quantile"

    def observe(self, scores: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
        if top_k >= scores.shape[-1]:
            return _no_statistic(scores)
        return quantile_bias_target(scores, bias, top_k)

    def reduce(self, statistic: jax.Array, axes: Sequence[str]) -> jax.Array:
        return jax.lax.pmean(statistic, tuple(axes))

    def update(self, bias, load, statistic, config) -> jax.Array:
        rate = min(1.0, QUANTILE_RATE_SCALE * config.bias_rate)
        return bias + rate * (statistic - bias)


def quantile_bias_target(scores: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
    """[tokens, experts] unbiased scores -> [experts]: for each expert e, the bias that would
    give it exactly tokens * top_k / experts selections with the other experts' biases fixed.

    Expert e is selected for token t iff m_te + b_e > 0, where the margin m_te = s_te minus the
    top_k-th largest biased score among the other experts; so b*_e = -quantile(m_.e, 1 - k/E).
    """
    margins = score_margins(scores, bias, top_k)
    return -jnp.quantile(margins, 1.0 - top_k / scores.shape[-1], axis=0)


def score_margins(scores: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
    """[tokens, experts] unbiased scores -> [tokens, experts] margins m_te: s_te minus the
    top_k-th largest biased score among the other experts (e is selected iff m_te + b_e > 0)."""
    n_experts = scores.shape[-1]
    biased = scores + bias.astype(jnp.float32)
    top, top_ids = jax.lax.top_k(biased, top_k + 1)
    kth, next_after = top[:, top_k - 1 : top_k], top[:, top_k : top_k + 1]
    # An expert inside the biased top-k sees the (k+1)-th value as its k-th best rival.
    selected = jnp.any(top_ids[:, :top_k, None] == jnp.arange(n_experts), axis=1)
    threshold = jnp.where(selected, next_after, kth)
    return scores - threshold


HISTOGRAM_RANGE = 2.0
"""The "histogram" rule bins score margins over [-HISTOGRAM_RANGE, HISTOGRAM_RANGE] score units
(margins outside land in the edge bins): scores are in [0, 1] and biases stay well inside +-1."""


class StatefulBalanceRule(BalanceRule, Protocol):
    """A rule with state that persists across steps (TrainState.balance_state); its observe
    also gets the router config (observe_statistic calls it so)."""

    def observe(  # type: ignore[override]
        self, scores: jax.Array, bias: jax.Array, top_k: int, config: RouterConfig
    ) -> Any: ...

    def init_state(self, n_experts: int, config: RouterConfig) -> Any:
        """The state before the first step (a pytree of arrays; one per MoE layer)."""
        ...

    def update_state(
        self, bias: jax.Array, load: jax.Array, statistic: Any, state: Any, config: RouterConfig
    ) -> tuple[jax.Array, Any]:
        """(the new bias [experts], the new state) after one step."""
        ...


def is_stateful(rule: BalanceRule) -> bool:
    return hasattr(rule, "init_state") and hasattr(rule, "update_state")


def observe_statistic(
    rule: BalanceRule, scores: jax.Array, bias: jax.Array, top_k: int, config: RouterConfig
) -> Any:
    """The rule's statistic of these tokens (stateful rules also get the config)."""
    if is_stateful(rule):
        return rule.observe(scores, bias, top_k, config)
    return rule.observe(scores, bias, top_k)


@dataclass(frozen=True)
class HistogramBalance:
    """The seed's form of "quantile": per-expert histograms of score margins (config.
    histogram_bins bins) summed over the last config.histogram_window batches; the bias moves
    like "quantile"'s toward minus the margin quantile 1 - top_k / experts of that window, so one
    odd batch moves it less. Histograms add across devices.

    State: {"window": [histogram_window, experts, bins] float32 counts, one slot per batch,
    "batches": [] int32 batches seen}; memory 4 * window * experts * bins bytes per MoE layer."""

    name: str = "histogram"

    def observe(
        self, scores: jax.Array, bias: jax.Array, top_k: int, config: RouterConfig
    ) -> jax.Array:
        """[experts, bins] counts of this device's tokens by margin (score_margins)."""
        n_experts, bins = scores.shape[-1], config.histogram_bins
        if top_k >= n_experts:
            return jnp.zeros((n_experts, bins), jnp.float32)
        margins = score_margins(scores, bias, top_k)  # [tokens, experts]
        index = jnp.floor((margins + HISTOGRAM_RANGE) / (2 * HISTOGRAM_RANGE) * bins)
        index = jnp.clip(index, 0, bins - 1).astype(jnp.int32)
        experts = jnp.broadcast_to(jnp.arange(n_experts), margins.shape)
        return jnp.zeros((n_experts, bins), jnp.float32).at[experts, index].add(1.0)

    def reduce(self, statistic: jax.Array, axes: Sequence[str]) -> jax.Array:
        return jax.lax.psum(statistic, tuple(axes))

    def init_state(self, n_experts: int, config: RouterConfig) -> dict[str, jax.Array]:
        shape = (config.histogram_window, n_experts, config.histogram_bins)
        return {"window": jnp.zeros(shape, jnp.float32), "batches": jnp.zeros((), jnp.int32)}

    def update_state(self, bias, load, statistic, state, config):
        window = state["window"]
        slot = state["batches"] % window.shape[0]
        window = jax.lax.dynamic_update_index_in_dim(window, statistic, slot, 0)
        tokens = jnp.maximum(jnp.sum(statistic[0]), 1.0)
        n_experts = statistic.shape[0]
        share = jnp.sum(load.astype(jnp.float32)) / tokens / n_experts  # top_k / experts
        target = -histogram_quantile(jnp.sum(window, axis=0), 1.0 - share)
        rate = min(1.0, QUANTILE_RATE_SCALE * config.bias_rate)
        observed = jnp.sum(statistic) > 0  # top_k == experts: nothing to balance
        new = jnp.where(observed, bias + rate * (target - bias), bias)
        return new, {"window": window, "batches": state["batches"] + 1}

    def update(self, bias, load, statistic, config) -> jax.Array:
        """One step from a window holding only this batch."""
        fresh = self.init_state(statistic.shape[0], config)
        return self.update_state(bias, load, statistic, fresh, config)[0]


def histogram_quantile(counts: jax.Array, q: jax.Array) -> jax.Array:
    """counts [experts, bins] over [-HISTOGRAM_RANGE, HISTOGRAM_RANGE] -> [experts] the margin
    below which a fraction q of each expert's counts lie (linear within a bin)."""
    bins = counts.shape[-1]
    width = 2 * HISTOGRAM_RANGE / bins
    cdf = jnp.cumsum(counts, axis=-1) / jnp.maximum(jnp.sum(counts, -1, keepdims=True), 1.0)
    index = jax.vmap(lambda row: jnp.searchsorted(row, q, side="left"))(cdf)
    index = jnp.clip(index, 0, bins - 1)
    below = jnp.where(index > 0, jnp.take_along_axis(cdf, index[:, None] - 1, -1)[:, 0], 0.0)
    inside = jnp.take_along_axis(cdf, index[:, None], -1)[:, 0] - below
    fraction = jnp.clip((q - below) / jnp.maximum(inside, 1e-12), 0.0, 1.0)
    return -HISTOGRAM_RANGE + (index + fraction) * width


def initial_balance_state(config: RouterConfig, n_layers: int, n_experts: int) -> Any:
    """The TrainState.balance_state of a fresh run: the rule's state stacked over the n_layers
    MoE layers, or None for a rule without state (and for a dense model: n_layers == 0)."""
    rule = balance_rule(config.balance)
    if n_layers == 0 or not is_stateful(rule):
        return None
    one = rule.init_state(n_experts, config)
    return jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (n_layers, *leaf.shape)), one)


_RULES: dict[str, BalanceRule] = {}


def register_balance_rule(rule: BalanceRule) -> BalanceRule:
    """Make `rule` selectable as model.router.balance: rule.name (replacing one of that name)."""
    _RULES[rule.name] = rule
    return rule


def balance_rule(name: str) -> BalanceRule:
    """The registered rule called `name`; ConfigError listing the known ones otherwise."""
    if name not in _RULES:
        known = ", ".join(sorted(_RULES))
        raise ConfigError(f"model.router.balance {name!r} is not a balancing rule; known: {known}")
    return _RULES[name]


for _rule in (NoBalance(), SignBalance(), QuantileBalance(), HistogramBalance()):
    register_balance_rule(_rule)
