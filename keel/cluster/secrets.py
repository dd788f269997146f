"""Job secrets: private on disk, hidden wherever a job is shown.

A job's environment may hold credentials (`--env HF_TOKEN=...`, forwarded `KEEL_*` tokens). The
controller's files are therefore private to the user: the state database (and its -wal/-shm),
the root, task and attempt directories and Slurm job scripts are 0600 (files) / 0700
(directories). Values of variables whose name contains TOKEN, SECRET, KEY or PASSWORD (any case)
are shown as "***": in a job's spec (`keel job status`, the HTTP API), in events (a command's
NAME=VALUE words) and in task output read back (`keel job logs`, cluster.task_log rows). The job
itself still receives the real values.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD", re.IGNORECASE)
HIDDEN = "***"
MIN_HIDDEN_LENGTH = 4  # shorter values ("1", "on") are not searched for in output text


def is_secret_name(name: str) -> bool:
    """Whether a variable named `name` holds a secret by its name."""
    return SECRET_NAME.search(name) is not None


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the values of secret-named variables replaced by "***"."""
    return {name: HIDDEN if is_secret_name(name) else value for name, value in env.items()}


def redact_command(command: Iterable[str]) -> list[str]:
    """Command words, with the value of any NAME=VALUE word whose NAME is secret hidden."""
    words = []
    for word in command:
        name, equals, _ = word.partition("=")
        words.append(f"{name}={HIDDEN}" if equals and is_secret_name(name.lstrip("-")) else word)
    return words


class Redactor:
    """Hides the given secret values inside free text (task output)."""

    def __init__(self, values: Iterable[str]) -> None:
        wanted = sorted({v for v in values if len(v) >= MIN_HIDDEN_LENGTH}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, wanted))) if wanted else None

    @classmethod
    def for_env(cls, env: Mapping[str, str]) -> Redactor:
        return cls(value for name, value in env.items() if is_secret_name(name))

    def __call__(self, text: str) -> str:
        return text if self._pattern is None else self._pattern.sub(HIDDEN, text)


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create `path` and any missing parents as 0700 directories (less what the umask takes
    from the owner, which no sane umask does); return it. Directories that exist are left as
    they are (a root the user made, /tmp). As cheap as `mkdir -p`: one call when the parent
    exists (a launch makes hundreds of these a second)."""
    directory = Path(path)
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        private_dir(directory.parent)
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            directory.mkdir(mode=0o700)
    return directory


def write_private(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path`, which is (or becomes) 0600 before anything is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as handle:
        os.fchmod(fd, 0o600)
        handle.write(text)


def private_file(path: str | os.PathLike[str]) -> None:
    """Create `path` empty if missing; make it 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
