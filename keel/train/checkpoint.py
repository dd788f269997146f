"""Checkpoints under OUTPUT/checkpoints/<step>/ with Orbax: parameters, optimizer state, router
bias, step and the RNG key. The data position is not saved: the batch at a step is a pure
function of (seed, step). Orbax writes a checkpoint into a temporary directory and renames it
when complete, so a run killed mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import orbax.checkpoint as ocp

from keel.core import paths
from keel.core.errors import UsageError

CHECKPOINTS_DIR = "checkpoints"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TrainState:
    """Everything a run needs to continue exactly."""

    params: Any
    """ModelParams, float32."""
    opt_state: Any
    """The optax optimizer state."""
    router_bias: jax.Array | None
    """[n_moe_layers, n_routed_experts] float32; None for a dense model."""
    step: jax.Array
    """[] int32: updates done."""
    rng: jax.Array
    """[2] uint32 key data: the run's random key (seeded, advanced only by code that draws)."""


class Checkpoints:
    """The checkpoints of one run directory: every `every` steps and at the end, the newest
    `keep` kept."""

    def __init__(self, run_dir: str, every: int, keep: int) -> None:
        directory = paths.local_path(paths.join(run_dir, CHECKPOINTS_DIR)).resolve()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False)
        self.every = every
        self.directory = str(directory)
        self.manager = ocp.CheckpointManager(directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, *, force: bool = False) -> bool:
        """Save when the step is on the interval (or `force`); whether it saved."""
        step = int(state.step)
        if step in self.manager.all_steps() or not (force or step % self.every == 0):
            return False
        self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self.manager.wait_until_finished()
        return True

    def restore(self, like: TrainState, step: int | None = None) -> TrainState:
        """The checkpoint at `step` (default: the latest), with `like`'s structure, shapes,
        dtypes and shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise UsageError(f"{self.directory} holds no checkpoint")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        self.manager.close()
