"""Re-planning the learning rate when a run resumes with another length or decay target.

A run directory keeps the config it last trained under (config.yaml) and, in events.jsonl, the
re-plans made so far. When a run resumes at step r under a config whose schedule differs (another
`--steps`, phase budget, final_fraction, ...):

- the lr the run stands at, `current`, is the previous plan's lr at r (its own re-plan included);
- in the new plan the phase holding r decays from its decay start (wsd: max(warmup, end x (1 -
  decay_fraction)); cosine and linear: the end of warmup; constant: its end);
- before that decay start, while the run has not begun decaying (`current` is the new plan's lr
  at r), the configured schedule runs with its new end: nothing is anchored; nor at the first
  step of a phase (one appended on resume): its own schedule, warmup included, applies;
- otherwise the lr decays from `current` at r to the phase's final lr (final_fraction x peak_lr)
  at its new end, in the phase's decay shape (wsd's decay_shape, or its kind): an Anchor.

So the lr never jumps at the resume step and never rises after it; re-warming is what a new phase
with `warmup_from` is for. Each re-plan is a "replan" event (old and new plan, the lr at r, the
anchor), and a later resume under the same plan keeps the last anchor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import jax

from keel.core.errors import UsageError
from keel.train.config import TrainConfig
from keel.train.events import read_events
from keel.train.schedule import Anchor, ScheduleConfig, Segment, anchored_lr, piecewise_lr

logger = logging.getLogger(__name__)

REPLAN_EVENT = "replan"


def resume_schedule(
    config: TrainConfig, run_dir: str, previous: TrainConfig | None, resumed_from: int | None
) -> tuple[Callable[[jax.Array | int], jax.Array], dict[str, Any] | None]:
    """The run's lr schedule over the global step, and the re-plan event to record when
    resuming at `resumed_from` re-planned it (None: the plan is unchanged, or a fresh run)."""
    base = piecewise_lr(config.segments())
    replans = read_events(run_dir, REPLAN_EVENT)
    anchor = _anchor(replans[-1]["anchor"]) if replans else None
    if resumed_from is None or previous is None or previous.segments() == config.segments():
        return anchored_lr(base, anchor), None
    step = resumed_from
    if step >= config.total_steps:
        raise UsageError(
            f"{run_dir} stands at step {step}; a plan of {config.total_steps} steps ends before "
            f"it: give --steps more than {step} (or use another --output)"
        )
    current = float(anchored_lr(piecewise_lr(previous.segments()), anchor)(step))
    segment = next(s for s in config.segments() if s.start_step <= step < s.end_step)
    schedule = segment.schedule
    anchor = None
    inside = step > segment.start_step  # at a phase's first step, the phase's own schedule
    if inside and (step >= decay_start(segment) or current < float(base(step)) * (1 - 1e-6)):
        anchor = Anchor(
            step=step,
            lr=current,
            end=segment.end_step,
            final_lr=schedule.final_fraction * schedule.peak_lr,
            shape=_shape(schedule),
        )
    event = {
        "event": REPLAN_EVENT,
        "step": step,
        "old": _plan(previous),
        "new": _plan(config),
        "lr": current,
        "anchor": None if anchor is None else asdict(anchor),
    }
    logger.info(
        "re-planned the schedule at step %d: %d -> %d steps; %s",
        step,
        previous.total_steps,
        config.total_steps,
        "the configured schedule runs on"
        if anchor is None
        else f"lr {current:.3g} decays to {anchor.final_lr:.3g} at step {anchor.end}",
    )
    return anchored_lr(base, anchor), event


def decay_start(segment: Segment) -> int:
    """The global step where `segment`'s lr starts to fall towards its final value."""
    schedule, steps = segment.schedule, segment.steps
    if schedule.kind == "wsd":
        local = max(schedule.warmup_steps, steps * (1.0 - schedule.decay_fraction))
    elif schedule.kind == "constant":
        local = steps
    else:
        local = schedule.warmup_steps
    return segment.start_step + int(local)


def _shape(schedule: ScheduleConfig) -> str:
    if schedule.kind == "wsd":
        return schedule.decay_shape
    return schedule.kind if schedule.kind == "cosine" else "linear"


def _plan(config: TrainConfig) -> dict[str, Any]:
    """A plan as an event shows it: total steps and each phase's steps and schedule."""
    return {
        "total_steps": config.total_steps,
        "phases": [
            {"start": s.start_step, "steps": s.steps, "schedule": asdict(s.schedule)}
            for s in config.segments()
        ],
    }


def _anchor(stored: dict[str, Any] | None) -> Anchor | None:
    return None if stored is None else Anchor(**stored)
