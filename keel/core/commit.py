"""Atomic directory commit: write everything into a staging directory, then publish it at once.

Readers must never see half of an output. Two protocols, one function:
- Local filesystems: `os.rename(staging, final)` is atomic. An existing `final` (a forced re-run) is
  first renamed aside and deleted after the new one is in place, so `final` is never a mix of both.
- Object stores (s3://, gs://, memory://): there is no rename, so the files are copied to `final`
  with the marker file copied last; a reader that finds the marker knows everything else is there.
The marker is a path relative to the directory (keel.steps uses ".keel/step.json"), and it must be
in the staging directory before the commit.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import uuid

from keel.core import paths
from keel.core.errors import KeelError


def commit_directory(staging: str, final: str, *, marker: str) -> None:
    """Publish the `staging` directory as `final`, replacing any previous `final`.

    Both must be on the same filesystem. `marker` (relative to the directory) must exist in staging;
    it is the last thing to appear at `final`. Afterwards `staging` no longer exists.
    """
    if not paths.exists(paths.join(staging, *marker.split("/"))):
        raise KeelError(f"cannot commit {staging}: its marker {marker} was never written")
    if paths.is_local(staging):
        _commit_local(paths.local_path(staging), paths.local_path(final))
    else:
        _commit_by_copy(staging, final, marker)


def is_committed(final: str, *, marker: str) -> bool:
    """True when `final` holds a committed directory (its marker exists)."""
    return paths.exists(paths.join(final, *marker.split("/")))


def _commit_local(staging: os.PathLike[str], final: os.PathLike[str]) -> None:
    final_text = os.fspath(final)
    aside = f"{final_text}.replaced-{uuid.uuid4().hex[:12]}"
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
    marker_source = posixpath.join(staging_path, marker)
    for source in sorted(fs.find(staging_path)):
        if source == marker_source:
            continue
        target = posixpath.join(final_path, posixpath.relpath(source, staging_path))
        fs.copy(source, target)
    fs.copy(marker_source, posixpath.join(final_path, marker))
    fs.rm(staging_path, recursive=True)
