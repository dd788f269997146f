"""Canonical JSON and content hashes of configs.

A step's identity is the hash of its config, so the same config must give the same bytes on every
machine and Python run: keys sorted, no whitespace, UTF-8, and one spelling per value.

Values and how they are rendered:
- None, bool, int, str: as JSON.
- float: integral values below 2**53 render as integers (1.0 -> 1, so `lr: 1` in YAML and `lr=1.0`
  in Python hash alike); others by Python's shortest round-trip repr; NaN and +-inf as the strings
  "NaN", "Infinity", "-Infinity"; -0.0 as 0.
- list, tuple: JSON arrays. set, frozenset: arrays sorted by their elements' canonical text.
- dict: keys must be str (or int, rendered as str); sorted.
- dataclass instance: an object of its fields (the class name is not part of it, so moving or
  renaming a config class does not invalidate caches).
- Enum member: its value. pathlib.PurePath: its POSIX string. bytes: {"__bytes__": hex}.
Anything else (a function, a lambda, an open file, a socket, an arbitrary object) raises
UnhashableConfigError naming where it sits, unless the caller's `encode` hook turns it into one of
the above (keel.steps uses that to replace references to other steps by their identities).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

from keel.core.errors import UnhashableConfigError

Encoder = Callable[[Any], Any]
"""A hook that maps a value it knows to canonical-able data, or returns NOT_HANDLED."""

NOT_HANDLED: Any = object()
_MAX_EXACT_INT_FLOAT = 2**53


def to_canonical(value: Any, encode: Encoder | None = None, *, where: str = "config") -> Any:
    """Return plain JSON data (dict / list / str / int / float / bool / None) for `value`.

    `where` names the position for error messages, e.g. "config.tokenizer.path". A dataclass
    field declared with `metadata={"identity": False}` is left out: it says where to report or
    how to run, not what is computed (the same work with another setting is the same step).
    """
    if encode is not None:
        encoded = encode(value)
        if encoded is not NOT_HANDLED:
            return to_canonical(encoded, encode, where=where)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return to_canonical(value.value, encode, where=where)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _canonical_float(value)
    if isinstance(value, pathlib.PurePath):
        return value.as_posix()
    if isinstance(value, bytes):
        return {"__bytes__": value.hex()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: to_canonical(
                getattr(value, field.name), encode, where=f"{where}.{field.name}"
            )
            for field in dataclasses.fields(value)
            if field.metadata.get("identity", True)
        }
    if isinstance(value, Mapping):
        return _canonical_mapping(value, encode, where)
    if isinstance(value, (list, tuple)):
        return [to_canonical(item, encode, where=f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        items = [to_canonical(item, encode, where=f"{where}{{}}") for item in value]
        return sorted(items, key=canonical_json_text)
    raise UnhashableConfigError(
        f"{where}: a {_describe(value)} cannot be part of a config (it has no stable content to "
        "hash); use plain data (numbers, strings, lists, dicts, dataclasses) instead"
    )


def canonical_json(value: Any, encode: Encoder | None = None, *, where: str = "config") -> str:
    """Canonical JSON text of `value` (see the module docstring for the rules)."""
    return canonical_json_text(to_canonical(value, encode, where=where))


def canonical_json_text(data: Any) -> str:
    """Serialise data that is already canonical: sorted keys, no spaces, non-ASCII kept as UTF-8."""
    return json.dumps(
        data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def content_hash(value: Any, encode: Encoder | None = None, *, where: str = "config") -> str:
    """SHA-256 (64 hex chars) of the canonical JSON of `value`, encoded as UTF-8."""
    text = canonical_json(value, encode, where=where)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _canonical_float(value: float) -> int | float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if value.is_integer() and abs(value) < _MAX_EXACT_INT_FLOAT:
        return int(value)  # also maps -0.0 to 0
    return value


def _canonical_mapping(value: Mapping[Any, Any], encode: Encoder | None, where: str) -> dict:
    result: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(key, enum.Enum):
            key = key.value
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise UnhashableConfigError(
                f"{where}: dict key {key!r} is a {type(key).__name__}; config dict keys must be "
                "strings or integers"
            )
        text_key = str(key)
        if text_key in result:
            raise UnhashableConfigError(f"{where}: dict keys {key!r} and '{text_key}' collide")
        result[text_key] = to_canonical(item, encode, where=f"{where}.{text_key}")
    return result


def _describe(value: Any) -> str:
    if getattr(value, "__name__", None) == "<lambda>":
        return "lambda"
    if callable(value) and hasattr(value, "__code__"):
        return f"function ({value.__qualname__})"
    if hasattr(value, "read") or hasattr(value, "fileno"):
        return f"open file or stream ({type(value).__name__})"
    return f"value of type {type(value).__module__}.{type(value).__qualname__}"
