"""How a segment's columns are encoded in Parquet: dictionaries only where they pay.

pyarrow dictionary-encodes every column by default and falls back to plain encoding inside a
column chunk once the dictionary passes 1 MB. For a column of nearly unique values (a log
message, a timestamp) that writes a 1 MB dictionary page and a dictionary-coded first stretch in
every row group, which readers must decode before the rest: measured on 16,384-row groups of the
benchmark's logs, dropping it made a segment ~11% smaller and a time range query that reads whole
row groups ~15% faster in DuckDB. So a flat column keeps its dictionary only when a row group's
worth of its values repeats (at most DICTIONARY_MAX_SHARE distinct); integer and timestamp
columns without one are delta-encoded (DELTA_BINARY_PACKED), which suits times increasing within
each key's run. Nested columns keep pyarrow's default, a dictionary for every leaf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

DICTIONARY_MAX_SHARE = 0.5  # distinct values / rows of a sampled row group, above which: plain


@dataclass(frozen=True)
class Encodings:
    """Arguments for pq.write_table: Parquet column paths to dictionary-encode, and the
    encoding of other columns that get a non-default one."""

    dictionary: list[str] = field(default_factory=list)
    column_encoding: dict[str, str] = field(default_factory=dict)


def choose_encodings(table: pa.Table, sample_rows: int) -> Encodings:
    """Encodings for `table`'s columns, judged on its first `sample_rows` rows (a row group:
    Parquet keeps one dictionary per column chunk)."""
    sample = table.slice(0, max(1, sample_rows))
    encodings = Encodings()
    for column in table.schema:
        kind = column.type
        if _is_nested(kind):
            encodings.dictionary.extend(leaf_paths(column.name, kind))
            continue
        if "." in column.name:
            continue  # pyarrow reads a dotted name as a nested path: it cannot be named here
        values = sample.column(column.name)
        valid = len(values) - values.null_count
        distinct = pc.count_distinct(values).as_py() if valid else 0
        if distinct <= DICTIONARY_MAX_SHARE * max(1, valid):
            encodings.dictionary.append(column.name)
        elif pa.types.is_integer(kind) or pa.types.is_timestamp(kind):
            encodings.column_encoding[column.name] = "DELTA_BINARY_PACKED"
    return encodings


def leaf_paths(name: str, kind: pa.DataType) -> list[str]:
    """The Parquet column paths of a column's leaves, as pyarrow names them ("s.x",
    "l.list.element", "m.key_value.key"), in schema order."""
    paths = []
    pending = [(name, kind)]
    while pending:
        path, current = pending.pop()
        if pa.types.is_struct(current):
            children = [
                (f"{path}.{current.field(i).name}", current.field(i).type)
                for i in range(current.num_fields)
            ]
        elif pa.types.is_map(current):
            children = [
                (f"{path}.key_value.key", current.key_type),
                (f"{path}.key_value.value", current.item_type),
            ]
        elif _is_list(current):
            children = [(f"{path}.list.element", current.value_type)]
        else:
            paths.append(path)
            continue
        pending.extend(reversed(children))
    return paths


def _is_list(kind: pa.DataType) -> bool:
    return (
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    )


def _is_nested(kind: pa.DataType) -> bool:
    return pa.types.is_struct(kind) or pa.types.is_map(kind) or _is_list(kind)
