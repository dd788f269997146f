"""Fuzzy (near-duplicate) deduplication: MinHash + LSH candidates, verified, clustered, one kept.

    from keel.data.fuzzy import FuzzyDedupConfig, run_fuzzy_dedup

    report = run_fuzzy_dedup("unique_docs/", "fuzzy_docs/", FuzzyDedupConfig(threshold=0.8))

How (three passes over the input, each on keel/flow workers):
1. Signatures and buckets: workers compute each document's MinHash signature (minhash.py) and its
   band keys; a group_by on the band key collects each bucket; buckets of two or more documents
   come back to the coordinator as lists of ids in input order. Only (band key, id) pairs are
   shuffled, 14 small rows per document.
2. Candidates: the documents found in some bucket are read again and their signatures recomputed,
   which gives the coordinator their input order, sources and signatures (a few percent of a real
   corpus: near-duplicate candidates, not documents, are what the coordinator holds).
3. The kept documents: the input without the removed ids, written by keel/flow.
Between 2 and 3 the coordinator verifies candidates and clusters them: within a bucket, a document
is linked to an earlier one whose estimated Jaccard (the fraction of equal signature entries) is at
least `threshold`; the connected components of these links (union-find) are the clusters. Each
cluster keeps its first document in input order, as exact dedup and keel/flow's deduplicate do, so
running exact then fuzzy dedup keeps originals over later copies. The rest are removed, each with
`duplicate_of` = the kept document and `similarity` = its estimated Jaccard to that document.
Because clusters are connected components, a document linked to the kept one only through a chain
(A ~ B ~ C) is removed too, and its similarity to the kept one can be below the threshold.

Repeated ids (exact copies: run exact dedup first) are handled: all copies of a removed id are
removed; a kept id keeps its first copy, and the output is then in id-hash order (deduplicate).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keel.core.errors import UsageError
from keel.data import documents, minhash
from keel.data.dedup import (
    REMOVED_SCHEMA,
    add_ids,
    has_column,
    require_text,
    table_or_empty,
    with_ids_if_missing,
    write_removed,
)
from keel.flow import RunOptions, pooled, read_parquet
from keel.flow.ops import Row

STAGE = "fuzzy_dedup"
REASON = "near_duplicate"
_BAND = "band"


@dataclass(frozen=True)
class FuzzyDedupConfig:
    """MinHash LSH near-duplicate removal. Defaults are datatrove's (5-grams, 14 bands of 8)."""

    num_perm: int = 112
    """Permutations (signature entries) per document; must equal bands * rows."""
    bands: int = 14
    """LSH bands: more bands find more candidates at lower similarity (and cost more)."""
    rows: int = 8
    """Signature entries per band: more rows make a band match stricter."""
    ngram: int = 5
    """Words per shingle."""
    threshold: float = 0.8
    """Estimated Jaccard similarity (of word n-gram sets) at or above which two candidates are
    near-duplicates."""
    seed: int = 1
    """Seed of the permutations and band keys: signatures compare only under the same seed."""
    num_shards: int | None = None
    """Shuffle partitions of the band keys (default: the number of input files)."""

    def __post_init__(self) -> None:
        for name in ("num_perm", "bands", "rows", "ngram"):
            if getattr(self, name) < 1:
                raise UsageError(
                    f"FuzzyDedupConfig.{name} must be at least 1, got {getattr(self, name)}"
                )
        if self.bands * self.rows != self.num_perm:
            raise UsageError(
                f"FuzzyDedupConfig: bands * rows must equal num_perm, got {self.bands} * "
                f"{self.rows} != {self.num_perm}: change bands or rows, or set num_perm="
                f"{self.bands * self.rows}"
            )
        if not 0.0 < self.threshold <= 1.0:
            raise UsageError(f"FuzzyDedupConfig.threshold must be in (0, 1], got {self.threshold}")
        if self.num_shards is not None and self.num_shards < 1:
            raise UsageError(
                f"FuzzyDedupConfig.num_shards must be at least 1, got {self.num_shards}"
            )


