"""Atomic directory commit: write everything into a staging directory, then publish it at once.

Every keel output directory (a keel/flow write, a DataKit stage, a step's output) goes through here,
so the rules hold everywhere:
- Readers never see half of an output. Locally `os.rename(staging, final)` is atomic; an existing
  `final` (a re-run) is first renamed aside and deleted after the new one is in place. Object
  stores (s3://, gs://, memory://) have no rename: the files are copied to `final` with the marker
  file copied last, so a reader that finds the marker knows everything else is there.
- Only a missing path, an empty directory or a previous output of the same kind (it holds the
  marker) is ever replaced; never a path that is or contains an input (keel.core.output_checks).
- `staged_output` checks that before any work, makes the staging directory beside `final` (so the
  rename stays on one filesystem; making it is the writability check), removes it on any error
  (a full disk included) and says OS errors in one line with the path.
- Side files that must come with the data (stage.json, removed.parquet) are written into the
  staging directory, so they appear in the same rename. `records` names the ones readers must find:
  the marker lists them, and `missing_records` tells a reader what a damaged copy lacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterator, Sequence

from keel.core import paths
from keel.core.errors import KeelError
from keel.core.output_checks import InputPaths, output_error, refuse_unsafe_output
from keel.core.owned import owner_tag, remove_abandoned

COMMITTING = ".keel-committing"
"""Object stores: written first into `final` by a copy commit and removed after the marker, so
an interrupted copy is still recognised as a previous output (and replaced by the next run)."""
STAGING_INFIX = ".staging-"
REPLACED_INFIX = ".replaced-"


def commit_directory(
    staging: str,
    final: str,
    *,
    marker: str,
    kind: str = "keel output",
    inputs: InputPaths = (),
    replaces: Sequence[str] = (),
) -> None:
    """Publish the `staging` directory as `final`, replacing a previous output of the same kind.

    Both must be on the same filesystem. `marker` (relative to the directory) must exist in staging;
    it is the last thing to appear at `final`. `final` must be missing, empty, or hold `marker`,
    one of `replaces` (markers of older outputs of this kind) or an interrupted copy commit;
    and must not be or contain one of `inputs` (OutputRefusedError). Afterwards `staging` no longer
    exists.
    """
    if not paths.exists(paths.join(staging, *marker.split("/"))):
        raise KeelError(f"cannot commit {staging}: its marker {marker} was never written")
    refuse_unsafe_output(final, markers=(marker, *replaces, COMMITTING), kind=kind, inputs=inputs)
    if paths.is_local(staging):
        _commit_local(paths.local_path(staging), paths.local_path(final))
    else:
        _commit_by_copy(staging, final, marker)


@contextlib.contextmanager
def staged_output(
    final: str | os.PathLike[str],
    *,
    marker: str,
    kind: str,
    inputs: InputPaths = (),
    replaces: Sequence[str] = (),
    records: Sequence[str] = (),
) -> Iterator[str]:
    """A fresh staging directory for the output `final`, committed when the block ends.

        with staged_output(out, marker="_SUCCESS", kind="document set", inputs=[src]) as staging:
            ...write every file of the output into staging...

    Before yielding: refuses an unsafe `final` (see commit_directory) and makes the staging
    directory, so a read-only or blocked path fails before any work. The block must write
    `marker` (or, with `records`, those files: the marker is then written here, listing them).
    On any error the staging directory is removed, and an OSError a user can act on (no space,
    read-only, permission, a file in the way) becomes a one-line KeelError naming the path.
    """
    final = os.fspath(final)
    markers = (marker, *replaces, COMMITTING)
    refuse_unsafe_output(final, markers=markers, kind=kind, inputs=inputs)
    staging = _translated(final, lambda: new_staging(final))
    try:
        yield staging
        if records:
            write_records(staging, marker, records)
        commit_directory(staging, final, marker=marker, kind=kind, inputs=inputs, replaces=replaces)
    except BaseException as error:
        paths.remove_tree(staging)
        if isinstance(error, OSError) and (translated := output_error(error, final)):
            raise translated from error
        raise


def new_staging(final: str) -> str:
    """Make an empty staging directory beside `final` (its parent created if missing) and return
    it. Local names carry this process's owner tag; staging left by dead processes for the same
    `final` is removed first (a kill cannot clean up after itself)."""
    normalized = paths.normalize(final)
    if not paths.is_local(normalized):
        staging = f"{normalized}{STAGING_INFIX}{uuid.uuid4().hex[:12]}"
        paths.make_dirs(staging)
        return staging
    parent, name = os.path.split(normalized)
    os.makedirs(parent, exist_ok=True)
    remove_abandoned(parent, f"{name}{STAGING_INFIX}")
    remove_abandoned(parent, f"{name}{REPLACED_INFIX}")
    staging = os.path.join(parent, f"{name}{STAGING_INFIX}{owner_tag()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(staging)
    return staging


def write_records(staging: str, marker: str, records: Sequence[str]) -> None:
    """Write `marker` into `staging` as {"records": [...]}: the files a reader must find beside
    it. Each record must already be in staging (a stage that forgot its record is a bug)."""
    missing = [name for name in records if not paths.exists(paths.join(staging, *name.split("/")))]
    if missing:
        raise KeelError(f"cannot commit {staging}: {', '.join(missing)} was never written")
    text = json.dumps({"records": list(records)}, sort_keys=True)
    paths.write_text(paths.join(staging, *marker.split("/")), text)


def missing_records(directory: str, marker: str) -> list[str]:
    """The records that `directory`'s marker lists but that are missing ([] when the marker is
    absent, empty or lists none: outputs without records, such as a plain keel/flow write)."""
    try:
        text = paths.read_text(paths.join(directory, *marker.split("/")))
    except (FileNotFoundError, NotADirectoryError):  # no marker, or `directory` is a file
        return []
    try:
        records = json.loads(text).get("records", []) if text.strip() else []
    except (json.JSONDecodeError, AttributeError):
        return []
    return [name for name in records if not paths.exists(paths.join(directory, *name.split("/")))]


def is_committed(final: str, *, marker: str) -> bool:
    """True when `final` holds a committed directory (its marker exists)."""
    return paths.exists(paths.join(final, *marker.split("/")))


def _translated(final: str, action):
    try:
        return action()
    except OSError as error:
        translated = output_error(error, final)
        if translated is None:
            raise
        raise translated from error


def _commit_local(staging: os.PathLike[str], final: os.PathLike[str]) -> None:
    final_text = os.fspath(final)
    aside = f"{final_text}{REPLACED_INFIX}{owner_tag()}-{uuid.uuid4().hex[:8]}"
    had_previous = os.path.lexists(final_text)
    if had_previous:
        os.rename(final_text, aside)
    os.rename(staging, final_text)
    if had_previous:
        shutil.rmtree(aside)


def _commit_by_copy(staging: str, final: str, marker: str) -> None:
    fs, staging_path = paths.filesystem(staging)
    _, final_path = paths.filesystem(final)
    if fs.exists(final_path):
        fs.rm(final_path, recursive=True)
    committing = posixpath.join(final_path, COMMITTING)
    fs.pipe_file(committing, b"")
    marker_source = posixpath.join(staging_path, marker)
    for source in sorted(fs.find(staging_path)):
        if source == marker_source:
            continue
        target = posixpath.join(final_path, posixpath.relpath(source, staging_path))
        fs.copy(source, target)
    fs.copy(marker_source, posixpath.join(final_path, marker))
    fs.rm_file(committing)
    fs.rm(staging_path, recursive=True)
