"""`keel gc`: find, and remove, the committed step outputs under a prefix that no kept experiment
uses.

Only committed step outputs are ever candidates: a directory `{name}-{hash8}` directly under the
prefix holding the step record `.keel/step.json` of that name. Anything else under the prefix (a
telemetry store, a controller's state, files a user put there, staging directories) is never
listed nor touched. Removing an output takes its record away first, so the output stops counting
as committed before any data goes (an interrupted removal leaves a directory that is no longer a
cached output, and the next run of that step simply replaces it); its control directory under
`.keel/steps/` (lock, attempt record) goes too, unless a live runner holds its lock.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

from keel.core import paths
from keel.steps.lock import StepLock
from keel.steps.record import StepRecord
from keel.steps.step import HASH_CHARS
from keel.steps.store import RECORD, StepStore


@dataclass(frozen=True)
class UnusedOutput:
    """A committed output no kept step has: its directory name, path, record and size (bytes)."""

    dir_name: str
    output: str
    record: StepRecord
    bytes: int


def unused_outputs(store: StepStore, kept: set[str]) -> list[UnusedOutput]:
    """Committed outputs under `store.prefix` whose directory name is not in `kept` (the
    `{name}-{hash8}` names of the steps to keep), sorted by name."""
    found = []
    for dir_name in paths.list_dir(store.prefix):
        if dir_name in kept or dir_name.startswith("."):
            continue
        record = store.output_record(dir_name)
        if record is None or f"{record.name}-{record.identity[:HASH_CHARS]}" != dir_name:
            continue
        output = paths.join(store.prefix, dir_name)
        found.append(UnusedOutput(dir_name, output, record, _size(output)))
    return found


def remove_output(store: StepStore, unused: UnusedOutput) -> None:
    """Remove one committed output: its record first, then its files, then its control
    directory when no live runner holds the step's lock."""
    paths.remove_file(paths.join(unused.output, *RECORD.split("/")))
    if paths.is_local(unused.output):
        aside = paths.join(store.prefix, f".{unused.dir_name}.gc-{uuid.uuid4().hex[:8]}")
        os.rename(paths.local_path(unused.output), paths.local_path(aside))
        paths.remove_tree(aside)
    else:
        paths.remove_tree(unused.output)
    control = store.control(unused.dir_name)
    lock = StepLock(paths.join(control, "lock.json"))
    holder = lock.holder()
    if holder is None or holder.is_stale(lock.settings):
        paths.remove_tree(control)


def _size(path: str) -> int:
    """Bytes of the files under `path`."""
    if not paths.is_local(path):
        fs, fs_path = paths.filesystem(path)
        return int(fs.du(fs_path, total=True))
    total = 0
    for directory, _, files in os.walk(paths.local_path(path)):
        for name in files:
            total += os.lstat(os.path.join(directory, name)).st_size
    return total
