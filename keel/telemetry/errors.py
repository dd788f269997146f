"""The telemetry store's errors: each is a user mistake, shown as one line."""

from __future__ import annotations

from dataclasses import dataclass

from keel.core.errors import UsageError


class TelemetryInputError(UsageError):
    """Rows or a namespace that the store refuses; nothing of the request was stored."""


class TelemetryQueryError(UsageError):
    """A query that DuckDB cannot run (bad SQL, an unknown table or column)."""


class QueryLimitError(TelemetryQueryError):
    """A query that ran past one of its QueryLimits (rows, bytes or seconds); nothing returned."""


@dataclass(frozen=True)
class QueryLimits:
    """Caps on one query: rows and bytes (Arrow, uncompressed) of its result, and wall-clock
    seconds from planning to the last result batch. A query over a cap raises QueryLimitError."""

    max_rows: int = 1_000_000
    max_bytes: int = 256 << 20
    timeout_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.max_rows < 0 or self.max_bytes < 0 or not self.timeout_seconds > 0:
            raise TelemetryInputError(
                f"query limits must be positive: max_rows={self.max_rows}, "
                f"max_bytes={self.max_bytes}, timeout_seconds={self.timeout_seconds}"
            )


class StoreBusyError(UsageError):
    """Another live process holds the store's writer lock."""
