"""Constants read from the syntax tree without DuckDB mean what DuckDB makes of them, and time
constants it cannot read fall back to DuckDB's own cast."""

from __future__ import annotations

import duckdb
import orjson
import pytest

from keel.telemetry import sqltree


@pytest.fixture(scope="module")
def connection():
    database = duckdb.connect()
    database.execute("SET TimeZone = 'UTC'")
    yield database
    database.close()


def right_side(connection, sql: str) -> dict:
    text = connection.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0][0]
    return orjson.loads(text)["statements"][0]["node"]["where_clause"]["right"]


@pytest.mark.parametrize(
    "constant",
    [
        "'ERROR'",
        "'it''s'",
        "''",
        "'job-000123'",
        "5",
        "-3",
        "123456789012345678",
        "9223372036854775807",
        "99999999999999999999",
        "true",
        "FALSE",
        "NULL",
        "1.5",
        "'a' || 'b'",
    ],
)
def test_a_value_read_from_the_tree_is_duckdbs(connection, constant):
    sql = f"SELECT * FROM t WHERE c = {constant}"
    expected = connection.execute(f"SELECT {constant}").fetchall()[0][0]
    got = sqltree.value(connection, sql, right_side(connection, sql))
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    "constant",
    [
        "TIMESTAMP '2024-05-01 00:22:30'",
        "TIMESTAMP '2024-05-01 00:22:30.5'",
        "TIMESTAMP '2024-05-01 00:22:30.123456'",
        "TIMESTAMP '2024-05-01T00:22:30'",
        "TIMESTAMP '2024-05-01'",
        "TIMESTAMP '0001-01-01'",
        "TIMESTAMP '9999-12-31 23:59:59.999999'",
        "TIMESTAMPTZ '2024-05-01 00:22:30'",
        "TIMESTAMPTZ '2024-05-01 00:22:30+02'",
        "'2024-05-01 00:22:30'",
        "CAST('2024-05-01' AS TIMESTAMP)",
        "'2024-05-01'::TIMESTAMPTZ",
        "TIMESTAMP_NS '2024-05-01 00:00:00.123456789'",
        "epoch_ms(1714522950000)",
    ],
)
@pytest.mark.parametrize("with_zone", [False, True])
def test_a_time_read_from_the_tree_is_duckdbs(connection, constant, with_zone):
    sql = f"SELECT * FROM t WHERE ts >= {constant}"
    cast = "TIMESTAMPTZ" if with_zone else "TIMESTAMP"
    expected = connection.execute(f"SELECT epoch_us(CAST(({constant}) AS {cast}))").fetchall()[0][0]
    assert sqltree.epoch_us(connection, sql, right_side(connection, sql), with_zone) == expected


@pytest.mark.parametrize("constant", ["'2024-02-30'", "'yesterday'", "'2024-05-01 25:00:00'", "7"])
def test_what_is_not_a_time_gives_none(connection, constant):
    sql = f"SELECT * FROM t WHERE ts >= {constant}"
    assert sqltree.epoch_us(connection, sql, right_side(connection, sql), False) is None


def test_a_column_is_not_a_constant(connection):
    sql = "SELECT * FROM t WHERE c = d"
    assert sqltree.value(connection, sql, right_side(connection, sql)) is None
