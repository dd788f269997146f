"""What an output directory may be, checked before any work, and OS errors said in one line.

An output directory is replaced as a whole when a run commits (keel.core.commit), so it may only be
a path that does not exist yet, an empty directory, or a previous output of the same kind (it holds
that kind's marker file). Anything else, and any path that is or contains an input, is refused:
`--output .` must never rename the user's working directory aside and delete it.

Paths are compared after resolving: local paths by their real path (symlinks, `..`, `~`), fsspec
URLs by protocol and normalised path (so s3://b/x/ and s3://b/x are the same place).
"""

from __future__ import annotations

import errno
import glob
import os
import posixpath
from collections.abc import Iterable, Sequence
from pathlib import Path

from keel.core import paths
from keel.core.errors import KeelError, UsageError


class OutputRefusedError(UsageError):
    """The output path names something a commit must not replace (an input, a user's files)."""


class OutputNotWritableError(UsageError):
    """The output path cannot be written: read-only, not permitted, or a file in the way."""


class OutputWriteError(KeelError):
    """Writing an output failed part-way (a full disk); what was written of it was removed."""


InputPaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None
"""A run's inputs as its caller names them: a path, a glob or an fsspec URL, or several."""


def refuse_unsafe_output(
    final: str | os.PathLike[str], *, markers: Sequence[str], kind: str, inputs: InputPaths = ()
) -> None:
    """Raise OutputRefusedError unless `final` may be replaced by a new output of `kind`.

    Allowed: a missing path, an empty directory, or a directory holding one of `markers`
    (relative paths). Refused: anything that equals or contains an input, a file, and a directory
    holding anything else. Reads only; nothing is created or changed.
    """
    where = location(final)
    for input_path in input_locations(inputs):
        if _inside(input_path, where):
            relation = "is" if input_path == where else "contains"
            raise OutputRefusedError(
                f"output {final} {relation} the input {input_path}: refusing to replace "
                "it; write to a new directory"
            )
    if paths.is_local(final):
        target = paths.local_path(final)
        if not os.path.lexists(target):
            return
        if not target.is_dir():
            raise OutputRefusedError(
                f"output {final} is a file, not a directory: refusing to replace it; "
                "choose a directory path"
            )
        entries = os.listdir(target)
    else:
        fs, fs_path = paths.filesystem(final)
        if not fs.exists(fs_path):
            return
        if not fs.isdir(fs_path):
            raise OutputRefusedError(
                f"output {final} is a file, not a directory: refusing to replace it; "
                "choose a directory path"
            )
        entries = paths.list_dir(final)
    if not entries or any(paths.exists(paths.join(final, *m.split("/"))) for m in markers):
        return
    raise OutputRefusedError(
        f"output {final} holds files that are not a previous {kind} (it has no "
        f"{markers[0]}): refusing to replace them; choose a new or empty directory"
    )


def output_error(error: OSError, final: str | os.PathLike[str]) -> KeelError | None:
    """The one-line error for an OSError met while writing the output `final`, or None when the
    error is not one a user fixes by freeing space or choosing another path."""
    path = error.filename if error.filename is not None else final
    code = error.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        return OutputWriteError(
            f"no space left on the device of {final} (writing {path}); the partial output was "
            "removed: free space there or choose another output directory"
        )
    if code == errno.EROFS:
        return OutputNotWritableError(
            f"cannot write {final}: {path} is on a read-only file system; choose another "
            "output directory"
        )
    if code in (errno.EACCES, errno.EPERM):
        return OutputNotWritableError(
            f"cannot write {final}: permission denied for {path}; choose a directory you can "
            "write to"
        )
    if code in (errno.ENOTDIR, errno.EEXIST):
        blocker = _file_in_the_way(final) or path
        return OutputNotWritableError(
            f"cannot write {final}: {blocker} is a file, not a directory; choose another "
            "output directory"
        )
    return None


def location(path: str | os.PathLike[str]) -> str:
    """Where `path` really is: a resolved local path, or protocol://normalised/path."""
    if paths.is_local(path):
        return os.path.realpath(paths.local_path(path).expanduser())
    fs, fs_path = paths.filesystem(path)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return f"{protocol}://{posixpath.normpath('/' + fs_path.strip('/')).lstrip('/')}"


def input_locations(inputs: InputPaths) -> list[str]:
    """The places a run reads: for each input its fixed part (the directory before the first
    glob character, or the path itself) and, for local globs, every file it matches."""
    if inputs is None:
        return []
    items: Iterable = [inputs] if isinstance(inputs, str | os.PathLike) else inputs
    found: list[str] = []
    for item in items:
        text = os.fspath(item)
        found.append(location(_fixed_part(text)))
        if paths.is_local(text) and paths.is_glob(text):
            pattern = str(paths.local_path(text).expanduser())
            found.extend(os.path.realpath(match) for match in glob.glob(pattern, recursive=True))
    return list(dict.fromkeys(found))


def _fixed_part(text: str) -> str:
    """`raw/2024/*.jsonl` -> `raw/2024`: the path up to its first component with a wildcard."""
    if not paths.is_glob(text):
        return text
    head = text[: min(text.index(char) for char in paths.GLOB_CHARACTERS if char in text)]
    fixed = head.rsplit("/", 1)[0] if "/" in head else "."
    return fixed or "/"


def _inside(path: str, root: str) -> bool:
    """True when `path` is `root` or lies under it (both from `location`)."""
    if path == root:
        return True
    return path.startswith(root if root.endswith("/") else root + "/")


def _file_in_the_way(final: str | os.PathLike[str]) -> str | None:
    """The first existing non-directory among `final` and its parents (local paths)."""
    if not paths.is_local(final):
        return None
    target = Path(os.path.abspath(paths.local_path(final).expanduser()))
    for candidate in [*reversed(target.parents), target]:
        if os.path.lexists(candidate) and not candidate.is_dir():
            return str(candidate)
    return None
