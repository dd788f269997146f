"""Training as a keel step: `train_step("train", config)` trains `config` as the step's output.
The config (model, optimizer, phases, and the token caches, which may be `output_of(tokenize_step)`)
is the step's identity, so changing any of it retrains.

The run trains in the step's work directory (keel.steps.context.step_work_dir), which outlives a
killed attempt, so a rerun of the step resumes from the last checkpoint exactly as `keel train
--output DIR` run again does; the finished run directory (checkpoints included) is then moved into
the step's staging directory and committed with it.
"""

from __future__ import annotations

from keel.core import paths
from keel.steps import Step
from keel.steps.context import step_work_dir
from keel.train.config import TrainConfig
from keel.train.trainer import train


def run_train(config: TrainConfig, output: str) -> None:
    run_dir = step_work_dir() or output
    train(config, run_dir)
    if run_dir != output:
        paths.move_tree(run_dir, output)


def train_step(name: str, config: TrainConfig, version: str | None = None) -> Step:
    return Step(name, run_train, config, version)
