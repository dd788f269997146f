"""Training as a keel step: `train_step("train", config)` runs `train(config, output)` into the
step's output directory. The config (model, optimizer, phases, and the token caches, which may be
`output_of(tokenize_step)`) is the step's identity, so changing any of it retrains."""

from __future__ import annotations

from keel.steps import Step
from keel.train.config import TrainConfig
from keel.train.trainer import train


def run_train(config: TrainConfig, output: str) -> None:
    train(config, output)


def train_step(name: str, config: TrainConfig, version: str | None = None) -> Step:
    return Step(name, run_train, config, version)
