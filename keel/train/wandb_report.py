"""`keel train --report-to wandb`: the trainer's metrics and config mirrored to a W&B run.

The run's config is the TrainConfig as config.yaml holds it; each metrics line is logged at its
step with nested values flattened as telemetry names them (router.drop_rate.3 is layer 3's), so
the W&B history equals metrics.jsonl and its summary the last values (result.json). The
experiment record (KEEL_EXPERIMENT) becomes a tag. wandb is imported only when a run reports to
it; offline mode (WANDB_MODE=offline) writes the run under WANDB_DIR with no network or account.
"""

from __future__ import annotations

import os
from typing import Any

from keel.core.config import to_dict
from keel.core.errors import UsageError
from keel.core.experiment_id import current_experiment
from keel.telemetry.sink import flatten
from keel.train.config import TrainConfig

REPORT_TARGETS = ("wandb",)
"""What `--report-to` accepts."""
PROJECT_ENV = "WANDB_PROJECT"
DEFAULT_PROJECT = "keel"
INSTALL_HINT = "--report-to wandb needs the wandb package: pip install 'keel[wandb]'"


def check_report_target(target: str) -> str:
    """`target` if keel can report to it (and its library is installed); UsageError if not."""
    if target not in REPORT_TARGETS:
        raise UsageError(f"--report-to {target!r}: use one of {', '.join(REPORT_TARGETS)}")
    _import_wandb()
    return target


class WandbRun:
    """One W&B run mirroring one training run; `log` takes the trainer's metrics lines
    (`on_step`), `finish` closes the run. A context manager."""

    def __init__(self, config: TrainConfig, output: str, name: str) -> None:
        wandb = _import_wandb()
        experiment = current_experiment()
        self.run = wandb.init(
            project=os.environ.get(PROJECT_ENV, DEFAULT_PROJECT),
            name=name,
            config=to_dict(config),
            notes=f"keel run directory: {output}",
            tags=[f"experiment:{experiment}"] if experiment else None,
        )

    def __enter__(self) -> WandbRun:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self.run.finish(exit_code=0 if kind is None else 1)

    def log(self, line: dict[str, Any]) -> None:
        """One metrics line at its step (numbers only; the phase name is text)."""
        values = {name: value for name, value in flatten(line) if name != "step"}
        self.run.log(values, step=int(line["step"]))


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    return wandb
