"""The language-modelling loss: next-token cross entropy on float32 logits, plus z-losses.

A training window is [batch, seq + 1] ids: inputs are w[:, :-1], targets w[:, 1:]. With document
masking, attention stays inside a document (segment ids count the EOS ids before a position, so
an EOS closes its own document) and the target after an EOS (the next document's first token,
which nothing in its own document could predict) carries no loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LossParts:
    cross_entropy: jax.Array
    """[] mean next-token negative log likelihood over counted targets (nats)."""
    z_loss: jax.Array
    """[] mean logsumexp(logits)^2 over counted targets (unweighted)."""
    nats: jax.Array
    """[] summed negative log likelihood (nats), for bits per byte."""
    targets: jax.Array
    """[] targets counted."""


def segment_ids(inputs: jax.Array, eos_id: int) -> jax.Array:
    """[batch, seq] document index of each input position: EOS ids strictly before it."""
    is_eos = (inputs == eos_id).astype(jnp.int32)
    return jnp.cumsum(is_eos, axis=-1) - is_eos


def target_mask(inputs: jax.Array, eos_id: int | None) -> jax.Array:
    """[batch, seq] float32 weights: 0 where the input is EOS (with document masking), else 1."""
    if eos_id is None:
        return jnp.ones(inputs.shape, jnp.float32)
    return (inputs != eos_id).astype(jnp.float32)


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> LossParts:
    """logits [batch, seq, vocab] (float32), targets [batch, seq] int, mask [batch, seq]."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = (log_z - picked) * mask
    count = jnp.maximum(mask.sum(), 1.0)
    return LossParts(
        cross_entropy=nll.sum() / count,
        z_loss=(jnp.square(log_z) * mask).sum() / count,
        nats=nll.sum(),
        targets=mask.sum(),
    )
