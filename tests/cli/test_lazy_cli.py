"""The `keel` command loads a sub-command's module (and jax, DuckDB, ...) only when it runs."""

import json
import os
import subprocess
import sys

import pytest
import typer.main

from keel.cli.main import COMMANDS, app

HEAVY = ("jax", "orbax", "duckdb", "tokenizers")

# Runs `keel ARGS...` in this interpreter, then prints which heavy libraries it imported.
PROBE = """
import json, runpy, sys
sys.argv = ["keel", *sys.argv[1:]]
try:
    runpy.run_module("keel", run_name="__main__")
except SystemExit:
    pass
heavy = sorted({name.split(".")[0] for name in sys.modules} & set(HEAVY))
print("HEAVY=" + json.dumps(heavy), file=sys.stderr)
"""


def imported_heavy_libraries(*args: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{PROBE}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next(line for line in result.stderr.splitlines() if line.startswith("HEAVY="))
    return json.loads(line.removeprefix("HEAVY="))


@pytest.mark.parametrize("args", [["--help"], ["job", "--help"], ["job", "status", "--help"]])
def test_help_imports_no_heavy_library(args):
    assert imported_heavy_libraries(*args) == []


def test_a_command_that_needs_jax_still_gets_it():
    """The probe can fail: `keel train --help` loads the trainer, and with it jax."""
    assert "jax" in imported_heavy_libraries("train", "--help")


def test_listed_help_is_each_commands_own_first_paragraph():
    """`keel --help` shows COMMANDS' lines without loading anything: each must be what the
    loaded command says of itself, so the two cannot drift apart."""
    group = typer.main.get_command(app)
    context = group.make_context("keel", ["--help"], resilient_parsing=True)
    for name, entry in COMMANDS.items():
        command = group.get_command(context, name)
        first_paragraph = " ".join(command.help.split("\n\n")[0].split())
        assert entry.help == first_paragraph, name
    assert sorted(group.commands) == sorted(COMMANDS), "a module registers an unlisted command"


def test_top_level_help_lists_every_command():
    result = subprocess.run(
        [sys.executable, "-m", "keel", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr
    for name in COMMANDS:
        assert f" {name} " in result.stdout, name


def test_unknown_command_is_a_usage_error_with_a_suggestion():
    result = subprocess.run(
        [sys.executable, "-m", "keel", "trian"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "No such command 'trian'. Did you mean 'train'?" in result.stderr
