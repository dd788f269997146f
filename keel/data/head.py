"""`keel data head`: the first documents of a document set, optionally those matching a condition.

The condition is a DuckDB SQL boolean expression over the set's columns, e.g.
`language = 'en' AND quality_score < 0.2` or `length(text) > 10000`. Parts are read in order
through an Arrow dataset, so only as many row groups as the answer needs are read.
"""

from __future__ import annotations

from typing import Any

import pyarrow.dataset as ds

from keel.core import paths
from keel.core.errors import UsageError
from keel.data.token_cache import MANIFEST_FILE

MAX_ERROR_CHARS = 300


def head(path: str, n: int = 5, where: str | None = None) -> list[dict[str, Any]]:
    """The first `n` documents of the document set at `path` (those for which `where` holds),
    as dicts of column -> value, in the set's order. UsageError for a path that is not a document
    set and for a `where` DuckDB cannot evaluate (one line, DuckDB's reason)."""
    import duckdb  # only this command needs it

    if n < 1:
        raise UsageError(f"-n must be at least 1, got {n}")
    names = paths.list_dir(path)
    if not names:
        raise UsageError(f"{path}: no such directory, or it is empty")
    parts = sorted(name for name in names if name.startswith("part-") and name.endswith(".parquet"))
    if not parts:
        if MANIFEST_FILE in names:
            raise UsageError(f"{path} is a token cache: it holds token ids, not documents")
        raise UsageError(f"{path}: not a document set (no part-*.parquet files)")
    fs, _ = paths.filesystem(path)
    files = [paths.filesystem(paths.join(path, name))[1] for name in parts]
    dataset = ds.dataset(files, format="parquet", filesystem=fs)
    connection = duckdb.connect()
    try:
        relation = connection.from_arrow(dataset)
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
    return table.to_pylist()
