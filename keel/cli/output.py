"""How the CLI talks: results on stdout, progress and errors on stderr, errors as one line.

KeelError is a user's mistake or a failed piece of work, said in one line by the library. OS errors
a user fixes on their side (a full disk, a read-only or forbidden path, a file where a directory
should be) are one line too, wherever they come from; any other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations

import errno
import functools
import json
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from keel.core.errors import KeelError

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)

USER_OS_ERRORS = {
    errno.ENOSPC: "free space there or choose another path",
    errno.EDQUOT: "free space there or choose another path",
    errno.EROFS: "choose a path on a writable file system",
    errno.EACCES: "choose a path you may write to",
    errno.EPERM: "choose a path you may write to",
    errno.ENOTDIR: "a file stands where a directory is needed; choose another path",
    errno.EEXIST: "choose another path",
}
"""errno -> what to do: OSErrors the CLI says in one line (exit 1) instead of a traceback."""

P = ParamSpec("P")
R = TypeVar("R")


def fail(message: str, exit_code: int) -> typer.Exit:
    """Print `error: message` on stderr; return the Exit to raise."""
    stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(exit_code)


def user_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Turn KeelError, and the OSErrors of USER_OS_ERRORS, from a command into one line on
    stderr and the error's exit code (1 for OSErrors)."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except KeelError as error:
            raise fail(str(error), error.exit_code) from None
        except OSError as error:
            if error.errno not in USER_OS_ERRORS:
                raise
            raise fail(os_error_line(error), 1) from None

    return wrapper


def os_error_line(error: OSError) -> str:
    """`{strerror}: {path}: {what to do}` for an OSError of USER_OS_ERRORS."""
    where = f": {error.filename}" if error.filename is not None else ""
    return f"{error.strerror or error}{where}: {USER_OS_ERRORS[error.errno]}"


def print_json(data: Any) -> None:
    """Exactly one JSON object on stdout, nothing else."""
    typer.echo(json.dumps(data, sort_keys=True))
