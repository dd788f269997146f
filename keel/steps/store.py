"""Where steps keep their outputs and their bookkeeping under a prefix.

    {prefix}/{name}-{hash8}/                   committed output (only ever created by a commit)
    {prefix}/{name}-{hash8}/.keel/step.json    its provenance record, status SUCCESS (the marker)
    {prefix}/.keel/steps/{name}-{hash8}/       control directory of that step:
        lock.json                              the heartbeated lock (see lock.py)
        attempt.json                           record of the latest attempt: RUNNING/SUCCESS/FAILED
        staging-{attempt}/                     where an attempt writes before its commit
        work/                                  kept across attempts (a training run's checkpoints),
                                               removed after the commit (context.step_work_dir)

The output directory holds only what the step wrote plus its record, so downstream steps and users
can read it as plain files; a FAILED or interrupted attempt never appears there.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from keel.core import paths
from keel.core.commit import commit_directory, is_committed
from keel.steps.lock import LockInfo, LockSettings, StepLock
from keel.steps.record import Status, StepRecord
from keel.steps.step import Step, output_path

RECORD = ".keel/step.json"
"""The record inside a committed output; written last, so it marks the commit."""

CONTROL_DIR = ".keel/steps"


def work_dir(prefix: str, step: Step) -> str:
    """`{prefix}/.keel/steps/{name}-{hash8}/work`: see StepStore.work_dir."""
    return paths.join(paths.normalize(prefix), *CONTROL_DIR.split("/"), step.dir_name, "work")


class StepStore:
    """Outputs, locks and attempt records of the steps under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = paths.normalize(prefix)

    def output(self, step: Step) -> str:
        return output_path(self.prefix, step)

    def output_dir(self, dir_name: str) -> str:
        """Where the output `dir_name` lives under this prefix now (a record keeps the path it was
        written at, which differs once the prefix is copied or mounted elsewhere)."""
        return paths.join(self.prefix, dir_name)

    def control(self, dir_name: str) -> str:
        return paths.join(self.prefix, *CONTROL_DIR.split("/"), dir_name)

    def lock(self, step: Step, settings: LockSettings) -> StepLock:
        return StepLock(paths.join(self.control(step.dir_name), "lock.json"), settings)

    def is_committed(self, step: Step) -> bool:
        return is_committed(self.output(step), marker=RECORD)

    def output_record(self, dir_name: str) -> StepRecord | None:
        """The record of the committed output `dir_name`, or None when there is none."""
        return _read_record(paths.join(self.prefix, dir_name, *RECORD.split("/")))

    def attempt_record(self, dir_name: str) -> StepRecord | None:
        """The record of the latest attempt at `dir_name`, or None when it never ran here."""
        return _read_record(paths.join(self.control(dir_name), "attempt.json"))

    def write_attempt(self, step: Step, record: StepRecord) -> None:
        paths.write_text(paths.join(self.control(step.dir_name), "attempt.json"), record.to_json())

    def new_staging(self, step: Step) -> tuple[str, str]:
        """A fresh, empty staging directory for an attempt: (attempt id, path).

        Call only while holding the step's lock: it also removes what earlier, interrupted
        attempts left behind.
        """
        control = self.control(step.dir_name)
        for entry in paths.list_dir(control):
            if entry.startswith("staging-"):
                paths.remove_tree(paths.join(control, entry))
        attempt = uuid.uuid4().hex[:12]
        staging = paths.join(control, f"staging-{attempt}")
        paths.make_dirs(staging)
        return attempt, staging

    def work_dir(self, step: Step) -> str:
        """The step's work directory: what its attempts keep for a rerun (see context.py)."""
        return work_dir(self.prefix, step)

    def commit(self, staging: str, record: StepRecord, step: Step) -> None:
        """Write the SUCCESS record into `staging`, publish it as the step's output, then drop
        the step's work directory (nothing is left to resume)."""
        paths.write_text(paths.join(staging, *RECORD.split("/")), record.to_json())
        commit_directory(staging, self.output(step), marker=RECORD)
        paths.remove_tree(self.work_dir(step))

    def entries(self) -> list[StepEntry]:
        """Every step known under the prefix, committed or attempted, sorted by name."""
        names = set(paths.list_dir(paths.join(self.prefix, *CONTROL_DIR.split("/"))))
        names.update(
            name
            for name in paths.list_dir(self.prefix)
            if not name.startswith(".") and ".replaced-" not in name
        )
        found = []
        for dir_name in sorted(names):
            entry = self._entry(dir_name)
            if entry is not None:
                found.append(entry)
        return found

    def _entry(self, dir_name: str) -> StepEntry | None:
        committed = self.output_record(dir_name)
        attempt = self.attempt_record(dir_name)
        if attempt is not None and attempt.status is Status.RUNNING:
            lock = StepLock(paths.join(self.control(dir_name), "lock.json"))
            holder = lock.holder()
            state = "RUNNING" if holder and not holder.is_stale(lock.settings) else "INTERRUPTED"
            return StepEntry(dir_name, state, attempt, committed is not None, holder)
        if committed is not None:
            return StepEntry(dir_name, Status.SUCCESS.value, committed, True, None)
        if attempt is not None:
            return StepEntry(dir_name, attempt.status.value, attempt, False, None)
        return None


@dataclass(frozen=True)
class StepEntry:
    """One step as `keel status` shows it. `state` is a Status value or INTERRUPTED (a RUNNING
    attempt whose runner is gone); `has_output` tells whether a committed output exists."""

    dir_name: str
    state: str
    record: StepRecord
    has_output: bool
    holder: LockInfo | None


def _read_record(path: str) -> StepRecord | None:
    try:
        return StepRecord.from_json(paths.read_text(path))
    except FileNotFoundError:
        return None
