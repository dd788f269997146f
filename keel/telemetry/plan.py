"""What a query needs from the store: which namespaces, which columns, which predicates prune.

The SQL is parsed by DuckDB itself (`json_serialize_sql`), so the store reads the same syntax tree
the engine will run instead of guessing with regular expressions. Only one SELECT statement is
accepted. From a query over one namespace the planner takes the top-level WHERE's conjuncts that an
index can answer: equality and IN against constants, LIKE / contains / prefix with a constant
pattern, and comparisons or BETWEEN on the time column; anything else is left to DuckDB. Pruning
is conservative: it may keep row groups without matches, never drop one with a match, so a pruned
query returns exactly what a full scan returns. A query that is only `count(*)` grouped by (at most)
one column answers from value counts when every segment has them (`CountPlan`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import duckdb
import orjson
import pyarrow as pa

from keel.telemetry import sqltree, times
from keel.telemetry.schema import TelemetryQueryError
from keel.telemetry.sidecar import Equals, Like, Predicate, TimeRange
from keel.telemetry.sqltree import walk

_COMPARISONS = {
    "COMPARE_EQUAL": "=",
    "COMPARE_GREATERTHAN": ">",
    "COMPARE_GREATERTHANOREQUALTO": ">=",
    "COMPARE_LESSTHAN": "<",
    "COMPARE_LESSTHANOREQUALTO": "<=",
}
_FLIPPED = {"=": "=", ">": "<", ">=": "<=", "<": ">", "<=": ">="}
_SLACK_US = 1  # time bounds are widened by 1 us: a constant finer than that never drops a row
COUNT_COLUMN = "__keel_count"
COUNTS_TABLE = "__keel_counts"


@dataclass
class TableScan:
    """One namespace as the query uses it: columns read (None = all) and pruning predicates."""

    namespace: str
    columns: set[str] | None = None
    predicates: list[Predicate] = field(default_factory=list)


@dataclass(frozen=True)
class CountPlan:
    """`SELECT [c,] count(*) FROM ns [GROUP BY c]` rewritten over a table of counts."""

    namespace: str
    group_column: str | None
    sql: str  # the query over COUNTS_TABLE (columns: group_column?, __keel_count)


@dataclass
class QueryPlan:
    tables: dict[str, TableScan]
    count: CountPlan | None = None


def parse(connection: duckdb.DuckDBPyConnection, sql: str) -> dict[str, Any] | None:
    """DuckDB's syntax tree of one SELECT statement; TelemetryQueryError otherwise. None when
    the tree nests deeper than the JSON reader allows (orjson: 1,024 levels, e.g. a sum of ~500
    terms): the query is then checked with DuckDB's parser and run unplanned."""
    text = connection.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0][0]
    try:
        tree = orjson.loads(text)
    except orjson.JSONDecodeError:
        _check_one_select(connection, sql)
        return None
    if tree.get("error"):
        message = tree.get("error_message", "cannot parse the query")
        if "Only SELECT" in message:
            message = "only SELECT queries can be run against the telemetry store"
        raise TelemetryQueryError(f"bad query: {message.splitlines()[0]}")
    if len(tree["statements"]) != 1:
        raise TelemetryQueryError("send exactly one SELECT statement per query")
    return tree


def _check_one_select(connection: duckdb.DuckDBPyConnection, sql: str) -> None:
    try:
        statements = connection.extract_statements(sql)
    except duckdb.Error as error:
        raise TelemetryQueryError(f"bad query: {str(error).strip().splitlines()[0]}") from None
    if len(statements) != 1:
        raise TelemetryQueryError("send exactly one SELECT statement per query")
    if statements[0].type != duckdb.StatementType.SELECT:
        raise TelemetryQueryError("only SELECT queries can be run against the telemetry store")