def run_fuzzy_dedup(
    input: str,
    output: str,
    config: FuzzyDedupConfig = FuzzyDedupConfig(),
    options: RunOptions | None = None,
) -> documents.StageReport:
    """Remove near-duplicates from the document set `input`; write the kept documents,
    removed.parquet and stage.json to `output`, committed together."""
    glob = documents.parquet_glob(input)
    docs = read_parquet(glob)
    require_text(docs, input)
    has_ids = has_column(docs, documents.ID_COLUMN)
    with documents.stage_output(output, input) as staging, pooled(options) as options:
        buckets = find_buckets(glob, has_ids, config, docs.source.num_shards, options)
        candidates = list(dict.fromkeys(doc_id for bucket in buckets for doc_id in bucket))
        found = candidate_signatures(glob, has_ids, candidates, config, options)
        removed, copies_kept = cluster(buckets, found, config.threshold)
        # the kept documents: all but the removed ids (a kept id's copies share its id, so they
        # are left to deduplicate)
        kept = with_ids_if_missing(docs, has_ids)
        removed_ids = pc.unique(
            removed.filter(pc.not_equal(removed["id"], removed["duplicate_of"])).column("id")
        )
        if len(removed_ids):
            kept = kept.filter(~pc.field(documents.ID_COLUMN).isin(removed_ids))
        if copies_kept:
            kept = kept.deduplicate(documents.ID_COLUMN, num_shards=docs.source.num_shards)
        result = kept.write_parquet(staging, options=options, commit=False)
        write_removed(staging, removed)
        report = documents.StageReport(
            STAGE,
            documents_in=result.stages[0].rows_in,
            documents_out=result.rows,
            details={
                "buckets": len(buckets),
                "candidates": len(candidates),
                "clusters": len(pc.unique(removed.column("duplicate_of"))),
                "config": asdict(config),
            },
        )
        report.drop(REASON, removed.column("id").to_pylist())
        report.write(staging)
    return report


# -- pass 1: band keys -> buckets ------------------------------------------------------------------
def find_buckets(
    glob: str,
    has_ids: bool,
    config: FuzzyDedupConfig,
    input_shards: int,
    options: RunOptions,
) -> list[tuple[str, ...]]:
    """Every LSH bucket of two or more documents, as their ids in input order; a bucket found in
    several bands (a near-duplicate pair shares most) once."""
    columns = [documents.TEXT_COLUMN] + ([documents.ID_COLUMN] if has_ids else [])
    table = (
        read_parquet(glob, columns=columns)
        .map_batches(functools.partial(band_rows, config=config))
        .group_by(_BAND, bucket_members, num_shards=config.num_shards or max(1, input_shards))
        .to_table(options=options)
    )
    members = table.column("members").to_pylist() if table.num_rows else []
    return list(dict.fromkeys(tuple(bucket) for bucket in members))


def band_rows(batch: pa.RecordBatch, config: FuzzyDedupConfig) -> pa.RecordBatch:
    """map_batches: documents -> one (band key, id) row per band of each document with words."""
    if documents.ID_COLUMN not in batch.schema.names:
        batch = add_ids(batch)
    signature = minhash.signatures(
        batch.column(documents.TEXT_COLUMN), config.num_perm, config.ngram, config.seed
    )
    with_words = np.flatnonzero(~(signature == minhash.EMPTY).all(axis=1))
    keys = minhash.band_keys(signature[with_words], config.bands, config.rows, config.seed)
    ids = batch.column(documents.ID_COLUMN).take(pa.array(np.repeat(with_words, config.bands)))
    return pa.RecordBatch.from_arrays(
        [pa.array(keys.reshape(-1)), ids], names=[_BAND, documents.ID_COLUMN]
    )


def bucket_members(key: int, rows: list[Row]) -> Row | None:
    """group_by reducer: the ids of a bucket, in input order, when it holds two or more."""
    if len(rows) < 2:
        return None
    return {"members": [row[documents.ID_COLUMN] for row in rows]}


# -- pass 2 and clustering: candidates only -------------------------------------------------------
def candidate_signatures(
    glob: str,
    has_ids: bool,
    candidates: list[str],
    config: FuzzyDedupConfig,
    options: RunOptions | None,
) -> pa.Table:
    """Rows (id, source, signature) of every input document whose id is in `candidates`, in input
    order (repeated ids included)."""
    if not candidates:
        return pa.table({"id": pa.array([], pa.string()), "source": pa.array([], pa.string())})
    wanted = pc.field(documents.ID_COLUMN).isin(pa.array(candidates, pa.string()))
    names = read_parquet(glob).source.schema.names
    columns = [
        name
        for name in (documents.ID_COLUMN, documents.TEXT_COLUMN, documents.SOURCE_COLUMN)
        if name in names
    ]
    docs = read_parquet(glob, columns=columns, filter=wanted if has_ids else None)
    if not has_ids:
        docs = docs.map_batches(add_ids).filter(wanted)
    return docs.map_batches(functools.partial(signature_rows, config=config)).to_table(
        options=options
    )


