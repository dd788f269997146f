"""Steps as cluster jobs: `keel run EXPERIMENT --cluster NAME`.

The step executor keeps its caching, locks and atomic commit in the coordinating process; only a
step's function runs elsewhere: as a job (`python -m keel.cluster.step_job ...`) that loads the
experiment file, finds the step by name and runs its function into the staging directory the
executor chose. The staging directory must be visible to the job (this machine, or a file system
the cluster shares). The coordinator waits for the job and fails the step with the job's reason.

The job sees this process's `KEEL_*` settings and PYTHONPATH (the controller's own environment
may be older: it can outlive the command that started it), except variables whose names look
secret (TOKEN, SECRET, KEY, PASSWORD; keel.cluster.secrets): those go only when named, by
`forward` or by `forward_env` in clusters.yaml.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from keel.cluster import daemon, state
from keel.cluster.config import load_federation
from keel.cluster.secrets import is_secret_name
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
        forward: Sequence[str] = (),
    ) -> None:
        self.experiment = experiment.resolve()
        self.prefix = prefix
        self.overrides = overrides
        self.cluster = cluster
        self.root = root
        self.config = config
        self.resources = resources or Resources()
        self.forward = (*forward, *load_federation(config).forward_env)

    def __call__(self, step: Step, config: Any, staging: str) -> None:
        command = [sys.executable, "-m", "keel.cluster.step_job", str(self.experiment), step.name]
        command += [staging, self.prefix, *self.overrides]
        forwarded = forwarded_env(os.environ, self.forward)
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
            daemon.ensure_controller(self.root, self.config)
            while True:
                status = state.job_status(database, job_id)
                if status["state"] in state.FINAL_JOB_STATES:
                    break
                daemon.ensure_controller(self.root, self.config)  # the embedded one went idle
                time.sleep(POLL_SECONDS)
        finally:
            database.close()
        if status["state"] != "succeeded":
            output = self.root / "tasks" / job_id
            raise StepJobFailed(
                f"job {job_id} on {self.cluster} {status['state']}: {status['reason']} "
                f"(output under {output})"
            )


def forwarded_env(environ: Mapping[str, str], named: Sequence[str] = ()) -> dict[str, str]:
    """What a step job gets from `environ`: KEEL_* settings and PYTHONPATH, less the variables
    whose names look secret; plus every variable in `named` that is set."""
    forwarded = {
        key: value
        for key, value in environ.items()
        if (key.startswith("KEEL_") and not is_secret_name(key)) or key == "PYTHONPATH"
    }
    forwarded.update((key, environ[key]) for key in named if key in environ)
    return forwarded
