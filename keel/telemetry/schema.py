"""Namespaces, their options, and turning what a client sends into rows of a namespace's schema.

A namespace is a table: `train.metrics`, `cluster.task_log`. Its name is also a directory under
the store's root, so the name is checked against a strict pattern before it touches the filesystem
(no "..", no "/", nothing a shell or SQL would need to escape beyond double quotes).
A namespace gets its schema from `create` or from its first write; every later write must fit it:
no unknown columns, values castable without loss. Missing nullable columns are filled with nulls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from keel.core.errors import one_line
from keel.telemetry import times
from keel.telemetry.errors import QueryLimitError as QueryLimitError
from keel.telemetry.errors import QueryLimits as QueryLimits
from keel.telemetry.errors import StoreBusyError as StoreBusyError
from keel.telemetry.errors import TelemetryInputError as TelemetryInputError
from keel.telemetry.errors import TelemetryQueryError as TelemetryQueryError

NAMESPACE_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,62}(\.[a-z][a-z0-9_]{0,62}){0,7}")


@dataclass(frozen=True)
class NamespaceOptions:
    """How a namespace's segments are laid out and indexed. None = chosen from the data.

    time_column: a timestamp column used for time pruning, tail and retention (default "ts" if it is
    a timestamp, else the first timestamp column). cluster_by: the sort key inside a segment
    (default: the first postings column, then time), so one key's rows share few row groups.
    bloom_columns: string columns with trigram Bloom filters for LIKE. key_columns: columns with
    exact postings (value -> row groups). count_columns: low-cardinality columns with value counts
    per row group. retention_days: segments whose newest row is older are dropped by compaction.
    time_unit: how epoch numbers sent for a time column are read (s, ms, us or ns since 1970);
    None: they are refused (send ISO-8601 text or Arrow timestamps).
    """

    time_column: str | None = None
    cluster_by: tuple[str, ...] | None = None
    bloom_columns: tuple[str, ...] | None = None
    key_columns: tuple[str, ...] | None = None
    count_columns: tuple[str, ...] | None = None
    retention_days: float | None = None
    time_unit: str | None = None

    def __post_init__(self) -> None:
        times.check_time_unit(self.time_unit)

    def to_dict(self) -> dict[str, Any]:
        return {
            "time_column": self.time_column,
            "cluster_by": _listed(self.cluster_by),
            "bloom_columns": _listed(self.bloom_columns),
            "key_columns": _listed(self.key_columns),
            "count_columns": _listed(self.count_columns),
            "retention_days": self.retention_days,
            "time_unit": self.time_unit,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NamespaceOptions:
        return cls(
            time_column=data.get("time_column"),
            cluster_by=_tupled(data.get("cluster_by")),
            bloom_columns=_tupled(data.get("bloom_columns")),
            key_columns=_tupled(data.get("key_columns")),
            count_columns=_tupled(data.get("count_columns")),
            retention_days=data.get("retention_days"),
            time_unit=data.get("time_unit"),
        )


def check_namespace(name: str) -> str:
    """Return `name` if it is a valid namespace, else raise TelemetryInputError."""
    if not isinstance(name, str) or not NAMESPACE_PATTERN.fullmatch(name):
        raise TelemetryInputError(
            f"invalid namespace {name!r}: use lowercase dotted names such as train.metrics "
            "(letters, digits, _ ; each part starts with a letter)"
        )
    return name


def resolve_options(schema: pa.Schema, options: NamespaceOptions | None) -> NamespaceOptions:
    """Options with the time column filled in, every named column checked against the schema."""
    options = options or NamespaceOptions()
    names = set(schema.names)
    for field_name in ("cluster_by", "bloom_columns", "key_columns", "count_columns"):
        for column in getattr(options, field_name) or ():
            if column not in names:
                raise TelemetryInputError(f"{field_name} names {column!r}, not a column")
    time_column = options.time_column
    if time_column is None:
        stamps = [f.name for f in schema if pa.types.is_timestamp(f.type)]
        time_column = "ts" if "ts" in stamps else (stamps[0] if stamps else None)
    elif time_column not in names or not pa.types.is_timestamp(schema.field(time_column).type):
        raise TelemetryInputError(f"time_column {time_column!r} is not a timestamp column")
    return NamespaceOptions(**{**options.__dict__, "time_column": time_column})


def check_storable(schema: pa.Schema) -> pa.Schema:
    """`schema` if Parquet can hold every column; refuse a struct without fields (JSON `{}`),
    at any depth, which would be acknowledged and then fail every flush."""
    for field in schema:
        pending = [field.type]
        while pending:
            kind = pending.pop()
            if pa.types.is_struct(kind) and kind.num_fields == 0:
                raise TelemetryInputError(
                    f"column {field.name!r} holds an empty object ({{}}), which has no fields to "
                    "store: send a value with keys, null, or leave the key out"
                )
            pending.extend(kind.field(i).type for i in range(kind.num_fields))
    return schema


def infer_schema(data: pa.Table) -> pa.Schema:
    """The schema a new namespace takes from its first rows: plain (not large, not dictionary)
    types; a column with no type (all nulls) or an empty object is refused."""
    fields = []
    for field in data.schema:
        kind = field.type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if pa.types.is_large_string(kind):
            kind = pa.string()
        if pa.types.is_large_binary(kind):
            kind = pa.binary()
        if pa.types.is_null(kind):
            raise TelemetryInputError(
                f"column {field.name!r} holds only nulls, so its type is unknown: "
                "send a value or create the namespace with a schema"
            )
        fields.append(pa.field(field.name, kind))
    return check_storable(pa.schema(fields))


def to_table(data: Any, schema: pa.Schema | None, time_unit: str | None = None) -> pa.Table:
    """Rows as an Arrow table in `schema` (or as sent, when the namespace is new).

    `data`: a pa.Table, a pa.RecordBatch, or a list of row dicts (JSON). `time_unit`: how epoch
    numbers in time columns are read (None: refused). Raises TelemetryInputError naming the first
    column that does not fit: an unknown or repeated column, a value of another type, a time
    outside 0001-01-01 .. 9999-12-31.
    """
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if isinstance(data, list):
        data = _rows_to_table(data, schema, time_unit)
    if not isinstance(data, pa.Table):
        raise TelemetryInputError(
            f"cannot write {type(data).__name__}: send an Arrow table or a list of row objects"
        )
    if data.num_rows and not data.num_columns:
        raise TelemetryInputError("rows without columns: send at least one column")
    repeated = sorted({n for n in data.column_names if data.column_names.count(n) > 1})
    if repeated:
        raise TelemetryInputError(
            f"column {repeated[0]!r} appears {data.column_names.count(repeated[0])} times: "
            "send each column once"
        )
    if schema is None:
        data = _cast(data, infer_schema(data)) if data.num_columns else data
    else:
        data = _conform(data, schema, time_unit)
    for field in data.schema:
        if pa.types.is_timestamp(field.type):
            times.check_times(field.name, data.column(field.name))
    return data


def _cast(data: pa.Table, schema: pa.Schema) -> pa.Table:
    try:
        return data.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as error:
        # e.g. objects in a list where one lacks another's keys ([{"a": null}, {}]): pyarrow builds
        # the column but cannot cast it
        raise TelemetryInputError(f"rows cannot be stored: {one_line(error)}") from None


def _rows_to_table(rows: list[Any], schema: pa.Schema | None, time_unit: str | None) -> pa.Table:
    columns: dict[str, list[Any]] = {}
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TelemetryInputError(f"row {index} is a {type(row).__name__}, not an object")
        for key in row:
            if key not in columns:
                if schema is not None and key not in schema.names:
                    raise TelemetryInputError(f"row {index} has column {key!r}, not in the schema")
                columns[key] = []
    for key, values in columns.items():
        values.extend(row.get(key) for row in rows)
    arrays = {}
    for key, values in columns.items():
        target = schema.field(key).type if schema is not None else None
        if target is None and _names_a_time(key):
            target = pa.timestamp("us")  # a new namespace: ISO text or epoch numbers become times
        epochs = None
        if target is not None and pa.types.is_timestamp(target):
            epochs = _epochs_read(key, values, time_unit, target)
        arrays[key] = epochs if epochs is not None else _json_column(key, values, target)
    return pa.table(arrays) if arrays else pa.table({})


def _epochs_read(
    name: str, values: list[Any], time_unit: str | None, target: pa.TimestampType
) -> pa.Array | None:
    """A JSON time column holding epoch numbers as `target` timestamps (None: it holds none).
    Numbers are read in `time_unit` (refused without one); text is parsed as ISO-8601."""
    numeric = [isinstance(v, int | float) and not isinstance(v, bool) for v in values]
    if not any(numeric):
        return None
    counts: list[Any] = [None] * len(values)
    text = []
    for i, (value, is_number) in enumerate(zip(values, numeric, strict=True)):
        if is_number:
            counts[i] = times.epoch_to_target(name, value, time_unit, target)
        elif value is not None:
            text.append(i)
    if text:
        parsed = _json_column(name, [values[i] for i in text], target).cast(pa.int64())
        for i, count in zip(text, parsed.to_pylist(), strict=True):
            counts[i] = count
    return pa.array(counts, pa.int64()).cast(target)


def _names_a_time(column: str) -> bool:
    """Column names that hold times in JSON rows (where times arrive as text or numbers)."""
    return column in ("ts", "time", "timestamp") or column.endswith(("_ts", "_at", "_time"))


def _json_column(name: str, values: list[Any], target: pa.DataType | None) -> pa.Array:
    try:
        if target is None:
            return pa.array(values)
        try:
            return pa.array(values, type=target)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            # Timestamps sent as ISO-8601 strings or epoch numbers arrive untyped; cast them.
            untyped = pa.array(values)
        if not _castable(untyped.type, target):
            raise TelemetryInputError(
                f"column {name!r}: values of type {untyped.type}, the schema says {target}"
            )
        return untyped.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as error:
        expected = f" as {target}" if target is not None else ""
        raise TelemetryInputError(
            f"column {name!r}: cannot read its values{expected}: {one_line(error)}"
        ) from None


def _conform(data: pa.Table, schema: pa.Schema, time_unit: str | None) -> pa.Table:
    unknown = [name for name in data.column_names if name not in schema.names]
    if unknown:
        raise TelemetryInputError(f"column {unknown[0]!r} is not in the namespace's schema")
    columns = []
    for field in schema:
        if field.name not in data.column_names:
            if not field.nullable:
                raise TelemetryInputError(f"column {field.name!r} is missing")
            columns.append(pa.nulls(data.num_rows, field.type))
            continue
        column = data.column(field.name)
        if pa.types.is_timestamp(field.type) and pa.types.is_integer(column.type):
            column = times.integers_to_times(field.name, column, time_unit, field.type)
        if column.type != field.type:
            if not _castable(column.type, field.type):
                raise TelemetryInputError(
                    f"column {field.name!r} is {column.type}, the schema says {field.type}"
                )
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
                raise TelemetryInputError(
                    f"column {field.name!r} is {column.type}, the schema says {field.type}: "
                    f"{one_line(error)}"
                ) from None
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)


def _castable(source: pa.DataType, target: pa.DataType) -> bool:
    """Whether a value of `source` may be stored as `target`: the same kind of value (numbers
    widened, strings in any encoding, timestamps given as timestamps or ISO text), never a number
    as text or text as a number. Epoch numbers are read before this, in a declared time unit."""
    types = pa.types
    if types.is_dictionary(source):
        source = source.value_type
    if types.is_null(source):
        return True
    if types.is_integer(target):
        return types.is_integer(source)
    if types.is_floating(target):
        return types.is_integer(source) or types.is_floating(source)
    if types.is_string(target) or types.is_large_string(target):
        return types.is_string(source) or types.is_large_string(source)
    if types.is_timestamp(target):
        return (
            types.is_timestamp(source) or types.is_string(source) or types.is_large_string(source)
        )
    return source == target


def schema_to_json(schema: pa.Schema) -> dict[str, str]:
    """{column: Arrow type string}, in column order (for manifests and the server)."""
    return {field.name: str(field.type) for field in schema}


def _listed(value: tuple[str, ...] | None) -> list[str] | None:
    return list(value) if value is not None else None


def _tupled(value: list[str] | None) -> tuple[str, ...] | None:
    return tuple(value) if value is not None else None
