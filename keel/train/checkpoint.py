"""Checkpoints under OUTPUT/checkpoints/<step>/ with Orbax: parameters, optimizer state, router
bias, step, the RNG key and the balancing rule's state (when it has one). The data position is
not saved: the batch at a step is a pure function of (seed, step). Orbax writes a checkpoint
into a temporary directory and renames it when complete, so a run killed mid-save leaves the
previous checkpoint as the latest.

A run directory on object storage (an fsspec URL: s3://, gs://) holds the same files: the
checkpoints are written to a local working copy and each one is uploaded after its save, the
latest downloaded before a restore (keel.train.run_dir, whose `commit` is the one function that
uploads). Orbax cannot write there directly: orbax-checkpoint 0.12.8 takes the path as an
etils.epath.Path, which turns s3://bucket/run into the relative local path s3:/bucket/run and
fails ("Checkpoint path should be absolute"; tried against a moto S3 server, Dec 2026); Orbax
builds its tensorstore spec from that path, so tensorstore's own s3 driver is not reachable with
a custom endpoint either. The copy costs one upload per checkpoint and a local disk as large as
the checkpoints kept, and works with every fsspec filesystem (s3fs, gcsfs, ...) and its usual
credentials.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import jax
import orbax.checkpoint as ocp

from keel.core import paths
from keel.core.errors import UsageError
from keel.train.run_dir import CONFIG_FILE, RunMirror

CHECKPOINTS_DIR = "checkpoints"

logger = logging.getLogger(__name__)


class _ReadOnlyNotice(logging.Filter):
    """Drops Orbax's warnings that a read-only manager is read only ("Given directory is read
    only", "CheckpointManagerOptions.read_only=True, setting max_to_keep=None", ...): keel
    opens a run read-only on purpose (sample, eval, export, a run started from another's
    checkpoint), so every such command printed four warnings as if something were wrong."""

    NOTICES = ("Given directory is read only", "CheckpointManagerOptions.read_only=True")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.NOTICES)


logging.getLogger("absl").addFilter(_ReadOnlyNotice())


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
    balance_state: Any = None
    """The balancing rule's state stacked over MoE layers (keel.model.balance; "histogram": its
    window of histograms); None for a rule without state, which leaves checkpoints as before."""


class Checkpoints:
    """The checkpoints of one run directory (a local path or an fsspec URL): every `every`
    steps and at the end, the newest `keep` kept. For a URL, the latest checkpoint and the
    `carried` files (relative to the run directory, e.g. metrics.jsonl) are downloaded into the
    working copy (`run.local`) now, and each save uploads the carried files with the new
    checkpoint."""

    def __init__(
        self,
        run_dir: str,
        every: int,
        keep: int,
        carried: tuple[str, ...] = (),
        *,
        keep_every: int = 0,
        read_step: int | None = None,
    ) -> None:
        """`keep_every` > 0 also keeps, for good, every checkpoint whose step is a multiple of
        it. `read_step` opens the run read-only (another run's, to start from): nothing is
        ever written or deleted there, and for a URL that checkpoint (default: the latest) is
        the one downloaded."""
        self.run = RunMirror(run_dir, CHECKPOINTS_DIR)
        self.carried = carried
        committed = self.run.committed_steps() if self.run.remote else []
        fetched = read_step if read_step is not None else (committed[-1] if committed else None)
        self.run.fetch(carried, fetched if fetched in committed else None)
        directory = self.run.local / CHECKPOINTS_DIR
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            keep_period=keep_every or None,
            enable_async_checkpointing=False,
            read_only=read_step is not None,
        )
        self.every = every
        self.directory = paths.join(self.run.run_dir, CHECKPOINTS_DIR)
        """Where the checkpoints are (for messages): the run directory's, not a working copy's."""
        self.manager = ocp.CheckpointManager(
            directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, *, force: bool = False) -> bool:
        """Save when the step is on the interval (or `force`); whether it saved."""
        step = int(state.step)
        if step in self.manager.all_steps() or not (force or step % self.every == 0):
            return False
        self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self.manager.wait_until_finished()
        self.run.commit(self.carried, step, self.manager.all_steps())
        return True

    def restore(self, like: TrainState, step: int | None = None) -> TrainState:
        """The checkpoint at `step` (default: the latest), with `like`'s structure, shapes,
        dtypes and shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise UsageError(f"{self.directory} holds no checkpoint")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        saved = self._saved_balance_state(step, abstract.step.sharding)
        if not _same_arrays(saved, abstract.balance_state):
            # Saved before the balancing rule kept state (an older keel), under another rule,
            # or with other histogram sizes: the rule starts from `like`'s state, as a fresh
            # run's rule would.
            logger.info("checkpoint %d: the balancing rule's state starts afresh", step)
            restored = self.manager.restore(
                step, args=ocp.args.StandardRestore(replace(abstract, balance_state=saved))
            )
            return replace(restored, balance_state=like.balance_state)
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def _saved_balance_state(self, step: int, sharding: Any) -> Any:
        """The balancing rule's state in the checkpoint at `step` as ShapeDtypeStructs placed
        with `sharding` (None when it holds none)."""
        tree = self.manager.item_metadata(step).tree.get("balance_state")
        return jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            tree,
            is_leaf=lambda node: hasattr(node, "shape"),
        )

    def close(self) -> None:
        """Close the manager; a working copy is removed (every checkpoint in it is uploaded)."""
        self.manager.close()
        self.run.close()


def _same_arrays(a: Any, b: Any) -> bool:
    """Whether two trees of arrays (or ShapeDtypeStructs) have one structure, shapes, dtypes."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    same = jax.tree.map(lambda x, y: x.shape == y.shape and x.dtype == y.dtype, a, b)
    return all(jax.tree.leaves(same))


def committed_checkpoint_steps(run: str, where: str = "") -> list[int]:
    """The steps of `run`'s committed checkpoints, ascending (listed, nothing downloaded), after
    checking that `run` (a local path or a URL) is a keel run: UsageError "{where}RUN holds no keel
    run" otherwise."""
    if not paths.exists(paths.join(run, CONFIG_FILE)):
        raise UsageError(f"{where}{run} holds no keel run (no {CONFIG_FILE})")
    listing = RunMirror(run, CHECKPOINTS_DIR)
    try:
        return listing.committed_steps()
    finally:
        listing.close()
