"""Learning-rate schedules: one segment per phase, each ending at an end step it is given.

A segment warms up linearly from `warmup_from * peak_lr` to `peak_lr` over `warmup_steps`, then
follows its kind (warmup-stable-decay, cosine, linear or constant) to `final_fraction * peak_lr`
at its end step and stays there. The end step is an argument, not optimizer state, so resuming
with more or fewer total steps changes only the part of the schedule that has not run yet.
Phases chain segments with `piecewise_lr`; a later phase re-warms by setting `warmup_from` to the
fraction of its peak that the previous phase ended at.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import jax
import jax.numpy as jnp

from keel.core.errors import ConfigError

ScheduleKind = Literal["wsd", "cosine", "linear", "constant"]
DecayShape = Literal["linear", "cosine", "sqrt"]
KINDS: tuple[str, ...] = ("wsd", "cosine", "linear", "constant")
DECAY_SHAPES: tuple[str, ...] = ("linear", "cosine", "sqrt")


@dataclass(frozen=True)
class ScheduleConfig:
    """The learning rate of one segment as a function of its local step (lr in optimizer units)."""

    kind: ScheduleKind = "wsd"
    """"wsd": warmup, stable at peak, decay over the last `decay_fraction` of the steps;
    "cosine" / "linear": decay from peak right after warmup to the end step; "constant": peak
    until the end step."""
    peak_lr: float = 3e-3
    warmup_steps: int = 100
    """Steps of linear warmup at the start of the segment (0: start at peak)."""
    warmup_from: float = 0.0
    """Where warmup starts, as a fraction of peak_lr. Set > 0 to re-warm from a checkpoint's lr
    (e.g. the previous phase's final_fraction)."""
    decay_fraction: float = 0.2
    """wsd only: the last fraction of the segment's steps that decays."""
    final_fraction: float = 0.1
    """The lr at (and after) the end step, as a fraction of peak_lr. All kinds, constant too:
    set 1.0 for a constant lr that never drops."""
    decay_shape: DecayShape = "linear"
    """wsd only: how the decay goes from peak to final: "linear", "cosine" or "sqrt"
    (1 - sqrt(progress))."""

    def validate(self, steps: int | None = None) -> ScheduleConfig:
        """Raise ConfigError naming the first bad setting (also against `steps`); return self."""
        if self.kind not in KINDS:
            raise ConfigError(f"schedule.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ConfigError(
                f"schedule.decay_shape must be one of {', '.join(DECAY_SHAPES)}, "
                f"got {self.decay_shape!r}"
            )
        if not self.peak_lr > 0 or not math.isfinite(self.peak_lr):
            raise ConfigError(f"schedule.peak_lr must be a positive number, got {self.peak_lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("warmup_from", "decay_fraction", "final_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"schedule.{name} must be in [0, 1], got {value}")
        if steps is not None and steps < 1:
            raise ConfigError(f"a schedule segment needs at least 1 step, got steps={steps}")
        return self


def _decay(progress: jax.Array, shape: str) -> jax.Array:
    """Fraction of the way from final back to peak at `progress` in [0, 1]: 1 at 0, 0 at 1."""
    if shape == "linear":
        return 1.0 - progress
    if shape == "cosine":
        return 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return 1.0 - jnp.sqrt(progress)


def segment_lr(step: jax.Array | int, steps: jax.Array | int, config: ScheduleConfig) -> jax.Array:
    """The lr (float32, shaped like `step`) at local `step` of a segment ending at `steps`.

    Jittable: `step` (and `steps`) may be traced ints or arrays of steps. Steps before 0 read
    as step 0; at and after `steps` the lr is `final_fraction * peak_lr`.
    """
    config.validate(steps if isinstance(steps, int) else None)
    peak = jnp.float32(config.peak_lr)
    final = jnp.float32(config.final_fraction * config.peak_lr)
    step = jnp.maximum(jnp.asarray(step, jnp.float32), 0.0)
    end = jnp.asarray(steps, jnp.float32)
    warmup = jnp.float32(config.warmup_steps)

    start = jnp.float32(config.warmup_from * config.peak_lr)
    warm_lr = start + (peak - start) * step / jnp.maximum(warmup, 1.0)

    if config.kind == "constant":
        after = peak
    else:
        if config.kind == "wsd":
            decay_start = jnp.maximum(warmup, end * (1.0 - config.decay_fraction))
            shape = config.decay_shape
        else:
            decay_start = warmup
            shape = config.kind
        progress = jnp.clip((step - decay_start) / jnp.maximum(end - decay_start, 1.0), 0.0, 1.0)
        after = final + (peak - final) * _decay(progress, shape)

    lr = jnp.where(step < warmup, warm_lr, after)
    return jnp.where(step >= end, final, lr)


@dataclass(frozen=True)
class Segment:
    """One phase's schedule over global steps [start_step, start_step + steps)."""

    start_step: int
    steps: int
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps


def piecewise_lr(segments: Sequence[Segment]) -> Callable[[jax.Array | int], jax.Array]:
    """A schedule over the global step (a scalar or an array of steps): the segment holding
    the step gives the lr.

    Segments must tile a contiguous range (no overlaps, no gaps; order does not matter). Steps
    before the first segment read as its step 0, steps after the last as its final lr. The
    result is jittable and fits `optax` as a learning-rate schedule.
    """
    if not segments:
        raise ConfigError("piecewise_lr needs at least one segment; give every phase a schedule")
    ordered = sorted(segments, key=lambda s: s.start_step)
    for segment in ordered:
        if segment.start_step < 0:
            raise ConfigError(f"segment start_step must be >= 0, got {segment.start_step}")
        segment.schedule.validate(segment.steps)
    for before, after in itertools.pairwise(ordered):
        if after.start_step < before.end_step:
            raise ConfigError(
                f"schedule segments overlap: one covers steps {before.start_step}.."
                f"{before.end_step - 1}, the next starts at {after.start_step}"
            )
        if after.start_step > before.end_step:
            raise ConfigError(
                f"schedule segments leave a gap: steps {before.end_step}..{after.start_step - 1} "
                "belong to no segment; make each segment start where the previous one ends"
            )

    def lr(step: jax.Array | int) -> jax.Array:
        step = jnp.asarray(step, jnp.int32)
        value = segment_lr(step - ordered[0].start_step, ordered[0].steps, ordered[0].schedule)
        for segment in ordered[1:]:
            here = segment_lr(step - segment.start_step, segment.steps, segment.schedule)
            value = jnp.where(step >= segment.start_step, here, value)
        return value

    return lr


@dataclass(frozen=True)
class Anchor:
    """A re-planned decay (keel/train/replan.py): from global `step` on, the lr goes from `lr`
    (where the run stood) to `final_lr` at global step `end` in `shape`; from `end` on the
    schedule's own segments apply again (the last one's final lr)."""

    step: int
    lr: float
    end: int
    final_lr: float
    shape: str = "linear"


def anchored_lr(
    base: Callable[[jax.Array | int], jax.Array], anchor: Anchor | None
) -> Callable[[jax.Array | int], jax.Array]:
    """`base` with `anchor`'s decay over steps [anchor.step, anchor.end); `base` itself when
    there is no anchor. Jittable, like `base`."""
    if anchor is None:
        return base
    start, final = jnp.float32(anchor.lr), jnp.float32(anchor.final_lr)
    span = float(max(anchor.end - anchor.step, 1))

    def lr(step: jax.Array | int) -> jax.Array:
        step = jnp.asarray(step, jnp.int32)
        progress = jnp.clip((step - anchor.step).astype(jnp.float32) / span, 0.0, 1.0)
        decayed = final + (start - final) * _decay(progress, anchor.shape)
        inside = (step >= anchor.step) & (step < anchor.end)
        return jnp.where(inside, decayed, base(step))

    return lr
