"""Entry point of the `keel` command: the typer app and its sub-commands."""

from __future__ import annotations

import logging
import os

import typer

from keel import __version__
from keel.cli import (
    cluster_commands,
    data_commands,
    logs_commands,
    scaling_commands,
    screen_commands,
    steps_commands,
    sweep_commands,
    train_commands,
)
from keel.core.log import setup_logging

app = typer.Typer(
    name="keel",
    help="keel: train language models end to end, from raw documents to scaling-law fits.\n\n"
    "Start with `keel quickstart`; see `keel COMMAND --help` for each command.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
steps_commands.register(app)
data_commands.register(app)
scaling_commands.register(app)
sweep_commands.register(scaling_commands.app)
screen_commands.register(scaling_commands.app)
train_commands.register(app)
cluster_commands.register(app)
logs_commands.register(app)


def _version(show: bool) -> None:
    if show:
        typer.echo(f"keel {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug detail on stderr."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Log only warnings and errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    setup_logging(os.environ.get("KEEL_LOG_LEVEL", level))


def main() -> None:
    app()
