"""Fuzzy dedup's audited clustering: LSH candidates verified on their true shingle Jaccard, each
removed document linked to the kept document (its cluster's representative) it is similar to,
the evidence of every removal, and what each source lost.

Representatives, in input order: a candidate is compared with the representatives that share an
LSH bucket with it (all earlier in input order); when the true Jaccard of their shingle sets
(minhash.shingle_sets: 32-bit hashes of the word n-grams whose Jaccard MinHash estimates) is at
least `threshold` with one of them, it is removed and linked to the most similar (the earliest on
a tie); otherwise it becomes a representative itself. So a document is removed only for its
similarity to the one kept: with A ~ B, B ~ C and A !~ C, B is removed as a copy of A and C is
kept, where connected components would have removed C through B. A bucket of n copies of one
text costs n comparisons.

The evidence table (evidence.parquet) holds one row per removal: the removed and the kept id,
the true Jaccard, the shingles they share and each one's shingle count, so a reader can recompute
the Jaccard and audit any removal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from keel.core.errors import KeelError

EVIDENCE_FILE = "evidence.parquet"
EVIDENCE_SCHEMA = pa.schema(
    [
        ("removed_id", pa.string()),
        ("kept_id", pa.string()),
        ("jaccard", pa.float64()),
        ("shared_shingles", pa.int64()),
        ("removed_shingles", pa.int64()),
        ("kept_shingles", pa.int64()),
    ]
)
"""evidence.parquet: per removal, the true Jaccard = shared / (removed + kept - shared)."""
NO_SOURCE = "(no source)"


@dataclass(frozen=True)
class Link:
    """A removed candidate (index into the candidates) and the representative it is a copy of."""

    removed: int
    kept: int
    jaccard: float
    shared: int


@dataclass(frozen=True)
class Clustering:
    """What clustering found: the removals, and how many candidate pairs were verified."""

    links: tuple[Link, ...]
    pairs_compared: int
    """Candidate-representative pairs whose true Jaccard was computed."""
    pairs_rejected: int
    """Of those, pairs below the threshold: LSH candidates the verification turned down."""


def shared_count(left: np.ndarray, right: np.ndarray) -> int:
    """Elements two sorted arrays of distinct integers share."""
    if len(left) > len(right):
        left, right = right, left
    if len(left) == 0:
        return 0
    # where each of left would go in right; past the end is clipped to right's last element,
    # which is then smaller than it: no match (the methods, not np.*'s wrappers: ~9,000 calls
    # a 30,000-document run, on the coordinator between two passes)
    positions = right.searchsorted(left)
    return int(np.count_nonzero(right.take(positions, mode="clip") == left))


def jaccard(shared: int, left: int, right: int) -> float:
    """|A & B| / |A | B| from the sizes; 0.0 for two empty sets."""
    union = left + right - shared
    return shared / union if union else 0.0


def link_to_representatives(
    buckets: Sequence[Sequence[int]], shingles: Sequence[np.ndarray], threshold: float
) -> Clustering:
    """Cluster the candidates (indices in input order; `shingles[i]` candidate i's sorted unique
    shingle hashes) around representatives (module doc). `buckets`: the candidates of each LSH
    bucket."""
    buckets_of: list[list[int]] = [[] for _ in shingles]
    for number, bucket in enumerate(buckets):
        for member in dict.fromkeys(bucket):
            buckets_of[member].append(number)
    representatives: list[list[int]] = [[] for _ in buckets]
    links: list[Link] = []
    compared = rejected = 0
    for candidate in range(len(shingles)):
        seen: set[int] = set()
        best: Link | None = None
        for bucket in buckets_of[candidate]:
            for kept in representatives[bucket]:
                if kept in seen:
                    continue
                seen.add(kept)
                shared = shared_count(shingles[candidate], shingles[kept])
                similarity = jaccard(shared, len(shingles[candidate]), len(shingles[kept]))
                compared += 1
                if similarity < threshold:
                    rejected += 1
                elif best is None or (similarity, -kept) > (best.jaccard, -best.kept):
                    best = Link(candidate, kept, similarity, shared)
        if best is None:
            for bucket in buckets_of[candidate]:
                representatives[bucket].append(candidate)
        else:
            links.append(best)
    return Clustering(tuple(links), compared, rejected)


def source_losses(totals: dict[str, int], removed_sources: Sequence[str | None]) -> dict[str, dict]:
    """Per source: {"documents", "removed", "fraction"} (removed / documents), sources sorted."""
    removed: dict[str, int] = {}
    for source in removed_sources:
        key = NO_SOURCE if source is None else source
        removed[key] = removed.get(key, 0) + 1
    return {
        source: {
            "documents": count,
            "removed": removed.get(source, 0),
            "fraction": removed.get(source, 0) / count if count else 0.0,
        }
        for source, count in sorted(totals.items())
    }


class SourceGuardError(KeelError):
    """Fuzzy dedup would drop more of a source than `max_source_drop` allows."""


def check_source_losses(
    losses: dict[str, dict], max_source_drop: float, min_documents: int
) -> None:
    """SourceGuardError naming the source (of at least `min_documents`) that loses the largest
    fraction, when it is above `max_source_drop` (a whole source reduced to a few documents is
    a bug far more often than a corpus that really is that repetitive)."""
    over = [
        (row["fraction"], source)
        for source, row in losses.items()
        if row["documents"] >= min_documents
    ]
    over = [item for item in over if item[0] > max_source_drop]
    if not over:
        return
    fraction, source = max(over)
    row = losses[source]
    raise SourceGuardError(
        f"fuzzy dedup would drop {fraction:.1%} of source {source!r} ({row['removed']:,} of "
        f"{row['documents']:,} documents), more than max_source_drop={max_source_drop}; nothing "
        "was written: check the near-duplicates, raise max_source_drop, or pass --force"
    )
