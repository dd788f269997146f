"""Times as the store keeps them: epoch integers in a timestamp column's own unit.

A time column holds int64 counts of its unit (s, ms, us or ns) since 1970. The store keeps only
times every reader can show, 0001-01-01 to 9999-12-31 (Python's datetime, which the CLI and the
server's JSON use); anything else is refused at write, one line naming the column and the value.
Epoch numbers (JSON numbers, Arrow integers) name no unit, so they are read only in the unit the
namespace declares (NamespaceOptions.time_unit); `time.time_ns()` read as microseconds lands in
year 58887, epoch seconds read as microseconds in 1970. Bounds and conversions here are exact
Python integers, so nothing overflows int64 (microseconds x 1000 does after 2262).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keel.telemetry.errors import TelemetryInputError

TIME_UNITS = ("s", "ms", "us", "ns")
PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
FIRST_SECOND = -62_135_596_800  # 0001-01-01T00:00:00Z, epoch seconds
END_SECOND = 253_402_300_800  # 10000-01-01T00:00:00Z, epoch seconds (exclusive)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_SECONDS_PER_YEAR = 31_556_952  # the Gregorian mean, for naming a rough year in messages


class TimeRangeError(TelemetryInputError):
    """A time no reader could show, or an epoch number the namespace cannot read."""


def check_time_unit(unit: str | None) -> str | None:
    if unit is not None and unit not in TIME_UNITS:
        raise TimeRangeError(f"time_unit {unit!r}: use one of s, ms, us, ns")
    return unit


def valid_range(unit: str) -> tuple[int, int]:
    """[lowest, highest] time storable in `unit` (epoch counts; within int64 for every unit)."""
    per = PER_SECOND[unit]
    return max(FIRST_SECOND * per, INT64_MIN + 1), min(END_SECOND * per - 1, INT64_MAX - 1)


def describe(value: int, unit: str) -> str:
    """`value` (epoch `unit`) for a message: the number, its unit and its rough year."""
    year = 1970 + math.floor(value / PER_SECOND[unit] / _SECONDS_PER_YEAR)
    return f"{value} {unit} since 1970 (year {year})"


def check_times(name: str, column: pa.Array | pa.ChunkedArray) -> None:
    """Refuse a timestamp column holding a time outside 0001-01-01 .. 9999-12-31."""
    unit = column.type.unit
    low, high = valid_range(unit)
    extremes = pc.min_max(column.cast(pa.int64()))
    smallest, largest = extremes["min"].as_py(), extremes["max"].as_py()
    for value in (smallest, largest):
        if value is not None and not low <= value <= high:
            raise TimeRangeError(
                f"column {name!r}: time {describe(value, unit)} is outside 0001-01-01 .. "
                "9999-12-31: send a real time (or null)"
            )


def epoch_to_target(name: str, value: Any, unit: str | None, target: pa.TimestampType) -> int:
    """An epoch number (int or float, in `unit`) as an integer in `target`'s unit, checked."""
    if unit is None:
        raise TimeRangeError(
            f"column {name!r}: {value!r} is an epoch number, whose unit the namespace does not "
            "declare: send ISO-8601 text, or create the namespace with time_unit s|ms|us|ns "
            "(keel logs write --time-unit)"
        )
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TimeRangeError(f"column {name!r}: {value!r} is not a time")
        converted = round(value * PER_SECOND[target.unit] / PER_SECOND[unit])
    else:
        converted = value * PER_SECOND[target.unit] // PER_SECOND[unit]
    low, high = valid_range(target.unit)
    if not low <= converted <= high:
        raise TimeRangeError(
            f"column {name!r}: {value!r} read as {unit} since 1970 is "
            f"{describe(converted, target.unit)}, outside 0001-01-01 .. 9999-12-31: "
            "is the namespace's time_unit right?"
        )
    return converted


def integers_to_times(
    name: str, column: pa.Array | pa.ChunkedArray, unit: str | None, target: pa.TimestampType
) -> pa.Array:
    """Arrow epoch integers in `unit` as `target` timestamps (refused without a unit)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    present = column.drop_null()
    if len(present) and unit is None:
        epoch_to_target(name, present[0].as_py(), None, target)
    if unit is None:
        return pa.nulls(len(column), target)
    values = column.cast(pa.int64()).to_numpy(zero_copy_only=False).astype(object)
    valid = np.asarray(column.is_valid())
    converted = [
        epoch_to_target(name, int(v), unit, target) if ok else None
        for v, ok in zip(values, valid, strict=True)
    ]
    return pa.array(converted, pa.int64()).cast(target)


def to_unit_bounds(low_us: int | None, high_us: int | None, unit: str) -> tuple[int, int]:
    """A query's [low, high] in microseconds as a conservative [low, high] in `unit`:
    rounded outwards and clamped to int64 (None: unbounded)."""
    per_us, per = PER_SECOND["us"], PER_SECOND[unit]
    low = INT64_MIN if low_us is None else (low_us * per) // per_us
    high = INT64_MAX if high_us is None else -((-high_us * per) // per_us)
    return max(INT64_MIN, min(low, INT64_MAX)), max(INT64_MIN, min(high, INT64_MAX))


def to_nanoseconds(value: int | None, unit: str) -> int | None:
    """Epoch `unit` as epoch nanoseconds, clamped to int64 (for manifests and retention)."""
    if value is None:
        return None
    return max(INT64_MIN, min(value * PER_SECOND["ns"] // PER_SECOND[unit], INT64_MAX))
