"""Auxiliary-loss-free balancing rules as one registry: a rule is one object holding what it
observes on a device's tokens, how that statistic reduces across devices, and how it moves the
per-expert router bias after a step.

A rule's statistic is any pytree of float32 arrays (the built-in rules use [experts]); it travels
in RouterStats.bias_target. Adding a rule: define a `BalanceRule` and call
`register_balance_rule(rule)`; `model.router.balance: NAME` then selects it.

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
    n_experts = scores.shape[-1]
    biased = scores + bias.astype(jnp.float32)
    top, top_ids = jax.lax.top_k(biased, top_k + 1)
    kth, next_after = top[:, top_k - 1 : top_k], top[:, top_k : top_k + 1]
    # An expert inside the biased top-k sees the (k+1)-th value as its k-th best rival.
    selected = jnp.any(top_ids[:, :top_k, None] == jnp.arange(n_experts), axis=1)
    threshold = jnp.where(selected, next_after, kth)
    margins = scores - threshold
    return -jnp.quantile(margins, 1.0 - top_k / n_experts, axis=0)


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


for _rule in (NoBalance(), SignBalance(), QuantileBalance()):
    register_balance_rule(_rule)