def plan_query(
    connection: duckdb.DuckDBPyConnection,
    sql: str,
    schemas: dict[str, pa.Schema],
    time_columns: dict[str, str | None],
) -> QueryPlan:
    """The namespaces `sql` reads (those among `schemas`), their columns and predicates."""
    tree = parse(connection, sql)
    if tree is None:  # too deep to walk: every namespace it names is read whole, all columns
        names = connection.get_table_names(sql)
        return QueryPlan({name: TableScan(name) for name in sorted(names & set(schemas))})
    node = tree["statements"][0]["node"]
    names = {
        n["table_name"]
        for n in walk(node)
        if n.get("type") == "BASE_TABLE" and not n.get("schema_name")
    }
    tables = {name: TableScan(name) for name in sorted(names & set(schemas))}
    if not tables:
        return QueryPlan(tables)
    referenced: set[str] = set()
    star = False
    for item in walk(node):
        if item.get("class") == "COLUMN_REF":
            referenced.update(item["column_names"])
        elif item.get("class") == "STAR":
            star = True
    for scan in tables.values():
        schema = schemas[scan.namespace]
        scan.columns = None if star else {c for c in referenced if c in schema.names}
    single = _single_table(node)
    if (
        sum(
            1 for n in walk(node) if n.get("type") == "BASE_TABLE" and n.get("table_name") == single
        )
        > 1
    ):
        single = None  # a subquery or self-join reads the namespace too: its view must be whole
    if single in tables and node.get("where_clause") is not None:
        scan = tables[single]
        for conjunct in _conjuncts(node["where_clause"]):
            predicate = _predicate(
                connection, sql, conjunct, schemas[single], time_columns.get(single), node
            )
            if predicate is not None:
                scan.predicates.append(predicate)
    count = _count_plan(connection, tree, node, single, schemas) if single in tables else None
    return QueryPlan(tables, count)


def _single_table(node: dict[str, Any]) -> str | None:
    if node.get("type") != "SELECT_NODE":
        return None
    source = node.get("from_table") or {}
    if source.get("type") != "BASE_TABLE" or source.get("schema_name"):
        return None
    return source["table_name"]


def _conjuncts(expression: dict[str, Any]) -> list[dict[str, Any]]:
    """The terms of a top-level AND, in order (a stack, not recursion)."""
    parts, stack = [], [expression]
    while stack:
        item = stack.pop()
        if item.get("type") == "CONJUNCTION_AND":
            stack.extend(reversed(item["children"]))
        else:
            parts.append(item)
    return parts


def _column(expression: dict[str, Any], schema: pa.Schema, node: dict[str, Any]) -> str | None:
    if expression.get("class") != "COLUMN_REF":
        return None
    parts = expression["column_names"]
    source = node["from_table"]
    if len(parts) == 2 and parts[0] not in (source.get("alias"), source["table_name"]):
        return None
    if len(parts) > 2 or parts[-1] not in schema.names:
        return None
    return parts[-1]


def _typed(value: Any, kind: pa.DataType) -> Any:
    """`value` if an index lookup of it in a column of `kind` means what DuckDB's `=` means."""
    if pa.types.is_string(kind) and isinstance(value, str):
        return value
    if pa.types.is_integer(kind) and isinstance(value, int) and not isinstance(value, bool):
        return value
    if pa.types.is_boolean(kind) and isinstance(value, bool):
        return value
    return None


def _predicate(
    connection: duckdb.DuckDBPyConnection,
    sql: str,
    expression: dict[str, Any],
    schema: pa.Schema,
    time_column: str | None,
    node: dict[str, Any],
) -> Predicate | None:
    kind = expression.get("type")
    if kind in _COMPARISONS:
        operator = _COMPARISONS[kind]
        column = _column(expression["left"], schema, node)
        other = expression["right"]
        if column is None:
            column, other = _column(expression["right"], schema, node), expression["left"]
            operator = _FLIPPED[operator]
        if column is None:
            return None
        if column == time_column:
            return _time_range(connection, sql, schema, column, operator, other)
        if operator != "=":
            return None
        value = _typed(sqltree.value(connection, sql, other), schema.field(column).type)
        return Equals(column, (value,)) if value is not None else None
    if kind == "COMPARE_IN":
        column = _column(expression["children"][0], schema, node)
        if column is None:
            return None
        values = []
        for child in expression["children"][1:]:
            value = _typed(sqltree.value(connection, sql, child), schema.field(column).type)
            if value is None:
                return None
            values.append(value)
        return Equals(column, tuple(values))
    if kind == "COMPARE_BETWEEN" and _column(expression["input"], schema, node) == time_column:
        if time_column is None:
            return None
        low = _time_range(connection, sql, schema, time_column, ">=", expression["lower"])
        high = _time_range(connection, sql, schema, time_column, "<=", expression["upper"])
        if low is None or high is None:
            return None
        return TimeRange(time_column, low.unit, low=low.low, high=high.high)
    if kind == "FUNCTION":
        return _pattern(expression, schema, node)
    return None