def signature_rows(batch: pa.RecordBatch, config: FuzzyDedupConfig) -> pa.RecordBatch:
    """map_batches: documents -> (id, source, signature: fixed-size list of num_perm uint32)."""
    signature = minhash.signatures(
        batch.column(documents.TEXT_COLUMN), config.num_perm, config.ngram, config.seed
    )
    names = batch.schema.names
    source = (
        batch.column(documents.SOURCE_COLUMN)
        if documents.SOURCE_COLUMN in names
        else pa.nulls(batch.num_rows, pa.string())
    )
    flat = pa.array(signature.reshape(-1), pa.uint32())
    return pa.RecordBatch.from_arrays(
        [
            batch.column(documents.ID_COLUMN),
            source,
            pa.FixedSizeListArray.from_arrays(flat, config.num_perm),
        ],
        names=["id", "source", "signature"],
    )


def cluster(
    buckets: list[tuple[str, ...]], found: pa.Table, threshold: float
) -> tuple[pa.Table, bool]:
    """Verify the buckets' documents, cluster them, keep the first of each cluster.

    `found`: candidate_signatures' rows, in input order. Returns removed.parquet's rows (in input
    order) and whether some kept id has repeated copies in the input."""
    if found.num_rows == 0:
        return REMOVED_SCHEMA.empty_table(), False
    ids = found.column("id").to_pylist()
    first = {doc_id: row for row, doc_id in reversed(list(enumerate(ids)))}
    order = sorted(first.values())  # candidate index -> its first row; index order = input order
    index = {ids[row]: number for number, row in enumerate(order)}
    signature = (
        found.column("signature").combine_chunks().flatten().to_numpy().reshape(found.num_rows, -1)
    )[order]
    parent = np.arange(len(order))
    for bucket in buckets:
        members = sorted(dict.fromkeys(index[doc_id] for doc_id in bucket))
        link_bucket(members, signature, threshold, parent)
    root = np.array([_find(parent, node) for node in range(len(order))])
    similarity = minhash.estimated_jaccard(signature, signature[root])

    rows = np.array([index[doc_id] for doc_id in ids])
    is_copy = np.ones(len(ids), dtype=bool)
    is_copy[order] = False
    removed_rows = np.flatnonzero((root[rows] != rows) | is_copy)
    copies_kept = bool(np.any(is_copy & (root[rows] == rows)))
    candidate_ids = found.column("id").take(pa.array(order))
    removed = pa.table(
        {
            "id": found.column("id").take(pa.array(removed_rows)),
            "duplicate_of": candidate_ids.take(pa.array(root[rows[removed_rows]])),
            "similarity": similarity[rows[removed_rows]],
            "source": found.column("source").take(pa.array(removed_rows)),
        }
    )
    return table_or_empty(removed, REMOVED_SCHEMA), copies_kept


def link_bucket(
    members: list[int], signature: np.ndarray, threshold: float, parent: np.ndarray
) -> None:
    """Union each member (candidate indices, ascending = input order) with an earlier member of
    the bucket whose estimated Jaccard to it is >= threshold. Earlier members not linked to
    anything ("heads") are tried first, then the others: a bucket of n copies costs n
    comparisons, a bucket of unrelated documents (a band-key accident) n**2 / 2."""
    heads = [members[0]]
    for position in range(1, len(members)):
        member = members[position]
        match = _first_match(signature, member, heads, threshold)
        if match is None:
            head_set = set(heads)
            others = [earlier for earlier in members[:position] if earlier not in head_set]
            match = _first_match(signature, member, others, threshold)
        if match is None:
            heads.append(member)
        else:
            _union(parent, member, match)


def _first_match(
    signature: np.ndarray, member: int, earlier: list[int], threshold: float
) -> int | None:
    if not earlier:
        return None
    similar = minhash.estimated_jaccard(signature[earlier], signature[member]) >= threshold
    hit = np.flatnonzero(similar)
    return earlier[hit[0]] if len(hit) else None


def _find(parent: np.ndarray, node: int) -> int:
    root = node
    while parent[root] != root:
        root = parent[root]
    while parent[node] != root:  # path compression
        parent[node], node = root, parent[node]
    return int(root)


def _union(parent: np.ndarray, left: int, right: int) -> None:
    """Join two clusters; the root is the smaller index, i.e. the earlier document."""
    a, b = _find(parent, left), _find(parent, right)
    if a != b:
        parent[max(a, b)] = min(a, b)
