"""lm-eval tasks scored during training (TrainConfig.eval_tasks): every eval_tasks_every steps and
at the last step, the run's current parameters answer the tasks through `keel eval`'s adapter
(no checkpoint round trip), and each metric joins that step's metrics line as
`eval_task/<task>/<metric>` (lm-eval's `metric,filter` name, `,none` dropped: wikitext_cloze
gives eval_task/wikitext_cloze/acc and .../acc_norm).

A score equals what `keel eval RUN --step STEP --limit eval_tasks_limit` gives on that step's
checkpoint: the same scorer on the same parameters, copied to one device as load_trained
restores them (in a gang, gathered from every process; only process 0 scores, the others go on
to the next update and wait for it there). The tasks are checked, lm-eval imported and bundled
task data written once, before training starts; a run without eval_tasks imports none of it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import jax

from keel.core.errors import UsageError
from keel.train import distributed
from keel.train.config import TrainConfig
from keel.train.eval_tasks import require_lm_eval, task_configs
from keel.train.trained import TrainedModel

logger = logging.getLogger(__name__)

METRIC_PREFIX = "eval_task"
TASK_FILE_SUFFIXES = (".yaml", ".yml")
"""An eval_tasks entry ending so is a task YAML's path; any other is a task name."""
NO_FILTER = ",none"
"""lm-eval's suffix of a metric without a filter, left out of keel's metric names."""


class TaskScores:
    """The run's eval_tasks, checked and built once; `scores` runs them on a training state."""

    def __init__(self, config: TrainConfig, run: str, tokenizer_path: str, eos_id: int) -> None:
        """UsageError (one line) for a missing lm-eval, an unknown task name or a bad task
        file. `tokenizer_path` and `eos_id`: those of the run's token caches."""
        require_lm_eval("eval_tasks")
        from tokenizers import Tokenizer

        # Nothing downloads: datasets and lm-eval read the tasks' local files only.
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.config, self.run = config, run
        self.tokenizer_path, self.eos_id = tokenizer_path, eos_id
        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self._work = tempfile.TemporaryDirectory(prefix="keel-eval-tasks-")
        files = [t for t in config.eval_tasks if t.endswith(TASK_FILE_SUFFIXES)]
        names = [t for t in config.eval_tasks if not t.endswith(TASK_FILE_SUFFIXES)]
        try:
            self.task_configs = task_configs(names, files, Path(self._work.name))
        except UsageError as error:
            self.close()
            raise UsageError(f"eval_tasks: {error}") from error

    def scores(self, params: Any, router_bias: jax.Array | None, step: int) -> dict[str, float]:
        """`eval_task/<task>/<metric>` -> value for the parameters after `step` updates, on
        process 0 ({} on the others, which only help gather the parameters)."""
        from keel.train.evaluate import run_tasks
        from keel.train.lm_eval_adapter import KeelLM
        from keel.train.lm_scoring import Scorer

        params, router_bias = on_one_device((params, router_bias))
        if not distributed.is_primary():
            return {}
        trained = TrainedModel(
            self.run, step, self.config, params, router_bias, self.tokenizer_path, self.eos_id
        )
        max_length = max(phase.seq_len for phase in self.config.phases)  # as keel eval reads
        model = KeelLM(Scorer(trained, max_length), self.tokenizer)
        limit = self.config.eval_tasks_limit or None
        tasks, _ = run_tasks(model, self.task_configs, limit)
        return {
            f"{METRIC_PREFIX}/{task}/{metric.removesuffix(NO_FILTER)}": value
            for task, metrics in tasks.items()
            for metric, value in metrics.items()
        }

    def close(self) -> None:
        """Remove the bundled tasks' data files."""
        self._work.cleanup()


def on_one_device(tree: Any) -> Any:
    """`tree`'s arrays on this process's first device, whatever mesh they are sharded over; in a
    gang (arrays other processes hold parts of), every process must call it: it gathers."""
    device = jax.local_devices()[0]
    if all(leaf.is_fully_addressable for leaf in jax.tree.leaves(tree)):
        return jax.device_put(tree, device)
    from jax.experimental import multihost_utils

    return jax.device_put(multihost_utils.process_allgather(tree, tiled=True), device)
