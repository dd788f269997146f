"""Names that say which process made a temporary path, so that a later run can remove what a
killed one left behind (`name-{pid}-{start}-...`, start: the kernel start time of the process, so
a reused pid is not taken for the owner; see keel.core.process)."""

from __future__ import annotations

import logging
import os
import shutil

from keel.core.process import process_alive, process_start

logger = logging.getLogger(__name__)


def owner_tag() -> str:
    """`{pid}-{start}` of this process (start 0 where /proc is missing)."""
    pid = os.getpid()
    return f"{pid}-{process_start(pid) or 0}"


def owner_of(name: str, prefix: str) -> tuple[int, int] | None:
    """(pid, start) from a name `{prefix}{pid}-{start}-...`, or None when it has no owner tag."""
    if not name.startswith(prefix):
        return None
    fields = name[len(prefix) :].split("-", 2)
    if len(fields) < 2 or not (fields[0].isdigit() and fields[1].isdigit()):
        return None
    return int(fields[0]), int(fields[1])


def remove_abandoned(directory: str | os.PathLike[str], prefix: str) -> list[str]:
    """Delete the entries of `directory` named `{prefix}{pid}-{start}-...` whose owner process
    is gone; entries without an owner tag, or owned by a live process, are kept. Returns the
    paths removed."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        owner = owner_of(name, prefix)
        if owner is None or process_alive(owner[0], owner[1] or None):
            continue
        path = os.path.join(directory, name)
        logger.info("removing %s, left behind by process %d", path, owner[0])
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            continue  # another run removed the same leftover first
        removed.append(path)
    return removed
