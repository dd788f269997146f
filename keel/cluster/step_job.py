"""The job that runs one step of an experiment (see keel.cluster.steps).

python -m keel.cluster.step_job EXPERIMENT STEP STAGING PREFIX [KEY=VALUE ...]
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from keel.steps import all_steps, load_experiment, override_steps
from keel.steps.context import running_step
from keel.steps.step import output_path, resolve_config
from keel.steps.store import work_dir


def main(arguments: list[str]) -> None:
    experiment, name, staging, prefix, *overrides = arguments
    steps = all_steps(override_steps(load_experiment(Path(experiment)), overrides))
    step = next((s for s in steps if s.name == name), None)
    if step is None:
        raise SystemExit(f"error: {experiment} has no step {name!r}")
    with running_step(output_path(prefix, step), work_dir(prefix, step)):
        step.fn(resolve_config(step.config, prefix), staging)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    main(sys.argv[1:])
