"""`keel data head`: the first documents of a document set, optionally those matching a condition.

The condition is a DuckDB SQL boolean expression over the set's columns, e.g.
`language = 'en' AND quality_score < 0.2` or `length(text) > 10000`. Parts (and Parquet files)
are read in order through an Arrow dataset, so only as many row groups as the answer needs are
read. JSONL and text input is read by keel/flow workers, each keeping the first matches of its
batches.
"""

from __future__ import annotations

import functools
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from keel.core import paths
from keel.core.errors import UsageError
from keel.data import documents, inputs
from keel.data.token_cache import MANIFEST_FILE
from keel.flow import RunOptions
from keel.flow.sources import expand

MAX_ERROR_CHARS = 300


def head(
    path: str, n: int = 5, where: str | None = None, options: RunOptions | None = None
) -> list[dict[str, Any]]:
    """The first `n` documents of the document set at `path` (those for which `where` holds),
    as dicts of column -> value, in the set's order. `path` may also be raw input (Parquet, JSONL
    or text files, or a glob of them): Parquet is shown as stored, JSONL and text as the stages
    read them (keel.data.inputs: ids, sources; a JSONL record's other fields; a record without
    text shown with its text null), on keel/flow workers (`options`). UsageError for a path
    that is not a document set and for a `where` DuckDB cannot evaluate (one line, DuckDB's
    reason)."""
    if n < 1:
        raise UsageError(f"-n must be at least 1, got {n}")
    if documents.names_files(path):
        format = inputs.input_format(path)
        if format != "parquet":
            return _raw_head(path, format, n, where, options)
        return _parquet_head(list(expand(path)), n, where)
    names = paths.list_dir(path)
    if not names:
        raise UsageError(f"{path}: no such directory, or it is empty")
    parts = sorted(name for name in names if name.startswith("part-") and name.endswith(".parquet"))
    if not parts:
        if MANIFEST_FILE in names:
            raise UsageError(f"{path} is a token cache: it holds token ids, not documents")
        raise UsageError(f"{path}: not a document set (no part-*.parquet files)")
    return _parquet_head([paths.join(path, name) for name in parts], n, where)


def _parquet_head(files: list[str], n: int, where: str | None) -> list[dict[str, Any]]:
    """The first `n` rows of Parquet `files` (in order) for which `where` holds."""
    fs, _ = paths.filesystem(files[0])
    dataset = ds.dataset(
        [paths.filesystem(file)[1] for file in files], format="parquet", filesystem=fs
    )
    return _matching(dataset, where, n).to_pylist()


def _raw_head(
    path: str, format: str, n: int, where: str | None, options: RunOptions | None
) -> list[dict]:
    """The first `n` documents of JSONL or text input (`format`) for which `where` holds: each
    worker keeps the matching documents of its batches (at most `n` a batch), the first `n` are
    shown."""
    fields = inputs.record_fields(path, FIELD_RECORDS) if format == "jsonl" else {}
    docs = inputs.read_documents(path, fields=fields, require_text=False)  # html records too
    if where is not None:
        schema = pa.schema([*inputs.RAW_SCHEMA, *(pa.field(*item) for item in fields.items())])
        _matching(schema.empty_table(), where, n)  # a condition DuckDB cannot bind fails here
        docs = docs.map_batches(functools.partial(_matching_batch, where=where, n=n))
    return docs.take(n, options)


FIELD_RECORDS = 1000
"""JSONL records whose fields (and their types) head shows besides the documents' own columns."""


def _matching_batch(batch: pa.RecordBatch, where: str, n: int) -> pa.RecordBatch:
    """map_batches: the first `n` documents of the batch for which `where` holds."""
    found = _matching(batch, where, n)
    return found.combine_chunks().to_batches()[0] if found.num_rows else batch.slice(0, 0)


def _matching(data: Any, where: str | None, n: int) -> pa.Table:
    """The first `n` rows of Arrow `data` (a dataset, table or batch) for which the DuckDB
    condition `where` holds; UsageError (one line, DuckDB's reason) when DuckDB cannot evaluate
    it."""
    import duckdb  # only this command needs it

    connection = duckdb.connect()
    try:
        relation = connection.from_arrow(data)
        if where is not None:
            relation = relation.filter(where)
        table = relation.limit(n).arrow()
    except duckdb.Error as error:
        if where is None:
            raise
        reason = " ".join(str(error).split(" LINE ")[0].split())[:MAX_ERROR_CHARS]
        raise UsageError(f"--where {where!r}: {reason}") from None
    finally:
        connection.close()
    if hasattr(table, "read_all"):  # newer DuckDB answers a RecordBatchReader
        table = table.read_all()
    return table
