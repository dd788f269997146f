"""The jitted update and evaluation functions.

`update(state, window)` takes a batch of windows [batch, seq + 1], runs forward and backward,
applies the optimizer, and moves the router bias (and the balancing rule's state) from the step's
observed load (outside the gradient); with model.router.seq_balance_weight > 0 the sequence-wise
balance loss joins the loss and is logged as seq_balance_loss.
`evaluate(params, router_bias, window, weights)` sums nats and target bytes of the
targets that `weights` selects (padding rows and padded tails weigh 0) for bits per byte. Both
are pure functions of their inputs, compiled for the run's layout (layout.py): the batch split
over every device, the state in its shardings; with the optimizer state offloaded,
`update` moves it onto the devices for the step and back to host memory after.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from keel.model.loss import cross_entropy, segment_ids, target_mask
from keel.model.ring import zigzag_order
from keel.model.router import router_metrics, update_balance
from keel.model.sharding import SEQUENCE_AXIS, axis_size, replicated
from keel.model.transformer import forward
from keel.train.checkpoint import TrainState
from keel.train.config import TrainConfig
from keel.train.layout import RunLayout
from keel.train.long_eval import bucket_of_position, token_nll


@dataclass(frozen=True)
class StepFunctions:
    update: Callable
    """(TrainState, window [batch, seq+1] int32) -> (TrainState, metrics dict of arrays)"""
    evaluate: Callable
    """(params, router_bias, window [batch, seq+1] int32, weights [batch, seq] float32: 1 for a
    target to score, 0 for padding) -> (nats, bytes, targets) sums over the scored targets, and
    a dict for long-context evaluation (keel.train.long_eval): bucket_nats and bucket_targets
    [n_buckets] (sums by position bucket), row_correct and row_targets [batch] (scored targets
    the model's argmax got right, and scored targets, per row)"""


def build_step_functions(
    config: TrainConfig,
    optimizer: optax.GradientTransformation,
    learning_rate: Callable,
    token_bytes: jax.Array,
    eos_id: int,
    layout: RunLayout,
) -> StepFunctions:
    """Jitted update and evaluate for this run; `token_bytes` [vocab] int32 bytes per id."""
    model = config.model
    dtype = jnp.bfloat16 if config.compute_dtype == "bfloat16" else jnp.float32
    masked_eos = eos_id if config.mask_documents else None
    mesh = layout.mesh
    ring = axis_size(mesh, SEQUENCE_AXIS)

    def run_model(params, router_bias, window):
        """(logits, router stats, targets, target weights): with a sequence axis, all in ring
        attention's zigzag token order (the loss is a sum over tokens, so order is free)."""
        inputs, targets = window[:, :-1], window[:, 1:]
        segments = segment_ids(inputs, eos_id) if config.mask_documents else None
        weights = target_mask(inputs, masked_eos)
        positions = None
        if ring > 1:
            order = zigzag_order(inputs.shape[1], ring)
            positions = jnp.asarray(order)
            inputs, targets, weights = inputs[:, order], targets[:, order], weights[:, order]
            segments = None if segments is None else segments[:, order]
        logits, stats = forward(
            params,
            inputs,
            model,
            router_bias,
            mesh=mesh,
            segment_ids=segments,
            positions=positions,
            compute_dtype=dtype,
            remat=config.remat,
        )
        return logits, stats, targets, weights

    def loss_fn(params, router_bias, window):
        logits, stats, targets, weights = run_model(params, router_bias, window)
        parts = cross_entropy(logits, targets, weights)
        loss = parts.cross_entropy + model.z_loss_weight * parts.z_loss
        router_z = jnp.zeros((), jnp.float32)
        if stats is not None:
            router_z = stats.z_loss.mean()
            loss = loss + model.router.z_loss_weight * stats.z_loss.sum()
            if model.router.seq_balance_weight > 0:  # summed over MoE layers like the z-loss
                loss = loss + model.router.seq_balance_weight * stats.seq_balance.sum()
        return loss, (parts, stats, router_z)

    def update(state: TrainState, window: jax.Array):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (parts, stats, router_z)), grads = grad_fn(state.params, state.router_bias, window)
        opt_state = state.opt_state
        if layout.offloaded:
            opt_state = jax.device_put(opt_state, layout.opt_on_device)
        updates, opt_state = optimizer.update(grads, opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "cross_entropy": parts.cross_entropy,
            "z_loss": parts.z_loss,
            "router_z_loss": router_z,
            "grad_norm": optax.tree.norm(grads),
            "lr": learning_rate(state.step),
        }
        bias, balance_state = state.router_bias, state.balance_state
        if stats is not None:
            bias, balance_state = jax.vmap(update_balance, in_axes=(0, 0, 0, None))(
                bias, balance_state, stats, model.router
            )
            metrics["router"] = jax.vmap(router_metrics)(stats, state.router_bias)
            if model.router.seq_balance_weight > 0:
                metrics["seq_balance_loss"] = stats.seq_balance.mean()
        new_state = TrainState(params, opt_state, bias, state.step + 1, state.rng, balance_state)
        return new_state, metrics

    def evaluate(params, router_bias, window, weights):
        buckets = bucket_of_position(weights.shape[1])  # [seq, n_buckets]
        if ring > 1:
            order = zigzag_order(weights.shape[1], ring)
            weights, buckets = weights[:, order], buckets[order]
        logits, _, targets, mask = run_model(params, router_bias, window)
        mask = mask * weights
        parts = cross_entropy(logits, targets, mask)
        target_bytes = (token_bytes[targets] * mask).sum()
        nll = token_nll(logits, targets) * mask
        correct = (jnp.argmax(logits, axis=-1) == targets) * mask
        long_context = {
            "bucket_nats": nll.sum(axis=0) @ buckets,
            "bucket_targets": mask.sum(axis=0) @ buckets,
            "row_correct": correct.sum(axis=1),
            "row_targets": mask.sum(axis=1),
        }
        return parts.nats, target_bytes, parts.targets, long_context

    whole = replicated(mesh)
    batch = layout.batch
    return StepFunctions(
        jax.jit(
            update,
            in_shardings=(layout.state, batch),
            out_shardings=(layout.state, whole),
            donate_argnums=0,
        ),
        jax.jit(
            evaluate,
            in_shardings=(layout.state.params, layout.state.router_bias, batch, batch),
            out_shardings=whole,
        ),
    )


def bits_per_byte(nats: float, target_bytes: float) -> float:
    """Summed negative log likelihood (nats) over the targets' UTF-8 bytes, in bits per byte."""
    return nats / math.log(2) / max(target_bytes, 1.0)
