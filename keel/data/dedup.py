"""Exact deduplication: one document per text, the first in input order; and the pieces the
dedup stages share (ids computed from text, the removed.parquet side table).

Documents are grouped by the xxh3-128 of their text (documents.document_id), whatever ids the
input carries: a set whose records have their own ids (b1, b2, ...) loses its repeated texts too.
Input without an `id` column gets one computed from `text`, and the output carries it. The input
is a document set, Parquet, JSONL or text files (keel.data.inputs).

An input of a few files (ONE_READ_MAX_FILES, none over ONE_READ_MAX_FILE_BYTES) is read once:
each file, in input order, hashes its texts, tells the later files which it holds and sets
aside the documents an earlier one holds (keel/flow's mark_later_copies: no shuffle, one file
in memory per worker). On 2M documents in 8 files this takes 1.12x polars' time at 0.9x its
peak memory (docs/benchmarks.md), where the design below took 1.4x.

A larger input takes two passes, and no text in any shuffle: the first reads texts, ids and
sources, and shuffles only each document's text hash, id, source and place in the input
(inputs.POSITION_COLUMN) to find every copy after the first (the removed rows, with the id each
duplicates); the second reads whole documents again and writes those not removed, file by file.
Its work grows with the documents alone, where the one read's grows with files x documents
(each file looks its keys up in every earlier file's). Moving the texts through a shuffle
(keel/flow's deduplicate) cost more than reading them twice: on 2M documents the stage took
14.8 s that way against polars' 3.4 s.

    from keel.data.dedup import run_exact_dedup

    report = run_exact_dedup("raw_docs/", "unique_docs/")
    print(report.dropped)  # {"exact_duplicate": 1234}

Output directory: the kept documents (part-*.parquet, in input order), removed.parquet (id,
duplicate_of = the kept document's id, similarity, source: one row per removed document, in input
order), stage.json, committed together (documents.stage_output). Input without a `text` column
is refused. Both designs write the same tables.
"""

from __future__ import annotations

import functools
import itertools
from concurrent import futures
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from keel.core import paths
from keel.core.errors import UsageError
from keel.data import documents, inputs
from keel.data.inputs import Input
from keel.data.places import PlaceTable
from keel.flow import RunOptions, pooled, run_lengths
from keel.flow.sources import expand

STAGE = "exact_dedup"
TEXT_KEY = "__keel_text_key"
"""The hidden column exact dedup groups by: the hash of the text."""
REASON = "exact_duplicate"
ONE_READ_MAX_FILES = 64
ONE_READ_MAX_FILE_BYTES = 256 * 1024 * 1024
"""Inputs of at most this many files, none larger (bytes on disk), are deduplicated in one read
(module doc); larger ones by a shuffle of text hashes and a second read."""
Passes = tuple[int, int, int, list[str]]
"""What a design's passes did: documents in, documents out, documents removed, and the ids of
the first removed (documents.DROPPED_SAMPLE)."""
_DUPLICATE_OF = "__keel_duplicate_of"
_REMOVED_PREFIX = "__keel_removed_"
_REMOVED_ASIDE = (
    _DUPLICATE_OF,
    _REMOVED_PREFIX + documents.ID_COLUMN,
    _REMOVED_PREFIX + documents.SOURCE_COLUMN,
)
"""The columns the one-read write sets aside for each removed document (its duplicate_of is
not null): removed.parquet's, under names that keep the documents' own id and source."""
REMOVED_FILE = "removed.parquet"
REMOVED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("duplicate_of", pa.string()),
        ("similarity", pa.float64()),
        ("source", pa.string()),
    ]
)
"""removed.parquet: the removed document's id, the id of the kept document it duplicates, their
similarity (1.0 for exact duplicates), and the removed document's source."""


@dataclass(frozen=True)
class ExactDedupConfig:
    """Exact dedup settings."""

    num_shards: int | None = None
    """Partitions of the shuffle of text hashes (default: the number of input files); only an
    input too large for one read (module doc) is shuffled."""

    def __post_init__(self) -> None:
        if self.num_shards is not None and self.num_shards < 1:
            raise UsageError(
                f"ExactDedupConfig.num_shards must be at least 1, got {self.num_shards}"
            )


def run_exact_dedup(
    input: Input,
    output: str,
    config: ExactDedupConfig = ExactDedupConfig(),
    options: RunOptions | None = None,
) -> documents.StageReport:
    """Keep the first document (input order: file, then row) of each text; write the kept
    documents, removed.parquet and stage.json to `output`, committed together. Documents are
    keyed by the hash of their text, whatever ids the input carries."""
    names = inputs.column_names(input)
    require_text(names, input)
    with documents.stage_output(output, input) as staging, pooled(options) as options:
        if _fits_one_read(input):
            documents_in, documents_out, removed, sample = _one_read(input, staging, options)
        else:
            documents_in, documents_out, removed, sample = _two_reads(
                input, names, staging, config, options
            )
        report = documents.StageReport(
            STAGE,
            documents_in=documents_in,
            documents_out=documents_out,
            details={"config": asdict(config)},
        )
        report.drop(REASON, sample, count=removed)
        report.write(staging)
    return report


