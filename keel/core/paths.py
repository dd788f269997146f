"""Paths that may be local directories or fsspec URLs (s3://, gs://, memory://, file://).

Every keel function that takes a path takes either. These helpers keep the local case on plain `os`
calls (fast, and atomic where POSIX is) and send everything else through fsspec, which is imported
only then: its import (~35 ms: asyncio and ssl come with it) would otherwise be paid by every
worker process of a local run.
"""

from __future__ import annotations

import glob
import os
import posixpath
import shutil
import uuid
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from keel.core.errors import UsageError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

_LOCAL_PROTOCOLS = {"file", "local"}


def filesystem(path: str | os.PathLike[str]) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem for `path` and the path as that filesystem spells it; a
    UsageError when that filesystem's package is not installed (s3fs for s3://)."""
    import fsspec  # here: local paths never need it, and its import is ~35 ms (asyncio, ssl)

    try:
        return fsspec.core.url_to_fs(os.fspath(path))
    except ImportError as error:
        raise UsageError(
            f"{os.fspath(path)}: {error} (for s3://: pip install 'keel[s3]')"
        ) from error


def is_local(path: str | os.PathLike[str]) -> bool:
    """True for plain paths and file:// URLs: rename is atomic and O_EXCL works there."""
    text = os.fspath(path)
    if "://" not in text:
        return True
    protocol = text.split("://", 1)[0]
    return protocol in _LOCAL_PROTOCOLS


def local_path(path: str | os.PathLike[str]) -> Path:
    """The plain filesystem path of a local path or file:// URL."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    return Path(text)


def normalize(path: str | os.PathLike[str]) -> str:
    """Local paths made absolute (so a record says where output really went); URLs unchanged."""
    if is_local(path):
        return str(local_path(path).expanduser().absolute())
    return os.fspath(path).rstrip("/")


def join(base: str | os.PathLike[str], *parts: str) -> str:
    """Join path parts with "/" for URLs and the OS separator for local paths."""
    if is_local(base):
        return str(local_path(base).joinpath(*parts))
    return posixpath.join(os.fspath(base).rstrip("/"), *parts)


def exists(path: str | os.PathLike[str]) -> bool:
    if is_local(path):
        return local_path(path).exists()
    fs, fs_path = filesystem(path)
    return fs.exists(fs_path)


def file_size(path: str | os.PathLike[str]) -> int:
    """A file's size in bytes."""
    if is_local(path):
        return local_path(path).stat().st_size
    fs, fs_path = filesystem(path)
    return int(fs.size(fs_path))


