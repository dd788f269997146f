"""What a run may change when it resumes, and where its data stands after a batch-size change.

On resume the run directory's config.yaml (the config it last trained under) is compared with
the new one (docs/training.md, "What may change on resume"):

- refused, naming the setting: the seed and the compute dtype (another run), and any model
  setting that changes a parameter's shape (d_model, layers, experts, vocabulary, ...): the
  checkpoint could not be restored into it;
- allowed: model settings that keep every parameter's shape (capacity factors, z-loss weights,
  the router's bias rate, the RoPE base and scaling, top_k), a phase's own RoPE base and scaling
  (Phase.rope_*, from the phase's first step or the resume step, whichever is later: nothing
  is stored in a checkpoint for them), the schedule and length (re-planned:
  keel/train/replan.py), phases appended after the resume point (each with its own mixture), and
  the batch size (batch_size, or a phase's batch_tokens), when `steps` fixes the phases' lengths.

The data position is counted once, as sequences drawn per phase: a phase's loader addresses its
batches from (phase step, sequence) (keel.train.loader.MixtureLoader's `position`), so after a
batch change at step r the next batch starts at the first sequence not yet drawn: no window is
drawn twice in an epoch, none skipped. Each change is a `batch` event in events.jsonl (step,
phase, the position, old and new batch size); a later resume reads the positions back.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from typing import Any

import jax

from keel.core.errors import UsageError
from keel.model.config import ModelConfig
from keel.model.transformer import init_params
from keel.train.config import TrainConfig
from keel.train.events import read_events

logger = logging.getLogger(__name__)

BATCH_EVENT = "batch"
FIXED_KEYS = ("seed", "compute_dtype")
"""Settings a resume may not change: another value trains another run."""


def check_resume_changes(previous: TrainConfig, config: TrainConfig, run_dir: str) -> None:
    """Raise UsageError (one line, naming the settings) for a change a resume cannot make."""
    fixed = [key for key in FIXED_KEYS if getattr(previous, key) != getattr(config, key)]
    if fixed:
        raise UsageError(
            f"{run_dir} holds a run with other {', '.join(fixed)}: resuming it would mix two "
            "runs; use another --output (or delete that directory)"
        )
    if previous.model != config.model and not _same_shapes(previous.model, config.model):
        changed = ", ".join(
            f"model.{name} ({getattr(previous.model, name)} -> {getattr(config.model, name)})"
            for name in _shape_changers(previous.model, config.model)
        )
        raise UsageError(
            f"{run_dir}: {changed} changes the parameters' shapes, which a resume cannot do; "
            "train a new run (init_from or --from start one from this one's weights)"
        )
    if previous.batch_size != config.batch_size and not config.steps:
        raise UsageError(
            f"{run_dir}: batch_size {previous.batch_size} -> {config.batch_size} on resume needs "
            "`steps` set: with token budgets alone the phases' lengths would move under the run"
        )
    for index, (before, now) in enumerate(zip(previous.phases, config.phases, strict=False)):
        if before.batch_tokens != now.batch_tokens and not config.steps:
            raise UsageError(
                f"{run_dir}: phases.{index}.batch_tokens {before.batch_tokens} -> "
                f"{now.batch_tokens} on resume needs `steps` set: with token budgets alone the "
                "phases' lengths would move under the run"
            )


def data_positions(
    run_dir: str, config: TrainConfig, previous: TrainConfig | None, resumed_from: int | None
) -> tuple[dict[int, tuple[int, int]], dict[str, Any] | None]:
    """(phase index -> (phase step, sequence) its loader starts from, the `batch` event to
    record when resuming at `resumed_from` changed the batch size; None otherwise)."""
    positions = {
        event["phase"]: (event["phase_step"], event["sequences"])
        for event in read_events(run_dir, BATCH_EVENT)
    }
    if resumed_from is None or previous is None:
        return positions, None
    segments = config.segments()
    phase = next((i for i, segment in enumerate(segments) if resumed_from < segment.end_step), None)
    if phase is None or phase >= len(previous.phases):  # at its end, or in an appended phase
        return positions, None
    before = previous.phases[phase].sequences_per_step(previous.batch_size)
    after = config.phases[phase].sequences_per_step(config.batch_size)
    if before == after:
        return positions, None
    step = resumed_from - segments[phase].start_step
    first_step, first_sequence = positions.get(phase, (0, 0))
    sequences = first_sequence + (step - first_step) * before
    positions[phase] = (step, sequences)
    event = {
        "event": BATCH_EVENT,
        "step": resumed_from,
        "phase": phase,
        "phase_step": step,
        "sequences": sequences,
        "from": before,
        "to": after,
    }
    logger.info(
        "batch size %d -> %d at step %d: phase %d continues at sequence %d",
        before,
        after,
        resumed_from,
        phase,
        sequences,
    )
    return positions, event


def _same_shapes(before: ModelConfig, now: ModelConfig) -> bool:
    """Whether the two models' parameters have the same tree, shapes and dtypes (traced)."""
    a, b = (jax.eval_shape(lambda m=m: init_params(jax.random.key(0), m)) for m in (before, now))
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        (x.shape, x.dtype) == (y.shape, y.dtype)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _shape_changers(before: ModelConfig, now: ModelConfig) -> list[str]:
    """The model settings that change a parameter's shape on their own (all changed settings,
    when only their combination does)."""
    names = [f.name for f in fields(ModelConfig)]
    changed = [name for name in names if getattr(before, name) != getattr(now, name)]
    alone = [
        name
        for name in changed
        if not _same_shapes(before, replace(before, **{name: getattr(now, name)}))
    ]
    return alone or changed
