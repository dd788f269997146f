"""`keel data <stage>` commands generated from the stage registry (keel.data.registry).

Each command takes the common --input/--output/--workers/--backend/--progress/--quiet/--json and
--set, and one flag per config field of a simple type (bool, int, float, str, or one of these or
None): `--field-name`, its default the field's, its help the field's docstring. Other fields
(tuples, nested configs) are set with `--set key=value`. Stages that need flags of their own
(dedup --mode, decontam --eval, tokenize, mix, download) keep hand-written commands in
data_commands.py, which names them so that they are not generated too.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Callable, Mapping

import typer

from keel.cli.output import user_errors
from keel.data.stage import Stage

SIMPLE_TYPES = (bool, int, float, str)


def stage_command(
    stage: Stage,
    common: Mapping[str, tuple[type, object]],
    run: Callable[[Stage, object, dict], None],
    aliases: Mapping[str, tuple[str, ...]] = {},
) -> Callable:
    """A typer command for `stage`: `common` holds the shared parameters (name -> (type,
    typer.Option)), placed after the field flags; `run(stage, config, common_values)` runs it
    with the config built from the field flags. `aliases` adds flag names to a field
    (quality's `--model` for model_path)."""
    fields = flag_fields(stage.config)
    helps = field_docs(stage.config)
    parameters = []
    for name, (kind, default) in fields.items():
        flags = (f"--{name.replace('_', '-')}", *aliases.get(name, ()))
        if kind is bool:
            flags = (f"--{name.replace('_', '-')}/--no-{name.replace('_', '-')}",)
        option = typer.Option(default, *flags, help=helps.get(name, ""))
        parameters.append(_parameter(name, kind, option))
    for name, (kind, option) in common.items():
        parameters.append(_parameter(name, kind, option))

    def command(**values: object) -> None:
        config = stage.config(**{name: values[name] for name in fields})
        run(stage, config, {name: values[name] for name in common})

    command.__name__ = f"{stage.name}_command"
    command.__doc__ = (
        f"{stage.help}\n\nExample: keel data {command_name(stage)} --input DIR --output DIR"
    )
    wrapped = user_errors(command)
    wrapped.__signature__ = inspect.Signature(parameters)  # typer reads the flags from here
    return wrapped


def command_name(stage: Stage) -> str:
    return stage.name.replace("_", "-")


def flag_fields(config: type) -> dict[str, tuple[type, object]]:
    """The config fields that become flags: name -> (type, default), for fields with a plain
    default whose type is simple or simple | None."""
    hints = typing.get_type_hints(config)
    found = {}
    for field in dataclasses.fields(config):
        kind = _simple(hints[field.name])
        if kind is not None and field.default is not dataclasses.MISSING:
            found[field.name] = (kind, field.default)
    return found


def field_docs(config: type) -> dict[str, str]:
    """Field -> the first paragraph of its docstring (the string literal after the field in
    the class body), joined into one line; {} when the source is not available."""
    try:
        source = textwrap.dedent(inspect.getsource(config))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split("\n\n")[0].split())
    return docs


def _simple(annotation: object) -> type | None:
    """bool/int/float/str for X or X | None of those; None for any other type."""
    if annotation in SIMPLE_TYPES:
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) == 1 and options[0] in SIMPLE_TYPES:
            return typing.Optional[options[0]]  # noqa: UP045 - typer needs the typing form
    return None


def _parameter(name: str, kind: object, default: object) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)
