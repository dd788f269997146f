"""Exact deduplication: one document per id, the first in input order; and the pieces the dedup
stages share (ids computed from text, the removed.parquet side table).

Ids are xxh3-128 of the text (documents.document_id), so equal ids mean equal texts. Input without
an `id` column gets one computed from `text`, and the output carries it.

    from keel.data.dedup import run_exact_dedup

    report = run_exact_dedup("raw_docs/", "unique_docs/")
    print(report.dropped)  # {"exact_duplicate": 1234}

Output directory: the kept documents (part-*.parquet, in id-hash order: keel/flow's deduplicate),
removed.parquet (id, duplicate_of, similarity, source: one row per removed document), stage.json,
committed together (documents.stage_output). Input without a `text` column is refused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keel.core import paths
from keel.core.errors import UsageError
from keel.data import documents
from keel.flow import Dataset, RunOptions, pooled, read_parquet
from keel.flow.ops import Row

STAGE = "exact_dedup"
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
    input: str,
    output: str,
    config: ExactDedupConfig = ExactDedupConfig(),
    options: RunOptions | None = None,
) -> documents.StageReport:
    """Keep the first document (input order: file, then row) of each id; write the kept documents,
    removed.parquet and stage.json to `output`, committed together."""
    docs = read_parquet(documents.parquet_glob(input))
    require_text(docs, input)
    has_ids = has_column(docs, documents.ID_COLUMN)
    num_shards = config.num_shards  # None: keel/flow's default, the input's shard count
    with documents.stage_output(output, input) as staging, pooled(options) as options:
        # pass 1, ids and sources only: the rows after the first of each id
        copies = read_parquet(
            documents.parquet_glob(input), columns=id_and_source_columns(docs, has_ids)
        )
        removed = table_or_empty(
            with_ids_if_missing(copies, has_ids)
            .select(*_present(copies, (documents.ID_COLUMN, documents.SOURCE_COLUMN)))
            .group_by(documents.ID_COLUMN, later_copies, num_shards=num_shards)
            .to_table(options=options),
            REMOVED_SCHEMA,
        )
        # pass 2, whole documents: the first row of each id
        result = (
            with_ids_if_missing(docs, has_ids)
            .deduplicate(documents.ID_COLUMN, num_shards=num_shards)
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


def later_copies(key: str, rows: list[Row]) -> list[Row]:
    """group_by reducer: removed.parquet rows for every row of an id but the first."""
    return [
        {"id": key, "duplicate_of": key, "similarity": 1.0, "source": row.get("source")}
        for row in rows[1:]
    ]


# -- shared by the dedup stages -------------------------------------------------------------------
def has_column(docs: Dataset, name: str) -> bool:
    """Whether the input's schema (that of its first Parquet file) has column `name`."""
    schema = getattr(docs.source, "schema", None)
    return schema is not None and name in schema.names


def require_text(docs: Dataset, input: object) -> None:
    """UsageError unless the input's documents have a text column (an empty input passes: it
    has no schema to check). Dedup compares texts, so a set without them is not a document set."""
    schema = getattr(docs.source, "schema", None)
    if schema is not None and documents.TEXT_COLUMN not in schema.names:
        raise UsageError(
            f"{input} has no {documents.TEXT_COLUMN!r} column (columns: "
            f"{', '.join(schema.names)}): dedup needs a document set"
        )


def id_and_source_columns(docs: Dataset, has_ids: bool) -> list[str]:
    """The columns to read to know each document's id and source (text when ids are missing)."""
    wanted = [documents.ID_COLUMN if has_ids else documents.TEXT_COLUMN, documents.SOURCE_COLUMN]
    return [name for name in wanted if has_column(docs, name)]


def with_ids_if_missing(docs: Dataset, has_ids: bool) -> Dataset:
    """`docs`, with an `id` column computed from `text` when the input has none."""
    return docs if has_ids else docs.map_batches(add_ids)


def add_ids(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch with an `id` column (documents.document_id of the text) as its first column."""
    if documents.TEXT_COLUMN not in batch.schema.names:
        raise UsageError(
            f"documents have neither an {documents.ID_COLUMN!r} nor a {documents.TEXT_COLUMN!r} "
            f"column (columns: {', '.join(batch.schema.names)}): pass a document set"
        )
    texts = batch.column(documents.TEXT_COLUMN).to_pylist()
    ids = pa.array([documents.document_id(text or "") for text in texts], pa.string())
    return pa.RecordBatch.from_arrays(
        [ids, *batch.columns], names=[documents.ID_COLUMN, *batch.schema.names]
    )


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


def _present(docs: Dataset, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if name == documents.ID_COLUMN or has_column(docs, name)]
