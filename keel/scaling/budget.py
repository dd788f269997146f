"""Training runs at a compute budget, and what a finished run contributes to a fit.

A budget C (FLOPs) buys D = C / flops_per_token(model, seq_len) tokens (keel.model.size: 6 x
active matmul parameters + attention, so an MoE is charged for the experts it uses, not the
ones it holds). N, the size a fit sees, is the model's active matmul parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from keel.core import paths
from keel.core.errors import ConfigError, UsageError
from keel.model.size import flops_per_token, model_size
from keel.train.config import TrainConfig
from keel.train.trainer import METRICS_FILE, RESULT_FILE


def fit_size(config: TrainConfig) -> int:
    """N for scaling fits: the active matmul parameters of the run's model."""
    return model_size(config.model).active_matmul


def tokens_per_step(config: TrainConfig) -> int:
    return config.batch_size * config.phases[-1].seq_len


def flops_per_step(config: TrainConfig) -> float:
    """Training FLOPs of one step of the run's (last) phase: FLOPs per token x tokens per step."""
    return flops_per_token(config.model, config.phases[-1].seq_len) * tokens_per_step(config)


def at_budget(config: TrainConfig, flops: float) -> TrainConfig:
    """`config` (one phase) trained for the steps `flops` FLOPs buy: steps = C / (FLOPs per
    token x tokens per step), rounded, at least 1; warmup capped at a tenth of them."""
    if len(config.phases) != 1:
        raise ConfigError("a budgeted run has one phase; give the sweep a single-phase config")
    phase = config.phases[0]
    steps = max(1, round(flops / flops_per_step(config)))
    warmup = min(phase.schedule.warmup_steps, max(steps // 10, 1))
    schedule = replace(phase.schedule, warmup_steps=warmup)
    return replace(config, steps=steps, phases=(replace(phase, tokens=0, schedule=schedule),))


@dataclass(frozen=True)
class RunPoint:
    """One finished run as a fit sees it."""

    params: int
    """N: active matmul parameters."""
    tokens: int
    """D: tokens trained on."""
    flops: float
    """C: FLOPs spent (flops_per_token x D)."""
    loss: float
    """Final held-out loss (nats per token), or the last training loss without evaluation."""
    tokens_per_s: float
    """Median training throughput over the run's steps after the first (compilation)."""


def read_run(run_dir: str, config: TrainConfig) -> RunPoint:
    """The RunPoint of a finished run directory trained with `config`."""
    result_path = paths.join(run_dir, RESULT_FILE)
    if not paths.exists(result_path):
        raise UsageError(f"{run_dir} has no {RESULT_FILE}: the run did not finish")
    result = json.loads(paths.read_text(result_path))
    lines = paths.read_text(paths.join(run_dir, METRICS_FILE)).splitlines()
    speeds = sorted(json.loads(line)["tokens_per_s"] for line in lines[1:] if line.strip())
    seq_len = config.phases[-1].seq_len
    tokens = result["step"] * tokens_per_step(config)
    return RunPoint(
        params=fit_size(config),
        tokens=tokens,
        flops=flops_per_token(config.model, seq_len) * tokens,
        loss=float(result.get("eval_loss", result["loss"])),
        tokens_per_s=float(speeds[len(speeds) // 2]) if speeds else float("nan"),
    )
