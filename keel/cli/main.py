"""Entry point of the `keel` command: the typer app, whose sub-commands load when they run.

`keel --help` and `keel job status` must start in a fraction of a second, while `keel train`
needs jax, orbax and the model. So the top-level commands are listed in COMMANDS with the one
line `keel --help` shows, and a command's module (and whatever heavy library it imports) is
imported only when that command runs or prints its own help. tests/cli/test_lazy_cli.py checks
that each listed line equals the loaded command's own help, so the two cannot drift.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from difflib import get_close_matches
from typing import TYPE_CHECKING

import typer
import typer.main
from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:  # typer >= 0.24 carries its own copy of click
    from typer._click import Command, Context, HelpFormatter

import keel
from keel.core.log import setup_logging


@dataclass(frozen=True)
class LazyCommand:
    """A top-level command: the module whose `register(app)` adds it, and its help line."""

    module: str
    help: str


COMMANDS: dict[str, LazyCommand] = {
    "run": LazyCommand(
        "steps_commands",
        "Run the steps an experiment file declares; committed steps are reused, not re-run.",
    ),
    "status": LazyCommand(
        "steps_commands",
        "List the steps under a prefix (or one experiment's steps): state, age and output path.",
    ),
    "gc": LazyCommand(
        "steps_commands",
        "List (with --yes remove) the step outputs under a prefix that no kept experiment uses.",
    ),
    "quickstart": LazyCommand(
        "steps_commands",
        "Run the main job end to end on the bundled sample (keel/experiments/quickstart.py).",
    ),
    "train": LazyCommand(
        "train_commands",
        "Train a model; running the same command again resumes from the last checkpoint.",
    ),
    "sample": LazyCommand(
        "sample_commands",
        "Generate text from a trained run's checkpoint (key/value cache; deterministic per seed).",
    ),
    "export": LazyCommand(
        "export_commands",
        "Export a trained run's checkpoint (hf: safetensors, config.json, tokenizer files).",
    ),
    "experiment": LazyCommand(
        "experiment_commands",
        "Experiment records: a hypothesis, the runs that test it, and their report.",
    ),
    "eval": LazyCommand(
        "eval_commands",
        "Evaluate a trained run's checkpoint on lm-eval tasks read from local files.",
    ),
    "runs": LazyCommand(
        "runs_commands",
        "Existing training runs: where one branched from (lineage), its router report.",
    ),
    "data": LazyCommand(
        "data_commands", "DataKit: raw documents -> deduplicated, decontaminated training tokens."
    ),
    "scaling": LazyCommand(
        "scaling_commands",
        "Scaling-law fits (Hoffmann et al. 2022) from a CSV of runs: params, tokens, loss "
        "[, flops]; see docs/scaling.md.",
    ),
    "dashboard": LazyCommand(
        "dashboard_commands",
        "A web UI: runs and live metric charts, data-stage funnels, steps, jobs, logs and SQL.",
    ),
    "cluster": LazyCommand("cluster_commands", "Run and inspect the job controller."),
    "job": LazyCommand("cluster_commands", "Submit, inspect and cancel jobs on the controller."),
    "logs": LazyCommand(
        "logs_commands",
        "Telemetry: namespaced tables of rows (metrics, task logs) in indexed Parquet segments, "
        "queried with SQL. Use a store directory (--root) or a server (--url, see `keel logs "
        "serve`).",
    ),
}


def _register_scaling(app: typer.Typer) -> None:
    """`keel scaling` with the sweep, ladder and screen commands of its sibling modules."""
    from keel.cli import scaling_commands, screen_commands, sweep_commands

    sweep_commands.register(scaling_commands.app)
    screen_commands.register(scaling_commands.app)
    scaling_commands.register(app)


def _registrar(module: str) -> Callable[[typer.Typer], None]:
    if module == "scaling_commands":
        return _register_scaling
    return importlib.import_module(f"keel.cli.{module}").register


class LazyGroup(TyperGroup):
    """The top-level group: lists COMMANDS from the table, imports a command's module on use."""

    _listing = False

    def list_commands(self, ctx: Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        if cmd_name not in COMMANDS:
            return None
        if self._listing:  # `keel --help`: the table's line, nothing imported
            return TyperCommand(cmd_name, help=COMMANDS[cmd_name].help)
        if cmd_name not in self.commands:
            self._load(COMMANDS[cmd_name].module)
        return self.commands[cmd_name]

    def resolve_command(
        self, ctx: Context, args: list[str]
    ) -> tuple[str | None, Command | None, list[str]]:
        name = args[0] if args else ""
        if name not in COMMANDS and not name.startswith("-") and not ctx.resilient_parsing:
            matches = ", ".join(repr(match) for match in get_close_matches(name, list(COMMANDS)))
            hint = f" Did you mean {matches}?" if matches else ""
            ctx.fail(f"No such command {name!r}.{hint}")
        return super().resolve_command(ctx, args)

    def format_help(self, ctx: Context, formatter: HelpFormatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def _load(self, module: str) -> None:
        """Register every command `module` adds (steps_commands adds three) into this group."""
        staging = typer.Typer(pretty_exceptions_enable=False, rich_markup_mode="rich")
        _registrar(module)(staging)
        loaded = typer.main.get_group(staging)
        for name, command in loaded.commands.items():
            self.commands.setdefault(name, command)


app = typer.Typer(
    name="keel",
    cls=LazyGroup,
    help="keel: train language models end to end, from raw documents to scaling-law fits.\n\n"
    "Start with `keel quickstart`; see `keel COMMAND --help` for each command.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(show: bool) -> None:
    if show:
        typer.echo(f"keel {keel.__version__}")
        raise typer.Exit()


LOG_LEVEL_ENV = "KEEL_LOG_LEVEL"
"""Overrides --verbose/--quiet for every keel command (and a gang's processes): debug, info..."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@app.callback()
def _main(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug detail on stderr."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Log only warnings and errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    level: int | str = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    if named := os.environ.get(LOG_LEVEL_ENV, "").strip():
        level = named.upper()
        if level not in LOG_LEVELS:
            choices = ", ".join(name.lower() for name in LOG_LEVELS)
            raise typer.BadParameter(f"{LOG_LEVEL_ENV}={named!r}: use one of {choices}")
    setup_logging(level)


def main() -> None:
    app()
