"""Exact deduplication: one document per text, the first in input order; and the pieces the
dedup stages share (ids computed from text, the removed.parquet side table).

Documents are grouped by the xxh3-128 of their text (documents.document_id), whatever ids the
input carries: a set whose records have their own ids (b1, b2, ...) loses its repeated texts too.
Input without an `id` column gets one computed from `text`, and the output carries it. The input
is a document set, Parquet, JSONL or text files (keel.data.inputs).

    from keel.data.dedup import run_exact_dedup

    report = run_exact_dedup("raw_docs/", "unique_docs/")
    print(report.dropped)  # {"exact_duplicate": 1234}

Output directory: the kept documents (part-*.parquet, in text-hash order: keel/flow's deduplicate),
removed.parquet (id, duplicate_of = the kept document's id, similarity, source: one row per
removed document), stage.json,
committed together (documents.stage_output). Input without a `text` column is refused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keel.core import paths
from keel.core.errors import UsageError
from keel.data import documents, inputs
from keel.data.inputs import Input
from keel.flow import RunOptions, pooled
from keel.flow.ops import Row

STAGE = "exact_dedup"
TEXT_KEY = "__keel_text_key"
"""The hidden column exact dedup groups by: the hash of the text."""
REASON = "exact_duplicate"
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
    """Shuffle partitions, and so output files (default: the number of input files)."""

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
    num_shards = config.num_shards  # None: keel/flow's default, the input's shard count
    with documents.stage_output(output, input) as staging, pooled(options) as options:
        # pass 1, keys, ids and sources only: the rows after the first of each text
        wanted = [documents.TEXT_COLUMN, documents.ID_COLUMN, documents.SOURCE_COLUMN]
        removed = table_or_empty(
            inputs.read_documents(input, columns=present(names, wanted))
            .map_batches(key_rows)
            .group_by(TEXT_KEY, later_copies, num_shards=num_shards)
            .to_table(options=options),
            REMOVED_SCHEMA,
        )
        # pass 2, whole documents: the first row of each text
        result = (
            inputs.read_documents(input)
            .map_batches(with_text_keys)
            .deduplicate(TEXT_KEY, num_shards=num_shards)
            .map_batches(without_text_keys)
            .write_parquet(staging, options=options, commit=False)
        )
        removed = removed.take(pc.sort_indices(removed, [("id", "ascending")]))  # a stable sort
        write_removed(staging, removed)
        report = documents.StageReport(
            STAGE,
            documents_in=result.stages[0].rows_in,
            documents_out=result.rows,
            details={"config": asdict(config)},
        )
        report.drop(REASON, removed.column("id").to_pylist())
        report.write(staging)
    return report


def key_rows(batch: pa.RecordBatch) -> pa.RecordBatch:
    """map_batches: documents -> (text key, id, source) rows, without the text."""
    keyed = with_text_keys(batch)
    names = [TEXT_KEY, documents.ID_COLUMN, documents.SOURCE_COLUMN]
    return keyed.select([name for name in names if name in keyed.schema.names])


def with_text_keys(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch with a TEXT_KEY column: documents.document_id of the text, so equal keys mean
    equal texts even where the input's own ids differ."""
    texts = batch.column(documents.TEXT_COLUMN).to_pylist()
    keys = pa.array([documents.document_id(text or "") for text in texts], pa.string())
    return batch.append_column(TEXT_KEY, keys)


def without_text_keys(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.drop_columns([TEXT_KEY])


def later_copies(key: str, rows: list[Row]) -> list[Row]:
    """group_by reducer: removed.parquet rows for every row of a text but the first, each naming
    the first's id."""
    kept = rows[0][documents.ID_COLUMN]
    return [
        {"id": row[documents.ID_COLUMN], "duplicate_of": kept, "similarity": 1.0,
         "source": row.get("source")}
        for row in rows[1:]
    ]  # fmt: skip


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
