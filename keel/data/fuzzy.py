"""Fuzzy (near-duplicate) deduplication: MinHash + LSH candidates, verified, clustered, one kept.

    from keel.data.fuzzy import FuzzyDedupConfig, run_fuzzy_dedup

    report = run_fuzzy_dedup("unique_docs/", "fuzzy_docs/", FuzzyDedupConfig(threshold=0.8))

How (three passes over the input, each on keel/flow workers):
1. Signatures and buckets: workers compute each document's MinHash signature (minhash.py) and its
   band keys; a group_batches on the band key collects each bucket, and a second on the bucket's
   fingerprint keeps one copy of a bucket found in several bands; buckets of two or more
   documents come back to the coordinator, once each, as lists of their places in the input
   (uint64 positions), in input order. Only (band key, place) pairs are shuffled, 14 rows of 16
   bytes per document.
2. Verification (fuzzy_verify.py): the coordinator numbers the candidates (the documents found in
   some bucket) and finds the components of the buckets; workers read the documents again and
   compute the candidates' shingle sets (minhash.shingle_sets: the sorted distinct 32-bit hashes
   of their word n-grams); a group_batches on the component brings each component to one
   reducer, which verifies and clusters it (fuzzy_clusters.py) and sends back only the removals
   and their evidence.
3. The kept documents: the input without the removed places, written by keel/flow in input
   order; the same pass counts each source's documents (set aside by the write), and the source
   guard checks them before the output is committed.
Verification and clustering: each candidate is compared, on the true Jaccard of the shingle sets
(not the signature's estimate), with the representatives (kept documents) it shares a bucket
with; at `threshold` or above it is removed and linked to the most similar of them, else it
becomes a representative. Representatives are taken in input order, as exact dedup and
keel/flow's deduplicate keep the first, so running exact then fuzzy dedup keeps originals over
later copies. There are no transitive chains: with A ~ B ~ C but A !~ C, B is removed and A and
C are kept.

Output: the kept documents, removed.parquet (`duplicate_of` = the representative, `similarity` =
the true Jaccard), evidence.parquet (removed and kept id, Jaccard, shared shingles, each one's
shingle count: every removal can be recomputed), stage.json with `details.sources` (documents,
removed and the fraction lost, per source) and the pairs compared and rejected by verification.
The source guard: a run that would remove more than `max_source_drop` of the documents of any
source of at least `guard_min_documents` fails with one line and writes nothing (a whole source
reduced to a handful of documents is far more often a bug than a repetitive source; raise the
limit or pass --force when it is real).

Documents are told apart by their place in the input, not their ids: an id repeated in the input
(exact copies under one id: run exact dedup first) is two documents, and the later copy is
removed as a near-duplicate of the first (removed.parquet names it its own `duplicate_of`).
The input is a document set, Parquet, JSONL or text files (keel.data.inputs).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keel.core import paths
from keel.core.errors import UsageError
from keel.data import documents, inputs, minhash
from keel.data.dedup import (
    present,
    require_text,
    without_places,
    write_removed,
)
from keel.data.fuzzy_clusters import (
    EVIDENCE_FILE,
    EVIDENCE_SCHEMA,
    NO_SOURCE,
    check_source_losses,
    source_losses,
)
from keel.data.fuzzy_verify import (
    bucket_fingerprints,
    candidate_groups,
    first_copies,
    verify_candidates,
)
from keel.data.inputs import Input
from keel.data.places import PlaceTable
from keel.flow import RunOptions, pooled, run_lengths

STAGE = "fuzzy_dedup"
REASON = "near_duplicate"
_BAND = "band"
_FINGERPRINT = "fingerprint"
_COUNT_COLUMNS = ("__keel_counted_source", "__keel_source_count")
"""The side rows of the kept-documents write: a source and its documents in one batch."""


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
    """True Jaccard similarity of two documents' word n-gram sets at or above which the later is
    a near-duplicate of the earlier (LSH only proposes the pairs)."""
    seed: int = 1
    """Seed of the permutations and band keys: signatures compare only under the same seed."""
    num_shards: int | None = None
    """Shuffle partitions of the band keys (default: the number of input files)."""
    max_source_drop: float = 0.5
    """The largest fraction of any one source's documents the stage may remove; a run that would
    remove more fails and writes nothing (`--force` on the command line lifts the limit)."""
    guard_min_documents: int = 100
    """Sources with fewer documents are reported but not guarded (two of three copies is not a
    bug)."""

    def __post_init__(self) -> None:
        for name in ("num_perm", "bands", "rows", "ngram", "guard_min_documents"):
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
        if not 0.0 <= self.max_source_drop <= 1.0:
            raise UsageError(
                f"FuzzyDedupConfig.max_source_drop must be in [0, 1], got {self.max_source_drop}"
            )
        if self.num_shards is not None and self.num_shards < 1:
            raise UsageError(
                f"FuzzyDedupConfig.num_shards must be at least 1, got {self.num_shards}"
            )


def run_fuzzy_dedup(
    input: Input,
    output: str,
    config: FuzzyDedupConfig = FuzzyDedupConfig(),
    options: RunOptions | None = None,
) -> documents.StageReport:
    """Remove near-duplicates from the documents of `input`; write the kept documents,
    removed.parquet, evidence.parquet and stage.json to `output`, committed together.
    SourceGuardError (nothing written) when a source would lose more than
    `config.max_source_drop` of its documents."""
    names = inputs.column_names(input)
    require_text(names, input)
    with documents.stage_output(output, input) as staging, pooled(options) as options:
        groups = candidate_groups(find_buckets(input, names, config, options))
        found = verify_candidates(
            input,
            names,
            groups,
            config.ngram,
            config.threshold,
            config.num_shards,
            options,
            scratch=staging,
        )
        removed = found.removed
        # the kept documents: all but the removed places, in input order; the same pass counts
        # each source's documents, set aside, and the guard checks them before the commit
        with PlaceTable.of_places(staging, found.positions) as removed_places:
            result = (
                inputs.read_documents(input, positions=True)  # ids computed where none given
                .map_batches(functools.partial(kept_and_counted, removed=removed_places))
                .write_parquet(staging, options=options, commit=False, aside=_COUNT_COLUMNS)
            )
        losses = source_losses(_source_totals(result.aside), removed["source"].to_pylist())
        check_source_losses(losses, config.max_source_drop, config.guard_min_documents)
        write_removed(staging, removed)
        write_evidence(staging, found.evidence)
        report = documents.StageReport(
            STAGE,
            documents_in=result.stages[0].rows_in,
            documents_out=result.rows,
            details={
                "buckets": len(groups.bucket_starts) - 1,
                "candidates": len(groups.positions),
                "clusters": len(pc.unique(removed.column("duplicate_of"))),
                "pairs_compared": found.pairs_compared,
                "pairs_rejected": found.pairs_rejected,
                "sources": losses,
                "config": asdict(config),
            },
        )
        report.drop(REASON, removed.column("id").to_pylist())
        report.write(staging)
    return report


def kept_and_counted(batch: pa.RecordBatch, removed: PlaceTable) -> pa.Table:
    """map_batches of the kept-documents write: the documents whose place `removed` does not
    hold (without the place column), then a side row per source of the whole batch with its
    count (_COUNT_COLUMNS, set aside by the write: the per-source totals of the guard, counted
    in the pass that reads every document anyway)."""
    kept = pa.Table.from_batches([without_places(batch, removed)])
    if documents.SOURCE_COLUMN in batch.schema.names:
        sources = batch.column(documents.SOURCE_COLUMN).fill_null(NO_SOURCE)
    else:  # a set without sources: all its documents are NO_SOURCE
        sources = pa.array([NO_SOURCE] * batch.num_rows, pa.string())
    counts = pc.value_counts(sources)
    side = pa.table(
        {
            _COUNT_COLUMNS[0]: counts.field("values").cast(pa.string()),
            _COUNT_COLUMNS[1]: counts.field("counts"),
        }
    )
    return pa.concat_tables([kept, side], promote_options="default")


def _source_totals(aside: pa.Table | None) -> dict[str, int]:
    """Documents per source from the write's side rows."""
    totals: dict[str, int] = {}
    if aside is not None and aside.num_rows:
        sources, counts = (aside.column(name).to_pylist() for name in _COUNT_COLUMNS)
        for source, count in zip(sources, counts, strict=True):
            totals[source] = totals.get(source, 0) + count
    return totals


