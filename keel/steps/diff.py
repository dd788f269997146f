"""What differs between a step and its nearest cached output: why `keel run --dry-run` would run it.

A step runs when no output with its identity is committed. The committed outputs of the same step
name under the prefix are its earlier versions; each record keeps the config as it was hashed
(references to other steps as {"__step__": identity, "subpath": ...}). The nearest one is the one
whose config differs in the fewest keys (the newest on a tie). Against it a step's changes are
said as dotted config keys with the cached and the new value, a changed `version`, and the
upstream steps whose outputs changed (a reference that now points at another identity).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from keel.core import paths
from keel.steps.record import StepRecord
from keel.steps.step import HASH_CHARS, Step
from keel.steps.store import StepStore

REFERENCE_KEY = "__step__"
"""How a reference to another step's output appears in a canonical config."""
MISSING: Any = "<absent>"
"""The value shown for a key one side does not have."""
SHOWN_KEYS = 6
"""Changed keys the one-line reason names; `to_dict` has them all."""
SHOWN_CHARS = 60
"""A value in the one-line reason is cut to this many characters."""


@dataclass(frozen=True)
class KeyChange:
    """One config key (dotted: `optimizer.lr`, `inputs.0`) whose value changed."""

    key: str
    cached: Any
    now: Any


@dataclass(frozen=True)
class StepDiff:
    """How a step differs from its nearest cached output (`nearest`: that output's directory
    name), or from nothing (`nearest` None: no output of this step name is committed)."""

    nearest: str | None
    changed: tuple[KeyChange, ...] = ()
    upstream: tuple[str, ...] = field(default=())
    """Names of the steps this one reads whose outputs changed, in config order."""

    def describe(self) -> str:
        """One line: `value: 1 -> 5; upstream changed: a` (or why there is nothing to compare)."""
        if self.nearest is None:
            return "not run yet"
        parts = [
            f"{change.key}: {_show(change.cached)} -> {_show(change.now)}"
            for change in self.changed[:SHOWN_KEYS]
        ]
        if len(self.changed) > SHOWN_KEYS:
            parts.append(f"and {len(self.changed) - SHOWN_KEYS} more keys")
        if self.upstream:
            parts.append(f"upstream changed: {', '.join(self.upstream)}")
        return "; ".join(parts) or f"same config as {self.nearest}, not committed"

    def to_dict(self) -> dict[str, Any]:
        return {
            "nearest": self.nearest,
            "changed": {c.key: {"cached": c.cached, "now": c.now} for c in self.changed},
            "upstream_changed": list(self.upstream),
        }


def committed_by_name(store: StepStore, names: set[str]) -> dict[str, list[StepRecord]]:
    """Step name -> records of its committed outputs under the store's prefix, newest first,
    for the step names in `names` (only their records are read)."""
    found: dict[str, list[StepRecord]] = {}
    for dir_name in paths.list_dir(store.prefix):
        name, dash, digest = dir_name.rpartition("-")
        if not dash or len(digest) != HASH_CHARS or name not in names:
            continue
        record = store.output_record(dir_name)
        if record is not None and record.name == name:
            found.setdefault(name, []).append(record)
    for records in found.values():
        records.sort(key=lambda record: record.end_time or record.start_time, reverse=True)
    return found


def diff_step(step: Step, cached: list[StepRecord], names: dict[str, str]) -> StepDiff:
    """`step` against the nearest of `cached` (committed records of its name, newest first).

    `names` maps step identities to step names, to name the upstream steps that changed."""
    now = _flatten(json.loads(step.canonical_config))
    best: StepDiff | None = None
    best_size = 0
    for record in cached:
        if record.identity == step.identity:
            continue
        diff = _against(step, record, now, names)
        size = len(diff.changed) + len(diff.upstream)
        if best is None or size < best_size:
            best, best_size = diff, size
    return best or StepDiff(None)


def _against(step: Step, record: StepRecord, now: dict[str, Any], names: dict) -> StepDiff:
    before = _flatten(record.config)
    changed: list[KeyChange] = []
    upstream: list[str] = []
    if record.version != step.version:
        changed.append(KeyChange("version", record.version, step.version))
    for key in sorted(before.keys() | now.keys(), key=_key_order):
        old, new = before.get(key, MISSING), now.get(key, MISSING)
        if old == new:
            continue
        if _is_reference(new) and _is_reference(old):
            name = names.get(new[REFERENCE_KEY], new[REFERENCE_KEY][:HASH_CHARS])
            if old[REFERENCE_KEY] != new[REFERENCE_KEY] and name not in upstream:
                upstream.append(name)
            if old.get("subpath") == new.get("subpath"):
                continue
        changed.append(KeyChange(key, _plain(old), _plain(new)))
    return StepDiff(record.output.rstrip("/").rpartition("/")[2], tuple(changed), tuple(upstream))


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> leaf value of a canonical config; a reference is one leaf."""
    if isinstance(value, dict) and not _is_reference(value) and value:
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}{key}."))
        return flat
    if isinstance(value, list) and value:
        flat = {}
        for index, item in enumerate(value):
            flat.update(_flatten(item, f"{prefix}{index}."))
        return flat
    return {prefix.rstrip(".") or "config": value}


def _is_reference(value: Any) -> bool:
    return isinstance(value, dict) and REFERENCE_KEY in value


def _plain(value: Any) -> Any:
    """A reference as `output_of(<hash8>)`, anything else as it is."""
    if _is_reference(value):
        subpath = f", {value.get('subpath')!r}" if value.get("subpath") else ""
        return f"output_of({value[REFERENCE_KEY][:HASH_CHARS]}{subpath})"
    return value


def _key_order(key: str) -> list[tuple[int, int | str]]:
    """Dotted keys in order, list indices numerically (inputs.2 before inputs.10)."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in key.split(".")]


def _show(value: Any) -> str:
    """A value as JSON, cut to SHOWN_CHARS characters."""
    text = value if isinstance(value, str) and value == MISSING else json.dumps(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
