"""DuckDB's syntax tree of a query (`json_serialize_sql`): walking it and reading its constants.

A constant's value is read from the tree when it is a plain literal (a string, an integer, a
boolean, or a time written as `TIMESTAMP 'YYYY-MM-DD[ HH:MM:SS[.ffffff]]'` or as such a string),
and otherwise computed by DuckDB from the constant's own text, one query each (~0.3 ms idle,
well over 1 ms on a busy machine: a query with a time range and a level paid three). Either way
the value is the one DuckDB's comparison sees.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

import duckdb

CONSTANT_FUNCTIONS = {"to_timestamp", "make_timestamp", "epoch_ms", "strptime", "concat"}
_NOT_CONSTANT = ("COLUMN_REF", "SUBQUERY", "STAR", "WINDOW", "PARAMETER", "LAMBDA")
_ISO_TIME = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})(?:[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,6}))?)?", re.ASCII
)
_TIME_TYPES = ("TIMESTAMP", "TIMESTAMPTZ")  # naive text in either: UTC (the store's time zone)
_EPOCH = datetime.datetime(1970, 1, 1)
_MICROSECOND = datetime.timedelta(microseconds=1)
_UNKNOWN = object()


def walk(node: Any):
    """Every dict in the tree, parents first (a stack, not recursion: trees can be deep)."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))


def is_constant(expression: dict[str, Any]) -> bool:
    for item in walk(expression):
        kind = item.get("class")
        if kind in _NOT_CONSTANT:
            return False
        if kind == "FUNCTION" and not (
            item.get("is_operator") or item.get("function_name") in CONSTANT_FUNCTIONS
        ):
            return False
    return True


def constant_text(sql: str, expression: dict[str, Any]) -> str | None:
    """The SQL text of a constant expression, or None when it is not one or has no location."""
    start, length = expression.get("query_location"), expression.get("query_location_length", 0)
    if start is None or start >= 2**63 or not length or not is_constant(expression):
        return None
    try:
        return sql.encode("utf-8")[start : start + length].decode("utf-8")
    except UnicodeDecodeError:
        return None


def value(connection: duckdb.DuckDBPyConnection, sql: str, expression: dict[str, Any]) -> Any:
    """The constant's Python value; None when it is NULL, not a constant, or fails."""
    text = constant_text(sql, expression)
    if text is None:
        return None
    literal = _literal(expression)
    if literal is not _UNKNOWN:
        return literal
    return _evaluate(connection, f"({text})")


def epoch_us(
    connection: duckdb.DuckDBPyConnection, sql: str, expression: dict[str, Any], with_zone: bool
) -> int | None:
    """The constant as a time (TIMESTAMPTZ if `with_zone`, else TIMESTAMP) in epoch
    microseconds; None when it is not a time constant."""
    text = constant_text(sql, expression)
    if text is None:
        return None
    literal = _literal_time(expression)
    if literal is not None:
        return literal
    cast = "TIMESTAMPTZ" if with_zone else "TIMESTAMP"
    result = _evaluate(connection, f"epoch_us(CAST(({text}) AS {cast}))")
    return result if isinstance(result, int) else None


def _evaluate(connection: duckdb.DuckDBPyConnection, expression: str) -> Any:
    try:
        return connection.execute(f"SELECT {expression}").fetchall()[0][0]
    except duckdb.Error:
        return None


def _literal(expression: dict[str, Any]) -> Any:
    """A plain literal's value as DuckDB reads it, or _UNKNOWN (left to DuckDB)."""
    if expression.get("type") != "VALUE_CONSTANT":
        return _UNKNOWN
    literal = expression.get("literal") or {}
    kind, text = literal.get("kind"), literal.get("text")
    if not isinstance(text, str):
        return _UNKNOWN
    if kind == "STRING":
        return text
    if kind == "BOOLEAN" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind == "INTEGER" and re.fullmatch(r"-?\d{1,18}", text, re.ASCII):
        return int(text)
    return _UNKNOWN


def _literal_time(expression: dict[str, Any]) -> int | None:
    """Epoch microseconds of `TIMESTAMP[TZ] '<ISO time>'` or a bare ISO time string, else None."""
    if expression.get("type") == "OPERATOR_CAST":
        if (
            expression.get("try_cast")
            or (expression.get("type_expr") or {}).get("type_name") not in _TIME_TYPES
        ):
            return None
        expression = expression.get("child") or {}
    text = _literal(expression)
    match = _ISO_TIME.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction = match.groups()
    try:
        moment = datetime.datetime(
            int(year),
            int(month),
            int(day),
            int(hour or 0),
            int(minute or 0),
            int(second or 0),
            int((fraction or "0").ljust(6, "0")),
        )
    except ValueError:
        return None  # not a valid date: DuckDB's cast says what it makes of it
    return (moment - _EPOCH) // _MICROSECOND
