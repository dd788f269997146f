"""Fuzzy dedup's pass 2: the LSH candidates verified and clustered in the shuffle's reducers.

The coordinator turns pass 1's buckets (each once: the workers drop the copies of a bucket
found in several bands by its `bucket_fingerprints`) into candidate groups (`candidate_groups`):
the distinct candidates, named by their place in the input (the position column of
keel.data.inputs) and numbered in its order, each bucket as their numbers, and each candidate's
component, the connected set of candidates that share buckets (`components`, in numpy: scipy's
connected_components would cost a process 0.45 s of imports). Clustering a
component needs nothing outside it: a candidate is only compared with the representatives that
share a bucket with it (fuzzy_clusters). So workers read the documents again, keep the candidates
and compute their shingle sets (`verification_rows`, which finds each candidate's component and
buckets in a places.PlaceTable: one file per input shard, written once, so no task carries the
whole candidate set); a group_batches on the component brings each component's rows together,
in input order, in one reducer, which rebuilds its buckets from the rows, verifies and clusters
its components (`verify_partition`) and returns a row per removal with its evidence and one row
of counts; the coordinator only puts the removals in input order (`gather`).

Why places rather than ids: a place is 8 bytes, where an id is a string of tens: the band
shuffle, the reducers' sorts, the buckets the coordinator collects (hundreds of millions of
members at 1 TB) and the lookup of candidates in pass 2 all carry and compare integers. And a
place names one row: an id repeated in the input (exact copies under one id) is two candidates,
and the later copy is removed like any near-duplicate.

Why in the reducers: on the coordinator the verification ran on one core after every candidate's
shingles were shipped to it (300,000 documents: 2.1 s of a 16 s run, ~150 MB of shingles); here
it runs on the workers side by side, and the coordinator holds places and counts. It is what a
cluster-scale run needs (docs/benchmarks.md, the 1 TB plan).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keel.data import documents, inputs, minhash
from keel.data.dedup import REMOVED_SCHEMA, present, table_or_empty
from keel.data.fuzzy_clusters import EVIDENCE_SCHEMA, link_to_representatives
from keel.data.inputs import Input
from keel.data.places import PlaceTable
from keel.data.words import fmix64
from keel.flow import RunOptions

COMPONENT = "component"
BUCKETS = "buckets"
POSITION = inputs.POSITION_COLUMN
VERIFIED_SCHEMA = pa.schema(
    [
        (POSITION, pa.uint64()),
        ("id", pa.string()),
        ("duplicate_of", pa.string()),
        ("similarity", pa.float64()),
        ("source", pa.string()),
        ("shared_shingles", pa.int64()),
        ("removed_shingles", pa.int64()),
        ("kept_shingles", pa.int64()),
        ("pairs_compared", pa.int64()),
        ("pairs_rejected", pa.int64()),
    ]
)
"""A reducer's rows: one per removal (the counts null), then one of counts (pairs_compared,
pairs_rejected; the rest null)."""
_NUMBER_MIX = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class CandidateGroups:
    """The candidates of pass 1's buckets: their places in the input, `positions` uint64 [n]
    (sorted: candidate i is positions[i]), `components` int64 [n], and the distinct buckets as
    candidate numbers: bucket b is `members[bucket_starts[b]:bucket_starts[b + 1]]` (in input
    order)."""

    positions: np.ndarray
    components: np.ndarray
    bucket_starts: np.ndarray
    members: np.ndarray


@dataclass(frozen=True)
class Verification:
    """What pass 2 found: removed.parquet's and evidence.parquet's rows and the removed
    documents' places, uint64 [removed] (all three in input order), and the candidate pairs
    verified and rejected."""

    removed: pa.Table
    evidence: pa.Table
    positions: np.ndarray
    pairs_compared: int
    pairs_rejected: int


def candidate_groups(buckets: pa.ListArray | pa.ChunkedArray) -> CandidateGroups:
    """The candidates of pass 1's `buckets` (lists of places, each in input order; a bucket
    found in several bands may come several times), numbered in input order, and the distinct
    buckets, in order of first appearance, as those numbers. In numpy, not Python objects: a
    1 TB run's coordinator collects billions of members (docs/benchmarks.md, the 1 TB plan)."""
    if isinstance(buckets, pa.ChunkedArray):
        buckets = buckets.combine_chunks() if buckets.num_chunks else pa.array([], buckets.type)
    flat = buckets.flatten().to_numpy().astype(np.uint64)
    positions, numbers = np.unique(flat, return_inverse=True)
    sizes = np.diff(buckets.offsets.to_numpy()).astype(np.int64)
    firsts = first_copies(numbers, sizes)
    members = numbers[np.repeat(firsts, sizes)]
    sizes = sizes[firsts]
    bucket_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    leaders = np.repeat(members[bucket_starts[:-1]], sizes)  # joins each member to its first
    return CandidateGroups(
        positions, components(len(positions), leaders, members), bucket_starts, members
    )