def _fits_one_read(input: Input) -> bool:
    """Whether the input is few enough files, each small enough to hold, for one read."""
    files = expand(documents.parquet_glob(input))
    return len(files) <= ONE_READ_MAX_FILES and all(
        paths.file_size(path) <= ONE_READ_MAX_FILE_BYTES for path in files
    )


def _one_read(input: Input, staging: str, options: RunOptions) -> Passes:
    """Files in input order, each marking the texts an earlier document holds
    (Dataset.mark_later_copies) and setting those rows aside: removed.parquet's, written as each
    file's are handed over while the later files run."""
    with _RemovedWriter(staging) as removed:
        result = (
            inputs.read_documents(input)
            .map_batches(with_text_key)
            .mark_later_copies(TEXT_KEY, carry=documents.ID_COLUMN, into=_DUPLICATE_OF)
            .map_batches(_removed_columns)
            .write_parquet(
                staging,
                options=options,
                commit=False,
                aside=_REMOVED_ASIDE,
                on_aside=removed.append,
            )
        )
    return result.stages[0].rows_in, result.rows, removed.count, removed.sample


def _two_reads(
    input: Input,
    names: list[str] | None,
    staging: str,
    config: ExactDedupConfig,
    options: RunOptions,
) -> Passes:
    """The module doc's shuffle of text hashes, then a second read writing the documents not
    removed."""
    # pass 1, text hashes, ids, sources and places: every copy after the first of a text
    wanted = [documents.TEXT_COLUMN, documents.ID_COLUMN, documents.SOURCE_COLUMN]
    found = (
        inputs.read_documents(input, columns=present(names, wanted), positions=True)
        .map_batches(key_rows)
        .group_batches(TEXT_KEY, later_copies, num_shards=config.num_shards)
        .to_table(options=options)
    )
    removed = table_or_empty(found, REMOVED_SCHEMA)
    positions = _positions(found)
    order = np.argsort(positions, kind="stable")  # the removed rows in input order
    removed = removed.take(order)
    with (
        PlaceTable.of_places(staging, positions[order]) as removed_places,
        futures.ThreadPoolExecutor(1) as side,
    ):
        # removed.parquet is written while the workers run pass 2
        written = side.submit(write_removed, staging, removed)
        # pass 2, whole documents: all but those, in input order
        result = (
            inputs.read_documents(input, positions=True)
            .map_batches(functools.partial(without_places, removed=removed_places))
            .write_parquet(staging, options=options, commit=False)
        )
        written.result()
    sample = removed.column("id").slice(0, documents.DROPPED_SAMPLE).to_pylist()
    return result.stages[0].rows_in, result.rows, removed.num_rows, sample


def with_text_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    """map_batches: the documents and their text key, the 16-byte xxh3-128 of the text (the
    digest documents.document_id spells in hex), so equal keys mean equal texts even where the
    input's own ids differ."""
    keys = _text_digests(batch.column(documents.TEXT_COLUMN))
    return batch.append_column(TEXT_KEY, keys)


def key_rows(batch: pa.RecordBatch) -> pa.RecordBatch:
    """map_batches: documents -> (text key, id, source, place) rows, without the text."""
    keyed = with_text_key(batch)
    names = [TEXT_KEY, documents.ID_COLUMN, documents.SOURCE_COLUMN, inputs.POSITION_COLUMN]
    return keyed.select([name for name in names if name in keyed.schema.names])


def _removed_columns(batch: pa.RecordBatch) -> pa.RecordBatch:
    """map_batches after mark_later_copies: the documents without their text key, and beside
    them the columns the write sets aside for removed rows (_REMOVED_ASIDE: the same arrays
    under other names, not copies)."""
    batch = batch.drop_columns([TEXT_KEY])
    for name in (documents.ID_COLUMN, documents.SOURCE_COLUMN):
        column = (
            batch.column(name) if name in batch.schema.names else pa.nulls(len(batch), pa.string())
        )
        batch = batch.append_column(_REMOVED_PREFIX + name, column)
    return batch


