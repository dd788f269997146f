"""How the CLI talks: results on stdout, progress and errors on stderr, errors as one line."""

from __future__ import annotations

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

P = ParamSpec("P")
R = TypeVar("R")


def fail(message: str, exit_code: int) -> typer.Exit:
    """Print `error: message` on stderr; return the Exit to raise."""
    stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(exit_code)


def user_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Turn KeelError from a command into one line on stderr and the error's exit code."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except KeelError as error:
            raise fail(str(error), error.exit_code) from None

    return wrapper


def print_json(data: Any) -> None:
    """Exactly one JSON object on stdout, nothing else."""
    typer.echo(json.dumps(data, sort_keys=True))