def bucket_fingerprints(members: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each bucket's members in order (`members`, the buckets' members one
    after another, any integers; `sizes` [buckets]): uint64 [buckets]. Equal buckets have equal
    fingerprints; different ones share one with odds ~2**-64 a pair."""
    if not len(sizes):
        return np.zeros(0, dtype=np.uint64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ranks = np.arange(len(members)) - np.repeat(starts, sizes)  # each member's index in its bucket
    mixed = fmix64(members.astype(np.uint64) * _NUMBER_MIX ^ ranks.astype(np.uint64))
    return fmix64(np.add.reduceat(mixed, starts) ^ sizes.astype(np.uint64))


def first_copies(members: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Which buckets are the first of their members (`members`, the buckets' members one after
    another; `sizes` [buckets]): bool [buckets]. Buckets are matched by their fingerprints, then
    checked member by member; where two different buckets share a fingerprint (odds ~2**-64 per
    pair), they are told apart by their members as tuples."""
    if not len(sizes):
        return np.zeros(0, dtype=bool)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    _, first, inverse = np.unique(
        bucket_fingerprints(members, sizes), return_index=True, return_inverse=True
    )
    same = first[inverse]  # each bucket's first bucket of equal fingerprint
    apart = sizes != sizes[same]
    compared = ~apart
    shift = np.repeat(np.where(compared, starts[same] - starts, 0), sizes)
    unequal = members[np.arange(len(members)) + shift] != members
    apart |= np.logical_or.reduceat(unequal, starts) & compared
    if apart.any():  # a collision: the exact way
        seen: set[tuple[int, ...]] = set()
        firsts = np.zeros(len(sizes), dtype=bool)
        for index, bucket in enumerate(np.split(members, np.cumsum(sizes)[:-1])):
            key = tuple(bucket.tolist())
            firsts[index] = key not in seen
            seen.add(key)
        return firsts
    firsts = np.zeros(len(sizes), dtype=bool)
    firsts[first] = True
    return firsts


def components(count: int, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """The connected components of `count` nodes joined by the edges (left[i], right[i]): each
    node's label, the smallest node of its component, int64 [count]. Each round hooks the root
    on the larger side of every edge that still joins two roots under the smaller, then points
    every node at its root, until no edge joins two roots."""
    label = np.arange(count, dtype=np.int64)
    while True:
        low, high = label[left], label[right]
        apart = low != high
        if not apart.any():
            return label
        low, high = np.minimum(low[apart], high[apart]), np.maximum(low[apart], high[apart])
        np.minimum.at(label, high, low)  # each such high is a root: it now points lower
        while not np.array_equal(roots := label[label], label):
            label = roots


def verify_candidates(
    input: Input,
    names: list[str] | None,
    groups: CandidateGroups,
    ngram: int,
    threshold: float,
    num_shards: int | None,
    options: RunOptions | None,
    scratch: str,
) -> Verification:
    """Pass 2 (module doc): the candidates reread, shingled, shuffled by component and verified
    and clustered in the reducers. What the workers need of the groups is written once, by
    input shard, under `scratch` (places.PlaceTable; removed before returning)."""
    if not len(groups.positions):
        return gather(VERIFIED_SCHEMA.empty_table())
    columns = present(names, [documents.ID_COLUMN, documents.TEXT_COLUMN, documents.SOURCE_COLUMN])
    docs = inputs.read_documents(input, columns=columns, positions=True)  # ids added if missing
    verify = functools.partial(verify_partition, threshold=threshold)
    shards = num_shards or max(1, docs.source.num_shards)
    with PlaceTable.write(scratch, candidate_table(groups)) as candidates:
        rows = functools.partial(verification_rows, candidates=candidates, ngram=ngram)
        table = (
            docs.map_batches(rows)
            .group_batches(COMPONENT, verify, shards, sort_by_key=False)
            .to_table(options=options)
        )
    return gather(table)


def candidate_table(groups: CandidateGroups) -> pa.Table:
    """A row per candidate, in input order: its place, its component and the numbers of its
    buckets (ascending), which is all a worker needs of the groups: the members of a bucket are
    the candidates that name it, all of them in one component."""
    count = len(groups.positions)
    sizes = np.diff(groups.bucket_starts)
    bucket_of = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)  # [members]
    by_candidate = np.argsort(groups.members, kind="stable")  # buckets ascending within each
    offsets = np.concatenate([[0], np.cumsum(np.bincount(groups.members, minlength=count))])
    buckets = pa.LargeListArray.from_arrays(
        pa.array(offsets.astype(np.int64)), pa.array(bucket_of[by_candidate])
    )
    return pa.table(
        {
            POSITION: pa.array(groups.positions, pa.uint64()),
            COMPONENT: pa.array(groups.components, pa.int64()),
            BUCKETS: buckets,
        }
    )


