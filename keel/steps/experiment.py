"""Experiment files: Python files that declare steps, and `--set` overrides of their configs.

An experiment file is a Python module with a module-level list `STEPS` of Step objects. Listing the
final steps is enough: everything they depend on (through `output_of`) is found and run too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import cloudpickle

from keel.core.config import apply_overrides, parse_override
from keel.core.errors import ConfigError, KeelError, UsageError
from keel.steps.step import Step, StepRef, all_steps, map_references

STEPS_VARIABLE = "STEPS"
EXPERIMENT_VARIABLE = "EXPERIMENT"
"""Optional: the id of the experiment record the file serves (`keel experiment new`)."""


def load_experiment(path: str | Path) -> list[Step]:
    """Import the experiment file at `path` and return its STEPS; UsageError when it cannot."""
    return load_experiment_file(path)[0]


def load_experiment_file(path: str | Path) -> tuple[list[Step], str | None]:
    """Import the experiment file at `path`: its STEPS and its EXPERIMENT id (None when it
    names none); UsageError when it cannot."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"experiment file not found: {path}")
    if file.suffix != ".py":
        raise UsageError(f"experiment file must be a Python file (.py), got {path}")
    resolved = file.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:8]
    module_name = f"keel_experiment_{_identifier(file.stem)}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import experiment file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses defined in the file need their module
    # Worker processes (keel.flow, Ray) cannot import this module by name: ship its functions
    # and classes by value instead.
    cloudpickle.register_pickle_by_value(module)
    if str(resolved.parent) not in sys.path:
        sys.path.insert(0, str(resolved.parent))  # as for a script: siblings are importable
    try:
        spec.loader.exec_module(module)
    except KeelError:
        raise
    except SyntaxError as error:
        raise UsageError(f"{path}:{error.lineno}: syntax error: {error.msg}") from error
    except Exception as error:
        line = _line_in(error, resolved)
        where = f"{path}:{line}" if line else str(path)
        raise UsageError(
            f"{where}: the experiment failed to load: {type(error).__name__}: {error}"
        ) from error
    steps = getattr(module, STEPS_VARIABLE, None)
    if not steps:
        raise UsageError(
            f"{path} declares no steps: define a module-level list {STEPS_VARIABLE} = [step, ...]"
        )
    if not isinstance(steps, (list, tuple)) or not all(isinstance(s, Step) for s in steps):
        raise UsageError(f"{path}: {STEPS_VARIABLE} must be a list of keel.steps.Step objects")
    experiment = getattr(module, EXPERIMENT_VARIABLE, None)
    if experiment is not None and not isinstance(experiment, str):
        raise UsageError(f"{path}: {EXPERIMENT_VARIABLE} must be a string (an experiment id)")
    return list(steps), experiment


def override_steps(roots: Sequence[Step], overrides: Sequence[str]) -> list[Step]:
    """Apply `--set STEP.key=value` overrides to the configs of the named steps. A config with
    a `with_overrides(overrides, key_prefix)` method applies them itself (a data step's keys are
    its stage's fields, without the wrapper that holds them).

    Overriding a step changes its identity, so every step that refers to it is rebuilt to refer to
    the new one (and gets a new identity too). Returns the new roots.
    """
    if not overrides:
        return list(roots)
    steps = all_steps(list(roots))
    by_name: dict[str, list[str]] = {}
    for override in overrides:
        keys, _ = parse_override(override)
        names = {step.name for step in steps}
        if len(keys) < 2 or keys[0] not in names:
            raise ConfigError(
                f"--set {override}: the key must start with a step name "
                f"(steps: {', '.join(sorted(names))})"
            )
        value_text = override.split("=", 1)[1]
        by_name.setdefault(keys[0], []).append(".".join(keys[1:]) + "=" + value_text)

    rebuilt: dict[str, Step] = {}

    def rebuild(step: Step) -> Step:
        if step.identity in rebuilt:
            return rebuilt[step.identity]
        config = map_references(
            step.config, lambda reference: StepRef(rebuild(reference.step), reference.subpath)
        )
        if step.name in by_name:
            if not dataclasses.is_dataclass(config):
                raise ConfigError(
                    f"--set {step.name}...: step {step.name}'s config is a "
                    f"{type(config).__name__}; --set works on dataclass configs"
                )
            prefix = f"{step.name}."
            overriding = getattr(config, "with_overrides", None)
            if callable(overriding):  # a config that maps its own keys (keel.data.steps)
                config = overriding(by_name[step.name], prefix)
            else:
                config = apply_overrides(config, by_name[step.name], key_prefix=prefix)
        new = dataclasses.replace(step, config=config)
        rebuilt[step.identity] = new
        return new

    return [rebuild(root) for root in roots]


def _identifier(text: str) -> str:
    return "".join(char if char.isalnum() else "_" for char in text)


def _line_in(error: BaseException, file: Path) -> int | None:
    """The last line of `file` in the error's traceback, if any."""
    line = None
    for frame in traceback.extract_tb(error.__traceback__):
        if Path(frame.filename) == file:
            line = frame.lineno
    return line