def read_text(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of a file; FileNotFoundError when it is missing."""
    if is_local(path):
        return local_path(path).read_text(encoding="utf-8")
    fs, fs_path = filesystem(path)
    return fs.cat_file(fs_path).decode("utf-8")


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write a small file so that readers see the old content or the new, never a torn one.

    Locally: write a temporary sibling, fsync, rename over, fsync the directory (so the rename
    survives a power cut too). Object stores: one PUT is atomic.
    """
    if is_local(path):
        target = local_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
        fsync_directory(target.parent)
        return
    fs, fs_path = filesystem(path)
    fs.pipe_file(fs_path, text.encode("utf-8"))


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a local directory's entries (files created, renamed or removed in it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_file(path: str | os.PathLike[str], mode: str = "rb") -> IO[Any]:
    """Open a file for reading or writing (binary or text mode), creating parent directories
    when writing to a local path."""
    if is_local(path):
        target = local_path(path)
        if any(flag in mode for flag in "wax"):
            target.parent.mkdir(parents=True, exist_ok=True)
        return open(target, mode, encoding=None if "b" in mode else "utf-8")
    import fsspec

    return fsspec.open(os.fspath(path), mode, encoding=None if "b" in mode else "utf-8").open()


def move_file(source: str, target: str) -> None:
    """Move one file, between any two filesystems (a rename when both are local)."""
    if is_local(source) and is_local(target):
        local_path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(local_path(source), local_path(target))
        return
    copy_file(source, target)
    fs, fs_path = filesystem(source)
    fs.rm_file(fs_path)


def copy_file(source: str, target: str) -> None:
    """Copy one file, between any two filesystems (8 MiB at a time)."""
    with open_file(source, "rb") as reader, open_file(target, "wb") as writer:
        shutil.copyfileobj(reader, writer, length=8 * 1024 * 1024)


def copy_tree(source: str, target: str) -> list[str]:
    """Copy every file under directory `source` into directory `target`, keeping relative paths,
    between any two filesystems (an upload or a download when one side is local); the relative
    paths copied, sorted."""
    fs, fs_root = filesystem(source)
    relative = sorted(posixpath.relpath(file, fs_root) for file in fs.find(fs_root))
    for name in relative:
        copy_file(join(source, *name.split("/")), join(target, *name.split("/")))
    return relative


def move_tree(source: str, target: str) -> None:
    """Move everything under directory `source` into directory `target` (made if missing),
    keeping relative paths; `source` is left empty. Renames when both are local (one file
    system: a rename per top-level entry), otherwise a copy and delete per file."""
    make_dirs(target)
    if is_local(source) and is_local(target):
        for entry in list_dir(source):
            os.replace(local_path(join(source, entry)), local_path(join(target, entry)))
        return
    fs, fs_root = filesystem(source)
    for file in fs.find(fs_root):
        move_file(fs.unstrip_protocol(file), join(target, posixpath.relpath(file, fs_root)))


def make_dirs(path: str | os.PathLike[str]) -> None:
    if is_local(path):
        local_path(path).mkdir(parents=True, exist_ok=True)
        return
    fs, fs_path = filesystem(path)
    fs.makedirs(fs_path, exist_ok=True)


def remove_file(path: str | os.PathLike[str]) -> None:
    """Delete one file; a missing file is not an error."""
    if is_local(path):
        local_path(path).unlink(missing_ok=True)
        return
    fs, fs_path = filesystem(path)
    if fs.exists(fs_path):
        fs.rm_file(fs_path)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a directory tree; a missing path is not an error."""
    if is_local(path):
        if local_path(path).exists():
            shutil.rmtree(local_path(path))
        return
    fs, fs_path = filesystem(path)
    if fs.exists(fs_path):
        fs.rm(fs_path, recursive=True)


def list_dir(path: str | os.PathLike[str]) -> list[str]:
    """Names (not paths) of the entries of a directory; [] when it does not exist."""
    if is_local(path):
        directory = local_path(path)
        return sorted(entry.name for entry in directory.iterdir()) if directory.is_dir() else []
    fs, fs_path = filesystem(path)
    if not fs.exists(fs_path):
        return []
    return sorted(posixpath.basename(entry.rstrip("/")) for entry in fs.ls(fs_path, detail=False))


GLOB_CHARACTERS = "*?["
"""The wildcards of a glob."""


def is_glob(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds a wildcard (`*`, `?` or `[`), so it names files by a pattern."""
    return any(char in os.fspath(path) for char in GLOB_CHARACTERS)


def glob_files(pattern: str | os.PathLike[str]) -> list[str]:
    """The files a glob (or a plain path) names, sorted: local paths absolute, as fsspec spells
    them (`*` matches names that start with a dot too, `**` any depth); URLs with their
    protocol. A plain path that is a directory or missing gives []."""
    text = os.fspath(pattern)
    wildcard = is_glob(text)
    if is_local(text):
        path = os.path.join(os.getcwd(), os.path.expanduser(str(local_path(text))))
        matches = glob.glob(path, recursive=True, include_hidden=True) if wildcard else [path]
        return sorted(match for match in matches if os.path.isfile(match))
    fs, fs_path = filesystem(text)
    matches = sorted(fs.glob(fs_path)) if wildcard else [fs_path]
    protocol = text.split("://", 1)[0] + "://"
    return [m if "://" in m else protocol + m for m in matches if fs.isfile(m)]
