"""Optimizers: AdamW, or Muon for weight matrices with AdamW for the rest, built from optax.

The model labels every parameter leaf "matrix", "embedding" or "vector". A matrix may carry
leading batch axes ([d_in, d_out], [L, d_in, d_out], [L, E, d_in, d_out]); its last two axes are
(reduction, output) and Muon orthogonalises each [d_in, d_out] slice on its own. Weight decay
applies to matrices and embeddings, never to vectors (norm scales, biases). Gradients are clipped
by their global norm before the optimizer sees them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jax
import optax
from optax.contrib import MuonDimensionNumbers, muon

from keel.core.errors import ConfigError

OptimizerName = Literal["adamw", "muon"]
Label = Literal["matrix", "embedding", "vector"]
LABELS: tuple[str, ...] = ("matrix", "embedding", "vector")
Schedule = Callable[[jax.Array], jax.Array]


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer settings; the learning rate comes from the schedule, not from here."""

    name: OptimizerName = "adamw"
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay, multiplied by the lr (as in PyTorch and optax), on "matrix" and
    "embedding" leaves only."""
    clip_norm: float = 1.0
    """Clip gradients to this global L2 norm before the optimizer; 0 disables clipping."""
    muon_momentum: float = 0.95
    """Muon: decay of the (Nesterov) momentum that is orthogonalised."""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations per update."""
    muon_consistent_rms: float | None = 0.2
    """Muon: scale each orthogonalised [d_in, d_out] update by sqrt(max(d_in, d_out)) * this, so
    its RMS matches a typical AdamW update (Liu et al. 2025) and the two can share one lr. None
    uses Keller Jordan's width scaling sqrt(max(1, d_out / d_in)) instead, whose updates are
    smaller: raise muon_lr_ratio then (Muon's usual lr is around 0.02)."""
    muon_lr_ratio: float = 1.0
    """Muon: the lr of "matrix" leaves as a multiple of the schedule's lr; the AdamW leaves
    ("embedding", "vector") always use the schedule's lr. With muon_consistent_rms set, 1.0
    keeps both at the same update size."""
    offload_state: bool = False
    """Keep the optimizer state (moments, momenta) in host memory ("pinned_host") between steps;
    each update moves it onto the devices and back. Saves its bytes of device memory for the
    transfer time."""

    def validate(self) -> OptimizerConfig:
        """Raise ConfigError naming the first bad setting; return self."""
        if self.name not in ("adamw", "muon"):
            raise ConfigError(f"optimizer.name must be 'adamw' or 'muon', got {self.name!r}")
        for name in ("b1", "b2", "muon_momentum"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"optimizer.{name} must be in [0, 1), got {value}")
        if not self.eps > 0:
            raise ConfigError(f"optimizer.eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0 or not self.clip_norm >= 0:
            raise ConfigError(
                f"optimizer.weight_decay ({self.weight_decay}) and optimizer.clip_norm "
                f"({self.clip_norm}) must be >= 0 (clip_norm 0 disables clipping)"
            )
        if self.muon_ns_steps < 1:
            raise ConfigError(f"optimizer.muon_ns_steps must be >= 1, got {self.muon_ns_steps}")
        if not self.muon_lr_ratio > 0 or not math.isfinite(self.muon_lr_ratio):
            raise ConfigError(f"optimizer.muon_lr_ratio must be > 0, got {self.muon_lr_ratio}")
        rms = self.muon_consistent_rms
        if rms is not None and not rms > 0:
            raise ConfigError(f"optimizer.muon_consistent_rms must be > 0 or None, got {rms}")
        return self


def _check_labels(labels: Any) -> None:
    leaves = jax.tree.leaves(labels)
    if not leaves:
        raise ConfigError("optimizer labels are empty; the model must label every parameter")
    for leaf in leaves:
        if not isinstance(leaf, str) or leaf not in LABELS:
            raise ConfigError(
                f"unknown parameter label {leaf!r}; every leaf must be one of {', '.join(LABELS)}"
            )


def _check_params(params: Any, labels: Any) -> None:
    """The params must have the labels' structure, and every "matrix" leaf rank >= 2."""
    params_def, labels_def = jax.tree.structure(params), jax.tree.structure(labels)
    if params_def != labels_def:
        raise ConfigError(
            f"optimizer labels do not match the parameters: labels {labels_def}, "
            f"params {params_def}; label every parameter leaf exactly once"
        )
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), label in zip(paths, jax.tree.leaves(labels), strict=True):
        if label == "matrix" and leaf.ndim < 2:
            raise ConfigError(
                f"parameter {jax.tree_util.keystr(path)} is labelled 'matrix' but has shape "
                f"{leaf.shape}; a matrix needs its last two axes (d_in, d_out)"
            )


def _matrix_dims(updates: Any) -> Any:
    """Muon dimension numbers: last two axes (reduction, output), leading axes are batch."""
    return jax.tree.map(lambda x: MuonDimensionNumbers(x.ndim - 2, x.ndim - 1), updates)


def build_optimizer(
    config: OptimizerConfig, lr: Schedule | float, labels: Any
) -> optax.GradientTransformationExtraArgs:
    """An optax optimizer for params labelled by `labels` (same pytree structure as the params,
    leaves "matrix" | "embedding" | "vector"); `lr(step)` is the schedule's lr at each step.

    init raises ConfigError if the params do not match the labels or a "matrix" has rank < 2.
    """
    config.validate()
    _check_labels(labels)
    schedule: Schedule = lr if callable(lr) else (lambda step: lr)

    def adamw(weight_decay: float, mask: Any = None) -> optax.GradientTransformation:
        return optax.adamw(
            schedule,
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=weight_decay,
            mask=mask,
        )

    if config.name == "adamw":
        decay_mask = jax.tree.map(lambda label: label != "vector", labels)
        inner = adamw(config.weight_decay, decay_mask)
    else:
        ratio = config.muon_lr_ratio
        matrix = muon(
            learning_rate=lambda step: ratio * schedule(step),
            ns_steps=config.muon_ns_steps,
            beta=config.muon_momentum,
            eps=config.eps,
            weight_decay=config.weight_decay,
            muon_weight_dimension_numbers=_matrix_dims,
            consistent_rms=config.muon_consistent_rms,
        )
        inner = optax.partition(
            {
                "matrix": matrix,
                "embedding": adamw(config.weight_decay),
                "vector": adamw(0.0),
            },
            labels,
        )
    if config.clip_norm > 0:
        inner = optax.chain(optax.clip_by_global_norm(config.clip_norm), inner)
    inner = optax.with_extra_args_support(inner)

    def init(params: Any) -> Any:
        _check_params(params, labels)
        return inner.init(params)

    return optax.GradientTransformationExtraArgs(init, inner.update)