def verification_rows(batch: pa.RecordBatch, candidates: PlaceTable, ngram: int) -> pa.RecordBatch:
    """map_batches: the candidates among a batch of documents with their places -> (id, source,
    shingles: sorted distinct uint32, position, buckets, component)."""
    found, keep = candidates.rows_at(batch.column(POSITION).to_numpy())
    batch = batch.filter(pa.array(keep))
    flat, offsets = minhash.shingle_sets(batch.column(documents.TEXT_COLUMN), ngram)
    shingles = pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(flat, pa.uint32())
    )
    names = batch.schema.names
    source = (
        batch.column(documents.SOURCE_COLUMN)
        if documents.SOURCE_COLUMN in names
        else pa.nulls(batch.num_rows, pa.string())
    )
    return pa.RecordBatch.from_arrays(
        [
            batch.column(documents.ID_COLUMN),
            source,
            shingles,
            batch.column(POSITION),
            found.column(BUCKETS).combine_chunks(),
            found.column(COMPONENT).combine_chunks(),
        ],
        names=["id", "source", "shingles", POSITION, BUCKETS, COMPONENT],
    )


def verify_partition(rows: pa.Table, starts: None, threshold: float) -> pa.Table:
    """group_batches reducer, unsorted: verify and cluster the components of `rows` (whole
    components, the rows in input order; a candidate is only compared with others of its
    buckets, which are all here). VERIFIED_SCHEMA rows: one per removed row, then one of
    counts.

    A candidate is named here by its row's index in `rows`: within a component, input order,
    which is all link_to_representatives needs (it compares only within buckets). A bucket is
    the rows that name it, in row order; the buckets go in the order of their numbers."""
    lists = rows.column(BUCKETS).combine_chunks()
    numbers = lists.flatten().to_numpy()  # bucket numbers, each row's in turn
    owners = np.repeat(np.arange(rows.num_rows), np.diff(lists.offsets.to_numpy()))
    order = np.lexsort((owners, numbers))
    numbers, owners = numbers[order], owners[order]
    cuts = np.flatnonzero(numbers[1:] != numbers[:-1]) + 1
    buckets = [bucket.tolist() for bucket in np.split(owners, cuts)] if len(owners) else []
    column = rows.column("shingles").combine_chunks()
    flat, offsets = column.values.to_numpy(), column.offsets.to_numpy()
    shingles = [flat[offsets[row] : offsets[row + 1]] for row in range(rows.num_rows)]
    sizes = np.diff(offsets).astype(np.int64)  # [rows]: shingle counts
    clustering = link_to_representatives(buckets, shingles, threshold)
    kept_of = np.arange(rows.num_rows)
    similarity = np.ones(rows.num_rows)
    shared = sizes.copy()  # a kept candidate shares all its shingles with itself
    for link in clustering.links:
        kept_of[link.removed] = link.kept
        similarity[link.removed] = link.jaccard
        shared[link.removed] = link.shared
    removed = np.flatnonzero(kept_of != np.arange(rows.num_rows))
    kept = kept_of[removed]
    ids = rows.column("id")
    removals = pa.table(
        {
            POSITION: rows.column(POSITION).take(removed),
            "id": ids.take(removed),
            "duplicate_of": ids.take(kept),
            "similarity": similarity[removed],
            "source": rows.column("source").take(removed),
            "shared_shingles": shared[removed],
            "removed_shingles": sizes[removed],
            "kept_shingles": sizes[kept],
        }
    )
    counts = pa.table(
        {
            "pairs_compared": [clustering.pairs_compared],
            "pairs_rejected": [clustering.pairs_rejected],
        }
    )
    return pa.concat_tables(
        [table_or_empty(removals, VERIFIED_SCHEMA), table_or_empty(counts, VERIFIED_SCHEMA)]
    )


def gather(table: pa.Table) -> Verification:
    """The reducers' rows: the removals put in input order, the counts added up."""
    table = table_or_empty(table, VERIFIED_SCHEMA)  # no rows at all when no reducer ran
    counted = pc.is_valid(table.column("pairs_compared"))
    counts, removals = table.filter(counted), table.filter(pc.invert(counted))
    removals = removals.take(np.argsort(removals.column(POSITION).to_numpy(), kind="stable"))
    removed = pa.table({name: removals.column(name) for name in REMOVED_SCHEMA.names})
    evidence = pa.table(
        {
            "removed_id": removals.column("id"),
            "kept_id": removals.column("duplicate_of"),
            "jaccard": removals.column("similarity"),
            "shared_shingles": removals.column("shared_shingles"),
            "removed_shingles": removals.column("removed_shingles"),
            "kept_shingles": removals.column("kept_shingles"),
        }
    )
    return Verification(
        table_or_empty(removed, REMOVED_SCHEMA),
        table_or_empty(evidence, EVIDENCE_SCHEMA),
        removals.column(POSITION).to_numpy().astype(np.uint64),
        int(pc.sum(counts.column("pairs_compared")).as_py() or 0),
        int(pc.sum(counts.column("pairs_rejected")).as_py() or 0),
    )
