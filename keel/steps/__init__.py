"""Content-addressed steps: a DAG of cached, atomically committed, locked units of work.

    from keel.steps import Step, output_of

See docs/steps.md for writing an experiment, and the modules for the contracts: step.py (identity,
references), executor.py (running), store.py (layout on disk), lock.py (one runner per step).
"""

from keel.steps.executor import Outcome, PlannedStep, RunReport, plan, run
from keel.steps.experiment import load_experiment, override_steps
from keel.steps.lock import LockSettings
from keel.steps.record import Status, StepRecord
from keel.steps.step import Step, StepRef, all_steps, output_of, output_path
from keel.steps.store import StepStore

__all__ = [
    "LockSettings",
    "Outcome",
    "PlannedStep",
    "RunReport",
    "Status",
    "Step",
    "StepRecord",
    "StepRef",
    "StepStore",
    "all_steps",
    "load_experiment",
    "output_of",
    "output_path",
    "override_steps",
    "plan",
    "run",
]