class _RemovedWriter:
    """removed.parquet written a table at a time on a thread (the one read hands each file's
    removed rows over while the later files run); counts them and keeps the first ids as the
    report's sample."""

    def __init__(self, directory: str) -> None:
        self._handle = paths.open_file(paths.join(directory, REMOVED_FILE), "wb")
        self._writer = pq.ParquetWriter(self._handle, REMOVED_SCHEMA, compression="zstd")
        self._thread = futures.ThreadPoolExecutor(1)
        self._pending: list[futures.Future] = []
        self.count = 0
        self.sample: list[str] = []

    def append(self, aside: pa.Table) -> None:
        """Take the write's set-aside rows (_REMOVED_ASIDE) of one task."""
        removed = pa.table(
            {
                "id": aside.column(_REMOVED_PREFIX + documents.ID_COLUMN),
                "duplicate_of": aside.column(_DUPLICATE_OF),
                "similarity": pa.array(np.ones(aside.num_rows)),
                "source": aside.column(_REMOVED_PREFIX + documents.SOURCE_COLUMN),
            }
        ).cast(REMOVED_SCHEMA)
        self.count += removed.num_rows
        wanted = documents.DROPPED_SAMPLE - len(self.sample)
        self.sample += removed.column("id").slice(0, wanted).to_pylist()
        self._pending.append(self._thread.submit(self._writer.write_table, removed))

    def __enter__(self) -> _RemovedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for pending in self._pending:
                pending.result()
        finally:
            self._thread.shutdown()
            self._writer.close()
            self._handle.close()


def _text_digests(texts: pa.Array | pa.ChunkedArray) -> pa.Array:
    """xxh3-128 digests of UTF-8 texts straight from Arrow's buffers (a null text hashes as
    the empty one), pa.binary(16) [texts]: no Python string per row, and the digests joined
    into one buffer rather than converted one by one (~20% faster)."""
    digest = xxhash.xxh3_128_digest
    found: list[bytes] = []
    chunks = texts.chunks if isinstance(texts, pa.ChunkedArray) else [texts]
    for chunk in chunks:
        chunk = chunk.cast(pa.large_string()) if pa.types.is_string_view(chunk.type) else chunk
        wide = pa.types.is_large_string(chunk.type)
        offsets = np.frombuffer(
            chunk.buffers()[1],
            dtype=np.int64 if wide else np.int32,
            count=len(chunk) + 1,
            offset=chunk.offset * (8 if wide else 4),
        ).tolist()
        data = memoryview(chunk.buffers()[2] or b"")
        found.extend(digest(data[start:end]) for start, end in itertools.pairwise(offsets))
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(16), len(found), [None, pa.py_buffer(b"".join(found))]
    )


def later_copies(rows: pa.Table, starts: np.ndarray) -> pa.Table:
    """group_batches reducer: removed.parquet rows (and places) for every row of a text but the
    first, each naming the first's id."""
    runs = run_lengths(starts, rows.num_rows)
    first = np.repeat(starts, runs)  # [rows]: the row index of each row's first copy
    later = np.flatnonzero(first != np.arange(rows.num_rows))
    ids = rows.column(documents.ID_COLUMN)
    sources = (
        rows.column(documents.SOURCE_COLUMN).take(later)
        if documents.SOURCE_COLUMN in rows.column_names
        else pa.nulls(len(later), pa.string())
    )
    return pa.table(
        {
            "id": ids.take(later),
            "duplicate_of": ids.take(first[later]),
            "similarity": pa.array(np.ones(len(later))),
            "source": sources,
            inputs.POSITION_COLUMN: rows.column(inputs.POSITION_COLUMN).take(later),
        }
    )


def _positions(found: pa.Table) -> np.ndarray:
    """The places of the removed rows, uint64 [removed]."""
    if found.num_rows == 0:
        return np.zeros(0, dtype=np.uint64)
    return found.column(inputs.POSITION_COLUMN).to_numpy().astype(np.uint64)


def without_places(batch: pa.RecordBatch, removed: PlaceTable) -> pa.RecordBatch:
    """map_batches: the documents whose place `removed` does not hold, without the place
    column."""
    found = removed.has(batch.column(inputs.POSITION_COLUMN).to_numpy())
    kept = batch.filter(pa.array(~found)) if found.any() else batch
    return kept.drop_columns([inputs.POSITION_COLUMN])


# -- shared by the dedup stages -------------------------------------------------------------------
def require_text(names: list[str] | None, input: object) -> None:
    """UsageError unless the input's documents have a text column (an empty input passes: it
    has no schema to check). Dedup compares texts, so a set without them is not a document set."""
    if names is not None and documents.TEXT_COLUMN not in names:
        raise UsageError(
            f"{input} has no {documents.TEXT_COLUMN!r} column (columns: "
            f"{', '.join(names)}): dedup needs a document set"
        )


def present(names: list[str] | None, wanted: list[str]) -> list[str]:
    """The `wanted` columns the input has (all of them for an empty input)."""
    return [name for name in wanted if names is None or name in names]


def table_or_empty(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A collected table cast to `schema` (missing columns null); an empty one when no rows."""
    if table.num_rows == 0:
        return schema.empty_table()
    columns = [
        table.column(field.name).cast(field.type)
        if field.name in table.column_names
        else pa.nulls(table.num_rows, field.type)
        for field in schema
    ]
    return pa.table(columns, schema=schema)


def write_removed(output: str, removed: pa.Table) -> None:
    """Write removed.parquet (REMOVED_SCHEMA, zstd) into the output directory."""
    with paths.open_file(paths.join(output, REMOVED_FILE), "wb") as handle:
        pq.write_table(removed.cast(REMOVED_SCHEMA), handle, compression="zstd")
