"""Branches: `keel train CONFIG --from RUN:STEP --output NEW` starts a new run from another run's
checkpoint and follows its own config from there (typically a cooldown, or another mixture).

The branch takes RUN's state at STEP whole (parameters, optimizer state, router bias, step
counter and RNG key), so with RUN's own config it continues exactly as RUN did. RUN is only read
(its checkpoints opened read-only; for a URL, the one checkpoint is downloaded). The branch
records its parent in its own run directory (a `branch` event in events.jsonl: parent run, step,
both configs' identities) and in telemetry (`train.events`), never in any step identity, so
`keel runs lineage RUN` can walk any run's ancestry. Checkpoints a branch may start from later
are kept with `keep_every`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keel.core import paths
from keel.core.config import load_config
from keel.core.errors import UsageError
from keel.train.checkpoint import (
    CHECKPOINTS_DIR,
    Checkpoints,
    TrainState,
    committed_checkpoint_steps,
)
from keel.train.config import TrainConfig
from keel.train.events import read_events
from keel.train.run_dir import CONFIG_FILE

BRANCH_EVENT = "branch"


@dataclass(frozen=True)
class BranchPoint:
    """A run directory (local path or URL) and one of its checkpoint steps."""

    run: str
    step: int

    def __str__(self) -> str:
        return f"{self.run}:{self.step}"


def parse_branch_point(text: str) -> BranchPoint:
    """`RUN:STEP`, split at the last colon (so `s3://bucket/run:20` works)."""
    run, colon, step = text.rpartition(":")
    if not colon or not run or not step.isdigit():
        raise UsageError(f"--from {text!r}: expected RUN:STEP, e.g. runs/main:2000")
    return BranchPoint(run, int(step))


def parent_config(point: BranchPoint, config: TrainConfig) -> TrainConfig:
    """The parent run's config; raise UsageError (one line) when the run or its checkpoint at
    the step does not exist, or when its model cannot be continued by `config`'s."""
    steps = committed_checkpoint_steps(point.run, where=f"--from {point}: ")
    parent = load_config(paths.join(point.run, CONFIG_FILE), TrainConfig)
    if point.step not in steps:
        listed = ", ".join(map(str, steps)) or "none"
        raise UsageError(
            f"--from {point}: {point.run} has no checkpoint at step {point.step}; its "
            f"checkpoints: {listed} (keep_every keeps more)"
        )
    for name in ("model", "optimizer"):
        if getattr(parent, name) != getattr(config, name):
            raise UsageError(
                f"--from {point}: this config's {name} differs from the run's; a branch "
                "continues the same model and optimizer (change schedules, data, batch)"
            )
    return parent


def branch_state(point: BranchPoint, like: TrainState) -> TrainState:
    """The parent's whole state at the step, laid out like `like` (this run's layout)."""
    source = Checkpoints(point.run, every=1, keep=1, read_step=point.step)
    try:
        return source.restore(like, point.step)
    finally:
        source.close()


def branch_event(point: BranchPoint, parent: TrainConfig, config: TrainConfig) -> dict[str, Any]:
    return {
        "event": BRANCH_EVENT,
        "step": point.step,
        "parent": point.run,
        "parent_config": parent.identity(),
        "config": config.identity(),
    }


@dataclass(frozen=True)
class Ancestor:
    """One link of a run's lineage: `run` branched from `parent` at `step`."""

    run: str
    parent: str
    step: int
    parent_config: str


def lineage(run: str, limit: int = 1000) -> list[Ancestor]:
    """`run`'s ancestry, nearest first: each run and the parent it branched from (empty: a run
    that started from scratch)."""
    if not paths.exists(paths.join(run, CONFIG_FILE)) and not paths.exists(
        paths.join(run, CHECKPOINTS_DIR)
    ):
        raise UsageError(f"{run} holds no keel run")
    links: list[Ancestor] = []
    seen = {paths.normalize(run)}
    while len(links) < limit:
        branches = read_events(run, BRANCH_EVENT)
        if not branches:
            break
        event = branches[0]
        links.append(Ancestor(run, event["parent"], event["step"], event["parent_config"]))
        run = event["parent"]
        if paths.normalize(run) in seen:  # a copied directory pointing at itself
            break
        seen.add(paths.normalize(run))
    return links