def write_evidence(output: str, evidence: pa.Table) -> None:
    """Write evidence.parquet (EVIDENCE_SCHEMA, zstd) into the output directory."""
    with paths.open_file(paths.join(output, EVIDENCE_FILE), "wb") as handle:
        pq.write_table(evidence.cast(EVIDENCE_SCHEMA), handle, compression="zstd")


# -- pass 1: band keys -> buckets ------------------------------------------------------------------
def find_buckets(
    input: Input, names: list[str] | None, config: FuzzyDedupConfig, options: RunOptions
) -> pa.ChunkedArray | pa.ListArray:
    """Every LSH bucket of two or more documents, once, as a list of their places in the input
    (keel.data.inputs' position column), in input order. A bucket found in several bands (a
    near-duplicate pair shares most: 590,000 buckets are 92,000 distinct ones at 300,000
    documents) is sent once to this process: a second shuffle, by the buckets' fingerprints,
    brings the copies of each to one worker, which keeps the first."""
    docs = inputs.read_documents(
        input, columns=present(names, [documents.TEXT_COLUMN]), positions=True
    )
    num_shards = config.num_shards or max(1, docs.source.num_shards)
    table = (
        docs.map_batches(functools.partial(band_rows, config=config))
        .group_batches(_BAND, bucket_members, num_shards=num_shards)
        .group_batches(_FINGERPRINT, distinct_buckets, num_shards=num_shards, sort_by_key=False)
        .to_table(options=options)
    )
    if not table.num_rows:
        return pa.array([], pa.list_(pa.uint64()))
    return table.column("members")


