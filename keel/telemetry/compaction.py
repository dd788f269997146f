"""Which segments compaction merges and which retention drops (pure functions over the manifest).

Merging many small segments (one per flush) into few large ones keeps the number of files and
footers a query opens low and makes each key's rows contiguous over a longer span. Segments are
merged in manifest (arrival) order, so a merged segment still covers one stretch of time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from keel.telemetry.manifest import SegmentEntry

NS_PER_DAY = 86_400 * 1_000_000_000


@dataclass
class CompactionReport:
    """What one compaction did, per namespace: segment names merged and written, and dropped."""

    merged: dict[str, list[str]] = field(default_factory=dict)
    written: dict[str, list[str]] = field(default_factory=dict)
    dropped: dict[str, list[str]] = field(default_factory=dict)
    rows_dropped: int = 0

    def to_dict(self) -> dict[str, object]:
        return {
            "merged": self.merged,
            "written": self.written,
            "dropped": self.dropped,
            "rows_dropped": self.rows_dropped,
        }


def merge_groups(segments: tuple[SegmentEntry, ...], target_rows: int) -> list[list[SegmentEntry]]:
    """Runs of consecutive small segments (each under half the target) whose rows sum to at most
    `target_rows`; only runs of two or more are worth rewriting."""
    groups: list[list[SegmentEntry]] = []
    run: list[SegmentEntry] = []
    for segment in segments:
        small = segment.rows < target_rows // 2
        if small and sum(s.rows for s in run) + segment.rows <= target_rows:
            run.append(segment)
            continue
        if len(run) > 1:
            groups.append(run)
        run = [segment] if small else []
    if len(run) > 1:
        groups.append(run)
    return groups


def expired(
    segments: tuple[SegmentEntry, ...], retention_days: float | None, now_ns: int
) -> list[SegmentEntry]:
    """Segments whose newest row is older than the retention period."""
    if retention_days is None:
        return []
    horizon = now_ns - int(retention_days * NS_PER_DAY)
    return [s for s in segments if s.max_time is not None and s.max_time < horizon]
