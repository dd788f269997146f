"""Steps as cluster jobs: `keel run EXPERIMENT --cluster NAME`.

The step executor keeps its caching, locks and atomic commit in the coordinating process; only a
step's function runs elsewhere: as a job (`python -m keel.cluster.step_job ...`) that loads the
experiment file, finds the step by name and runs its function into the staging directory the
executor chose. The staging directory must be visible to the job (this machine, or a file system
the cluster shares). The coordinator waits for the job and fails the step with the job's reason.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from keel.cluster import daemon, state
from keel.cluster.spec import JobSpec, Resources
from keel.core.errors import KeelError
from keel.steps import Step

POLL_SECONDS = 0.5


class StepJobFailed(KeelError):
    """The job running a step failed; the message has its reason and where its output is."""


class ClusterSteps:
    """An `execute` for keel.steps.run that runs each step as a job on one cluster."""

    def __init__(
        self,
        experiment: Path,
        prefix: str,
        overrides: list[str],
        *,
        cluster: str,
        root: Path,
        config: str | None = None,
        resources: Resources | None = None,
    ) -> None:
        self.experiment = experiment.resolve()
        self.prefix = prefix
        self.overrides = overrides
        self.cluster = cluster
        self.root = root
        self.config = config
        self.resources = resources or Resources()

    def __call__(self, step: Step, config: Any, staging: str) -> None:
        command = [sys.executable, "-m", "keel.cluster.step_job", str(self.experiment), step.name]
        command += [staging, self.prefix, *self.overrides]
        # The job sees this process's KEEL_* settings and PYTHONPATH (the controller's own
        # environment may be older: it can outlive the command that started it).
        forwarded = {
            key: value
            for key, value in os.environ.items()
            if key.startswith("KEEL_") or key == "PYTHONPATH"
        }
        spec = JobSpec(
            tuple(command),
            name=f"step {step.name}",
            resources=self.resources,
            env=forwarded,
            cluster=self.cluster,
            workdir=str(Path.cwd()),
        ).validate()
        database = state.connect(self.root / "state.db")
        try:
            job_id = state.submit(database, spec)
            if daemon.running_controller(self.root) is None:
                daemon.start_embedded(self.root, self.config)
            while True:
                status = state.job_status(database, job_id)
                if status["state"] in state.FINAL_JOB_STATES:
                    break
                if daemon.running_controller(self.root) is None:  # the embedded one went idle
                    daemon.start_embedded(self.root, self.config)
                time.sleep(POLL_SECONDS)
        finally:
            database.close()
        if status["state"] != "succeeded":
            output = self.root / "tasks" / job_id
            raise StepJobFailed(
                f"job {job_id} on {self.cluster} {status['state']}: {status['reason']} "
                f"(output under {output})"
            )