def band_rows(batch: pa.RecordBatch, config: FuzzyDedupConfig) -> pa.RecordBatch:
    """map_batches: documents with their places -> one (band key, place) row per band of each
    document with words."""
    signature = minhash.signatures(
        batch.column(documents.TEXT_COLUMN), config.num_perm, config.ngram, config.seed
    )
    with_words = np.flatnonzero(~(signature == minhash.EMPTY).all(axis=1))
    keys = minhash.band_keys(signature[with_words], config.bands, config.rows, config.seed)
    places = batch.column(inputs.POSITION_COLUMN).to_numpy()[np.repeat(with_words, config.bands)]
    return pa.RecordBatch.from_arrays(
        [pa.array(keys.reshape(-1)), pa.array(places)], names=[_BAND, inputs.POSITION_COLUMN]
    )


def bucket_members(rows: pa.Table, starts: np.ndarray) -> pa.Table:
    """group_batches reducer: the places of each bucket's documents (a run of one band key, two
    or more documents), in input order: a table of one `members` list per such bucket, with
    its fingerprint (fuzzy_verify.bucket_fingerprints)."""
    runs = run_lengths(starts, rows.num_rows)
    shared = runs >= 2
    places = rows.column(inputs.POSITION_COLUMN).to_numpy()
    members = places[np.flatnonzero(np.repeat(shared, runs))]
    sizes = runs[shared]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    return pa.table(
        {
            # int64: flow hashes int64 keys in numpy (uint64 above 2**63 one by one)
            _FINGERPRINT: pa.array(bucket_fingerprints(members, sizes).view(np.int64)),
            "members": pa.ListArray.from_arrays(pa.array(offsets), pa.array(members)),
        }
    )


def distinct_buckets(rows: pa.Table, starts: None) -> pa.Table:
    """group_batches reducer, unsorted: the first copy of each bucket among `rows` (all copies
    of a bucket come to the same reducer: they share a fingerprint)."""
    lists = rows.column("members").combine_chunks()
    members = lists.flatten().to_numpy()
    firsts = first_copies(members, np.diff(lists.offsets.to_numpy()))
    return pa.table({"members": lists.filter(pa.array(firsts))})
