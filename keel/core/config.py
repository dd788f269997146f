"""Typed configs: dataclasses loaded from YAML/JSON files and `--set key=value` overrides.

A config is a (usually frozen) dataclass, possibly holding other dataclasses. This module turns
plain data into such an object and back, checking every value against the field annotations, so a
typo or a wrong type fails at load time with a one-line message naming the key, instead of deep
inside a training run.

- `from_dict` / `to_dict`: plain data <-> dataclass; `from_dict(type(x), to_dict(x)) == x`.
- `load_config` / `dump_config`: the same, through a .yaml/.yml/.json file.
  A field with `metadata={"legacy": True}` (a key kept only so old files still load) is left
  out while it holds its default.
- `parse_override` / `apply_overrides`: "model.d_model=512" style edits, applied by building new
  objects with `dataclasses.replace` (frozen configs are never mutated).

One checker, `_coerce`, does all type checking for both files and overrides. It supports int, float
(an int, or a string float() reads, such as "1e-3", which YAML 1.1 leaves a string), str, bool
(never an int), None and unions, Literal, Enum (by value or name), Path/PurePath (from str),
list[X], tuple[X, ...], tuple[X, Y], dict[K, V], nested dataclasses (from mappings) and Any.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from keel.core import paths
from keel.core.errors import ConfigError, did_you_mean

T = TypeVar("T")

_SUFFIXES = (".yaml", ".yml", ".json")


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "config") -> T:
    """Build dataclass `cls` from plain data, checking each value against its field's annotation.

    `where` names the root in error messages, e.g. "config.model.d_model: expected int, ...".
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    return _coerce(data, cls, where)


def to_dict(obj: Any) -> dict[str, Any]:
    """Turn a dataclass instance into plain YAML/JSON-able data (enums as values, paths as str)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_dict needs a dataclass instance, got {obj!r}")
    return _plain(obj)


def load_config(source: str | os.PathLike[str], cls: type[T], overrides: Sequence[str] = ()) -> T:
    """Read a .yaml/.yml/.json file into dataclass `cls`, then apply `--set` style overrides."""
    path = os.fspath(source)
    suffix = _check_suffix(path)
    try:
        text = paths.read_text(path)
    except FileNotFoundError as err:
        raise ConfigError(f"config file not found: {path}; check the path") from err
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"{path}:{err.lineno}: invalid JSON: {err.msg}; fix the file"
            ) from err
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{path}{line}: invalid YAML: {problem}; fix the file") from err
        data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {_describe(data)}")
    try:
        obj = from_dict(cls, data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from err
    return apply_overrides(obj, overrides)


def dump_config(obj: Any, path: str) -> None:
    """Write `to_dict(obj)` to a .yaml/.yml/.json file, chosen by the file's extension."""
    data = to_dict(obj)
    if _check_suffix(path) == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        text = yaml.safe_dump(data, sort_keys=False)
    paths.write_text(path, text)


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """Split "a.b.c=VALUE" into (("a", "b", "c"), value); VALUE is read as YAML ("" if empty)."""
    keys, raw = _split_override(text, "--set")
    return keys, _parse_value(raw, f"--set {text}")


