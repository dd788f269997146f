"""Steps: named functions over configs, identified by the content of what they compute.

A Step is (name, function, config, version). One step's config refers to another step's output
with `output_of(step)`: that reference is both the data dependency (the executor runs the other
step first and passes its output path) and part of the identity (the reference hashes as the other
step's identity). A step's identity is the SHA-256 of the canonical JSON of {name, config,
version}; it never includes the storage prefix, region, user, time or the function's code. To
invalidate outputs after changing what a function computes, change `version`.

A step function is called as `fn(config, output_path)`: `config` is the step's config with every
reference replaced by the path (a string) of that step's committed output, and `output_path` is an
empty staging directory to write into. The executor commits it atomically when `fn` returns.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from keel.core import paths
from keel.core.errors import UsageError
from keel.core.hashing import NOT_HANDLED, canonical_json, content_hash

StepFunction = Callable[[Any, str], None]
"""fn(config, output_path): writes the step's output into `output_path` (a staging directory)."""

HASH_CHARS = 8
"""Hex characters of the identity in an output directory name: `{name}-{identity[:8]}`."""

_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True, eq=False)
class Step:
    """One unit of cached work. Equality is by identity: two equal steps compute the same thing."""

    name: str
    fn: StepFunction
    config: Any = None
    version: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_PATTERN.match(self.name):
            raise UsageError(
                f"step name {self.name!r} is not allowed: use letters, digits, '_', '-' and '.', "
                "starting with a letter or digit"
            )
        if not callable(self.fn):
            raise UsageError(f"step {self.name}: fn must be callable, got {type(self.fn).__name__}")

    @cached_property
    def identity(self) -> str:
        """SHA-256 hex of {name, config (references -> identities), version}."""
        return content_hash(self._identity_payload(), _encode_reference, where=self.name)

    @cached_property
    def canonical_config(self) -> str:
        """The canonical JSON of the config as hashed (references shown as identities)."""
        return canonical_json(self.config, _encode_reference, where=f"{self.name}.config")

    @property
    def dir_name(self) -> str:
        """The output directory's name under the prefix: `{name}-{hash8}`."""
        return f"{self.name}-{self.identity[:HASH_CHARS]}"

    @cached_property
    def dependencies(self) -> tuple[Step, ...]:
        """The steps this config refers to, each once, in the order they first appear."""
        seen: dict[str, Step] = {}
        for reference in _walk_references(self.config):
            seen.setdefault(reference.step.identity, reference.step)
        return tuple(seen.values())

    def _identity_payload(self) -> dict[str, Any]:
        return {"name": self.name, "config": self.config, "version": self.version}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Step) and other.identity == self.identity

    def __hash__(self) -> int:
        return hash(self.identity)

    def __repr__(self) -> str:
        return f"Step({self.dir_name})"


@dataclass(frozen=True)
class StepRef:
    """A reference to another step's output directory, or to a path inside it (`subpath`)."""

    step: Step
    subpath: str = ""

    def resolve(self, prefix: str) -> str:
        """The path this reference stands for when the output lives under `prefix`."""
        base = output_path(prefix, self.step)
        parts = [part for part in self.subpath.split("/") if part]
        return paths.join(base, *parts) if parts else base


def output_of(step: Step, subpath: str = "") -> Any:
    """Refer to `step`'s output (or a file inside it) from another step's config.

    Typed Any so that it can stand in a field annotated `str`; the executor replaces it by a path.
    """
    if not isinstance(step, Step):
        raise UsageError(f"output_of expects a Step, got {type(step).__name__}")
    return StepRef(step, subpath)


def output_path(prefix: str, step: Step) -> str:
    """Where `step`'s committed output lives: `{prefix}/{name}-{hash8}`."""
    return paths.join(prefix, step.dir_name)


def resolve_config(config: Any, prefix: str) -> Any:
    """A copy of `config` with every StepRef replaced by its output path under `prefix`."""
    return map_references(config, lambda reference: reference.resolve(prefix))


def map_references(config: Any, replace: Callable[[StepRef], Any]) -> Any:
    """A copy of `config` with every StepRef `r` (in dataclasses, dicts, lists, tuples) replaced by
    `replace(r)`; everything else is kept as it is."""
    if isinstance(config, StepRef):
        return replace(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        changes = {
            field.name: map_references(getattr(config, field.name), replace)
            for field in dataclasses.fields(config)
            if field.init
        }
        return dataclasses.replace(config, **changes)
    if isinstance(config, dict):
        return {key: map_references(value, replace) for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return type(config)(map_references(item, replace) for item in config)
    return config


def all_steps(roots: list[Step]) -> list[Step]:
    """`roots` and everything they depend on, each once, dependencies before dependents."""
    ordered: dict[str, Step] = {}

    def visit(step: Step) -> None:
        if step.identity in ordered:
            return
        for dependency in step.dependencies:
            visit(dependency)
        ordered[step.identity] = step

    for root in roots:
        visit(root)
    return list(ordered.values())


def _encode_reference(value: Any) -> Any:
    if isinstance(value, StepRef):
        return {"__step__": value.step.identity, "subpath": value.subpath}
    if isinstance(value, Step):
        raise UsageError(
            f"a config holds step {value.name} itself; refer to its output with output_of(step)"
        )
    return NOT_HANDLED


def _walk_references(value: Any) -> Iterator[StepRef]:
    if isinstance(value, StepRef):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _walk_references(getattr(value, field.name))
    elif isinstance(value, dict):
        for item in value.values():
            yield from _walk_references(item)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from _walk_references(item)