def _pattern(expression: dict[str, Any], schema: pa.Schema, node: dict[str, Any]) -> Like | None:
    arguments = [argument["expression"] for argument in expression.get("arguments", [])]
    if len(arguments) != 2 or arguments[1].get("type") != "VALUE_CONSTANT":
        return None
    column = _column(arguments[0], schema, node)
    literal = arguments[1]["literal"]
    if (
        column is None
        or literal.get("kind") != "STRING"
        or not pa.types.is_string(schema.field(column).type)
    ):
        return None
    text = literal["text"]
    name = expression["function_name"]
    if name in ("~~", "like"):
        return Like(column, text)
    if name in ("contains", "starts_with", "prefix", "suffix", "ends_with"):
        return Like(column, f"%{text}%")  # a literal; its % and _ only cut trigram runs shorter
    return None


def _time_range(
    connection: duckdb.DuckDBPyConnection,
    sql: str,
    schema: pa.Schema,
    column: str,
    operator: str,
    constant: dict[str, Any],
) -> TimeRange | None:
    """The comparison `column <operator> constant` as a TimeRange in the column's unit, widened
    outwards (never narrower than DuckDB's answer), or None if it is not a time constant."""
    kind = schema.field(column).type
    value = sqltree.epoch_us(connection, sql, constant, with_zone=kind.tz is not None)
    if value is None:
        return None
    low_us = value - _SLACK_US if operator in (">", ">=", "=") else None
    high_us = value + _SLACK_US if operator in ("<", "<=", "=") else None
    low, high = times.to_unit_bounds(low_us, high_us, kind.unit)
    return TimeRange(
        column,
        kind.unit,
        low=low if low_us is not None else None,
        high=high if high_us is not None else None,
    )


def _count_plan(
    connection: duckdb.DuckDBPyConnection,
    tree: dict[str, Any],
    node: dict[str, Any],
    namespace: str,
    schemas: dict[str, pa.Schema],
) -> CountPlan | None:
    """A rewrite of `SELECT [c,] count(*) ... GROUP BY c` over per-value counts, or None."""
    for key in ("where_clause", "having", "qualify", "sample"):
        if node.get(key):
            return None
    if node.get("cte_map", {}).get("map") or (node["from_table"].get("sample")):
        return None
    if any(m.get("type") == "DISTINCT_MODIFIER" for m in node.get("modifiers", [])):
        return None
    groups = node.get("group_expressions") or []
    if (
        len(node.get("group_sets") or []) > 1
        or node.get("aggregate_handling") != "STANDARD_HANDLING"
    ):
        return None
    if len(groups) > 1:
        return None
    group = _column(groups[0], schemas[namespace], node) if groups else None
    if groups and group is None:
        return None
    for item in node["select_list"]:
        if item.get("class") == "COLUMN_REF" and group is not None:
            if _column(item, schemas[namespace], node) != group:
                return None
        elif not _is_count_star(item):
            return None
    try:
        rewritten = copy.deepcopy(tree)
        top = rewritten["statements"][0]["node"]
        _replace_counts(top, _sum_counts_node(connection))
        top["from_table"]["table_name"] = COUNTS_TABLE
        top["from_table"]["qualified_name"] = {"path": [COUNTS_TABLE]}
        encoded = orjson.dumps(rewritten).decode()
    except (RecursionError, orjson.JSONEncodeError):
        return None  # too deep to copy or encode (orjson writes 255 levels): counted by a scan
    rewritten_sql = connection.execute(
        "SELECT json_deserialize_sql(?::JSON)", [encoded]
    ).fetchall()[0][0]
    return CountPlan(namespace, group, rewritten_sql)


def _is_count_star(item: dict[str, Any]) -> bool:
    return (
        item.get("class") == "FUNCTION"
        and item.get("function_name") in ("count_star", "count")
        and not item.get("arguments")
        and not item.get("distinct")
        and item.get("filter") is None
    )


def _sum_counts_node(connection: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    sql = f"SELECT CAST(sum({COUNT_COLUMN}) AS BIGINT) FROM {COUNTS_TABLE}"
    tree = orjson.loads(connection.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0][0])
    return tree["statements"][0]["node"]["select_list"][0]


def _replace_counts(node: Any, total: dict[str, Any]) -> None:
    """Replace every count(*) in the tree by sum(__keel_count), keeping its output name."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            slots = list(item.items())
        elif isinstance(item, list):
            slots = list(enumerate(item))
        else:
            continue
        for slot, value in slots:
            if isinstance(value, dict) and _is_count_star(value):
                replacement = copy.deepcopy(total)
                replacement["alias"] = value.get("alias") or "count_star()"
                item[slot] = replacement
            else:
                stack.append(value)