def apply_overrides(
    obj: T, overrides: Sequence[str], *, where: str = "--set", key_prefix: str = ""
) -> T:
    """Return a copy of dataclass `obj` with each "dotted.key=value" override applied in order.

    Errors name the override as `{where} {key_prefix}{override}`: keel.steps passes the step name
    as `key_prefix`, so a message shows what the user typed ("--set count.min_len=3").

    Paths walk through nested dataclasses and dict fields (a dict may gain a new key). Values are
    checked like `from_dict` checks them. A YAML scalar that does not fit but whose text does is
    taken as text, so `--set name=2024` or `--set name=no` sets a str field to what was typed.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"apply_overrides needs a dataclass instance, got {obj!r}")
    for text in overrides:
        keys, raw = _split_override(text, where)
        obj = _with_value(obj, Any, keys, (), raw, f"{where} {key_prefix}{text}")
    return obj


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Return `value` as an instance of `annotation`, or raise ConfigError saying why not."""
    if annotation is Any:
        return value
    if annotation is None or annotation is type(None):
        if value is None:
            return None
        raise _mismatch(value, annotation, where)
    if annotation in (list, tuple, dict):
        annotation = {list: list[Any], tuple: tuple[Any, ...], dict: dict[Any, Any]}[annotation]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        if len(options) == 1:  # Optional[X]: X's own error says more than "expected X | None"
            return _coerce(value, options[0], where)
        for option in options:
            try:
                return _coerce(value, option, where)
            except ConfigError:
                continue
        raise _mismatch(value, annotation, where)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _mismatch(value, annotation, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _mismatch(value, annotation, where)
        if origin is list:
            return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
        if len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],) * len(value)
        if len(args) != len(value):
            raise _mismatch(value, annotation, where)
        return tuple(_coerce(v, args[i], f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _mismatch(value, annotation, where)
        return {
            _coerce(k, args[0], f"{where} (key {k!r})"): _coerce(v, args[1], f"{where}.{k}")
            for k, v in value.items()
        }
    if origin is not None or not isinstance(annotation, type):
        raise TypeError(f"{where}: keel configs cannot check the annotation {annotation!r}")
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if isinstance(value, Mapping):
            return _build(annotation, value, where)
    elif annotation is bool or annotation is str:
        if isinstance(value, annotation):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass  # falls through to the mismatch error below
    elif issubclass(annotation, enum.Enum):
        for member in annotation:
            if member.value == value and isinstance(value, bool) == isinstance(member.value, bool):
                return member
        if isinstance(value, str) and value in annotation.__members__:
            return annotation[value]
    elif issubclass(annotation, pathlib.PurePath):
        if isinstance(value, (str, os.PathLike)):
            return annotation(value)
    elif isinstance(value, annotation):
        return value
    raise _mismatch(value, annotation, where)


def _build(cls: type[T], data: Mapping[Any, Any], where: str) -> T:
    """Make dataclass `cls` from a mapping: no unknown keys, no missing required ones."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    unknown = [k for k in data if k not in names]
    if unknown:
        hint = did_you_mean(str(unknown[0]), names)
        paths = ", ".join(f"{where}.{k}" for k in unknown)
        raise ConfigError(f"{paths}: unknown key{hint}; valid keys: {', '.join(names)}")
    missing = [
        f.name
        for f in fields
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {', '.join(missing)}; add them")
    hints = get_type_hints(cls)
    return cls(**{k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()})


def _with_value(
    node: Any, annotation: Any, keys: tuple[str, ...], done: tuple[str, ...], raw: str, label: str
) -> Any:
    """Return `node` with the value at `keys` set from the override text `raw` (never mutates)."""
    if not keys:
        value = _parse_value(raw, label)
        try:
            return _coerce(value, annotation, label)
        except ConfigError as err:
            if isinstance(value, (str, list, dict)):
                raise
            try:
                return _coerce(raw.strip(), annotation, label)
            except ConfigError:
                raise err from None
    key, rest = keys[0], keys[1:]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        names = [f.name for f in dataclasses.fields(node) if f.init]
        if key not in names:
            owner = type(node).__name__
            raise ConfigError(
                f"{label}: no key {key!r} in {owner}{did_you_mean(key, names)} (keys: "
                f"{', '.join(names)})"
            )
        child_annotation = get_type_hints(type(node))[key]
        new = _with_value(getattr(node, key), child_annotation, rest, (*done, key), raw, label)
        return dataclasses.replace(node, **{key: new})
    if isinstance(node, (tuple, list)) and key.isdigit():
        if int(key) >= len(node):
            where = ".".join(done)
            raise ConfigError(f"{label}: {where} has {len(node)} items, no item {key}")
        index = int(key)
        item_annotation = _item_type(annotation, index)
        new = _with_value(node[index], item_annotation, rest, (*done, key), raw, label)
        return type(node)([*node[:index], new, *node[index + 1 :]])
    key_value = _dict_types(annotation)
    if isinstance(node, Mapping) and key_value is not None:
        if rest and key not in node:
            shown = ", ".join(map(str, node))
            raise ConfigError(f"{label}: no key {key!r} in {'.'.join(done)} (keys: {shown})")
        new = _with_value(node.get(key), key_value[1], rest, (*done, key), raw, label)
        return {**node, _coerce(key, key_value[0], label): new}
    raise ConfigError(
        f"{label}: {'.'.join(done)} holds {_describe(node)}, which has no key {key!r}; "
        f"set {'.'.join(done)} as a whole"
    )


def _item_type(annotation: Any, index: int) -> Any:
    """The annotation of item `index` of a tuple[X, ...], tuple[X, Y] or list[X] annotation."""
    args = get_args(annotation)
    if get_origin(annotation) not in (tuple, list) or not args:
        return Any
    if get_origin(annotation) is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        return args[index] if index < len(args) else Any
    return args[0]


def _dict_types(annotation: Any) -> tuple[Any, Any] | None:
    """(key, value) annotations if `annotation` allows a dict (dict[K, V], dict, Any), else None."""
    if annotation is Any or annotation is dict:
        return Any, Any
    if get_origin(annotation) is dict:
        return get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        found = [t for t in map(_dict_types, get_args(annotation)) if t is not None]
        return found[0] if found else None
    return None


def _split_override(text: str, where: str) -> tuple[tuple[str, ...], str]:
    key, sep, raw = text.partition("=")
    keys = tuple(part.strip() for part in key.split("."))
    if not sep or not all(keys):
        raise ConfigError(f"{where} expects key=value, got {text!r}")
    return keys, raw


def _parse_value(raw: str, label: str) -> Any:
    if not raw.strip():
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or "not valid YAML"
        raise ConfigError(f"{label}: cannot read the value ({problem}); quote it") from err


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.init and not (f.metadata.get("legacy") and getattr(value, f.name) == f.default)
        }
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _check_suffix(path: str | os.PathLike[str]) -> str:
    suffix = pathlib.PurePosixPath(os.fspath(path)).suffix.lower()
    if suffix not in _SUFFIXES:
        raise ConfigError(f"{path}: unsupported config format {suffix!r}; use .yaml, .yml or .json")
    return suffix


def _mismatch(value: Any, annotation: Any, where: str) -> ConfigError:
    return ConfigError(f"{where}: expected {_name(annotation)}, got {_describe(value)}")


def _name(annotation: Any) -> str:
    """A short readable spelling of an annotation, for error messages."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is None or annotation is type(None):
        return "None"
    if origin in (Union, types.UnionType):
        return " | ".join(map(_name, args))
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return f"{annotation.__name__} (one of {', '.join(repr(m.value) for m in annotation)})"
    return getattr(annotation, "__name__", repr(annotation))


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
