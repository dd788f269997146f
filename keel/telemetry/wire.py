"""How rows travel as bytes: Arrow IPC streams, JSON and NDJSON (the WAL, the server, the client).

Arrow IPC is the bulk format (no per-value parsing on either side); JSON and NDJSON are for tools
and small writes. JSON output writes times as ISO-8601 text.
"""

from __future__ import annotations

import base64
import dataclasses
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any

import orjson
import pyarrow as pa

from keel.core.errors import one_line
from keel.core.http import ARROW_STREAM, JSON, NDJSON
from keel.telemetry.schema import TelemetryInputError

__all__ = [
    "ARROW_STREAM",
    "JSON",
    "NDJSON",
    "arrow_stream",
    "decode_rows",
    "json_default",
    "ndjson_rows",
    "read_stream",
]


def arrow_stream(table: pa.Table) -> bytes:
    """`table` as the bytes of an Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def read_stream(data: bytes | memoryview) -> pa.Table:
    """The table in the bytes of an Arrow IPC stream."""
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def json_default(value: Any) -> Any:
    """orjson's fallback: decimals as numbers, bytes as base64, durations as seconds, intervals as
    {months, days, nanoseconds}."""
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, tuple) and hasattr(value, "__match_args__"):  # an interval (MonthDayNano)
        return {name: getattr(value, name) for name in value.__match_args__}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"cannot send {type(value).__name__} as JSON")


def ndjson_rows(table: pa.Table) -> bytes:
    """One JSON object per row, one per line (timestamps as ISO-8601 strings)."""
    return b"".join(orjson.dumps(row, default=json_default) + b"\n" for row in table.to_pylist())


def decode_rows(kind: str, body: bytes) -> pa.Table | list[Any]:
    """A write's body as a table (Arrow IPC stream) or a list of rows (JSON, NDJSON); each JSON
    row must be an object with at least one column (a row of none would vanish unseen)."""
    if kind == ARROW_STREAM:
        try:
            return read_stream(body)
        except (pa.ArrowInvalid, OSError) as error:
            raise TelemetryInputError(
                f"body is not an Arrow IPC stream: {one_line(error)}"
            ) from None
    if kind == JSON:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as error:
            raise TelemetryInputError(f"body is not JSON: {error}") from None
        if isinstance(payload, dict) and isinstance(payload.get("rows"), list):
            return _objects(payload["rows"], "row")
        if isinstance(payload, list):
            return _objects(payload, "row")
        raise TelemetryInputError('send a JSON list of row objects or {"rows": [...]}')
    rows, lines = [], []
    for number, line in enumerate(body.splitlines(), 1):
        if line.strip():
            try:
                rows.append(orjson.loads(line))
            except orjson.JSONDecodeError as error:
                raise TelemetryInputError(f"NDJSON line {number} is not JSON: {error}") from None
            lines.append(number)
    return _objects(rows, "NDJSON line", lines)


def _objects(rows: list[Any], what: str, numbers: list[int] | None = None) -> list[Any]:
    """`rows` if each is a non-empty JSON object, else TelemetryInputError naming the first."""
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or not row:
            number = numbers[index] if numbers is not None else index
            shown = orjson.dumps(row).decode()[:40]
            raise TelemetryInputError(
                f"{what} {number} is {shown}: each row must be an object with at least one column"
            )
    return rows
