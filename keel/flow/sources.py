"""Where a pipeline's rows come from: files (one shard per file) or an in-memory list."""

from __future__ import annotations

import itertools
import posixpath
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from keel.core import paths
from keel.core.errors import UsageError
from keel.flow.keys import order_values
from keel.flow.ops import Row
from keel.flow.readers import MalformedInputError, SkipLog, parquet_schema, read_jsonl, read_parquet

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
SUCCESS_MARKER = "_SUCCESS"
"""Written last into a committed keel/flow output directory (see runner.execute)."""
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")


@dataclass(frozen=True)
class FileSource:
    """One shard per file, read in chunks by the reader for `format` ("jsonl" or "parquet");
    `columns` and `filter` apply to Parquet, where the reader pushes them down."""

    files: tuple[str, ...]
    format: str
    columns: tuple[str, ...] | None = None
    filter: pc.Expression | None = None
    lenient: bool = False
    schema: pa.Schema | None = None
    """Parquet: the schema every file must have (that of the first file unless given)."""
    file_column: str | None = None
    """When set, a string column of this name holds each row's file path."""
    position_column: str | None = None
    """When set, a uint64 column of this name holds each row's place in the input (see
    with_positions)."""

    @property
    def num_shards(self) -> int:
        return len(self.files)

    def describe(self, shard: int) -> str:
        return self.files[shard]

    def read(self, shard: int, chunk_rows: int, skipped: SkipLog) -> Iterator[pa.RecordBatch]:
        batches = self._read(self.files[shard], chunk_rows, skipped)
        if self.file_column is not None:
            batches = (
                batch.append_column(
                    self.file_column, pa.array([self.files[shard]] * batch.num_rows, pa.string())
                )
                for batch in batches
            )
        yield from with_positions(batches, shard, self.position_column)

    def _read(self, path: str, chunk_rows: int, skipped: SkipLog) -> Iterator[pa.RecordBatch]:
        if self.format == "jsonl":
            yield from read_jsonl(
                path, chunk_rows=chunk_rows, lenient=self.lenient, skipped=skipped
            )
            return
        yield from read_parquet(
            path,
            columns=self.columns,
            filter=self.filter,
            chunk_rows=chunk_rows,
            expected_schema=self.schema,
            lenient=self.lenient,
            skipped=skipped,
        )


@dataclass(frozen=True)
class ItemsSource:
    """An in-memory list of rows, cut into `num_shards` contiguous shards."""

    shards: tuple[tuple[Row, ...], ...]
    position_column: str | None = None
    """As FileSource.position_column."""

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def describe(self, shard: int) -> str:
        return f"items shard {shard} of {len(self.shards)}"

    def read(self, shard: int, chunk_rows: int, skipped: SkipLog) -> Iterator[pa.RecordBatch]:
        rows = iter(self.shards[shard])
        batches = (
            pa.RecordBatch.from_pylist(chunk)
            for chunk in iter(lambda: list(itertools.islice(rows, chunk_rows)), [])
        )
        yield from with_positions(batches, shard, self.position_column)


def with_positions(
    batches: Iterable[pa.RecordBatch], shard: int, column: str | None
) -> Iterator[pa.RecordBatch]:
    """The batches of source shard `shard`, with a uint64 `column` (when named) holding each
    row's place in the input: (shard << 40) | its row number within the shard (after a pushed
    down filter). Reading the same input again gives every row the same place, so a later pass
    can name rows an earlier pass chose."""
    if column is None:
        yield from batches
        return
    first = 0
    for batch in batches:
        places = order_values(shard, first, batch.num_rows)
        first += batch.num_rows
        yield batch.append_column(column, pa.array(places, pa.uint64()))


Source = FileSource | ItemsSource


def items_source(
    items: Sequence[Row], num_shards: int, position_column: str | None = None
) -> ItemsSource:
    if num_shards < 1:
        raise UsageError(f"from_items: num_shards must be at least 1, got {num_shards}")
    rows = list(items)
    bad = next((row for row in rows if not isinstance(row, dict)), None)
    if bad is not None:
        raise UsageError(f"from_items expects dicts (rows), got a {type(bad).__name__}")
    size = -(-len(rows) // num_shards) if rows else 0
    shards = tuple(tuple(rows[i * size : (i + 1) * size]) for i in range(num_shards))
    return ItemsSource(shards, position_column)


def file_source(
    pattern: str | Sequence[str],
    format: str | None = None,
    *,
    columns: Sequence[str] | None = None,
    filter: pc.Expression | None = None,
    lenient: bool = False,
    file_column: str | None = None,
    position_column: str | None = None,
) -> FileSource:
    """Expand a glob (or several) into a sorted file list and pick the reader by suffix."""
    files = expand(pattern)
    if not files and format is None:
        format = _format_of(pattern if isinstance(pattern, str) else pattern[0])
    chosen = format or _format_of(files[0])
    if chosen not in ("jsonl", "parquet"):
        raise UsageError(f"unknown format {chosen!r}: use 'jsonl' or 'parquet'")
    schema = None
    if chosen == "parquet":
        schema = _first_readable_schema(files, columns, lenient)
    projected = tuple(columns) if columns else None
    return FileSource(
        files, chosen, projected, filter, lenient, schema, file_column, position_column
    )


def expand(pattern: str | Sequence[str]) -> tuple[str, ...]:
    """Files matching a glob (any fsspec URL) or list of globs, sorted, each once.

    A glob that matches nothing is an error, except inside a committed keel/flow output (a
    directory with a _SUCCESS marker): a run that kept no rows writes no part files, and reading
    it back is an empty dataset, not a mistake."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    found: list[str] = []
    for item in patterns:
        matches = paths.glob_files(item)
        marker = paths.join(posixpath.dirname(item.rstrip("/")) or ".", SUCCESS_MARKER)
        if not matches and not paths.exists(marker):
            raise UsageError(f"no input files match {item}{_what_is_there(item)}")
        found.extend(matches)
    return tuple(dict.fromkeys(found))


def _what_is_there(pattern: str) -> str:
    """For a glob that matched nothing: what its directory holds instead (directory_hint)."""
    directory = posixpath.dirname(pattern.rstrip("/"))
    if not directory or paths.is_glob(directory):
        return ""
    return directory_hint(directory)


def directory_hint(directory: str) -> str:
    """` (DIR holds a.txt, b.txt: to read those files, pass a glob such as DIR/*.txt)`, or ""
    when the directory is missing or empty: the hint for a directory of raw files given where a
    set of part files (a document set, a flow output) was expected."""
    names = paths.list_dir(directory)
    if not names:
        return ""
    shown = ", ".join(names[:HINT_NAMES]) + (", ..." if len(names) > HINT_NAMES else "")
    example = posixpath.join(directory, "*" + posixpath.splitext(names[0])[1])
    return f" ({directory} holds {shown}: to read those files, pass a glob such as {example})"


HINT_NAMES = 3
"""Names of a directory's files shown when a glob in it matched nothing."""


def uncompressed_name(path: str) -> str:
    """`path` lowercased without its compression suffix (.gz, .zst, .zstd): its format's name."""
    name = path.lower()
    for suffix in COMPRESSED_SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def format_of_name(path: str) -> str | None:
    """ "parquet" or "jsonl" by the file name (compressed or not), None when it names neither."""
    name = uncompressed_name(path)
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


def _format_of(path: str) -> str:
    found = format_of_name(path)
    if found is None:
        raise UsageError(f"cannot tell the format of {path}: pass format='jsonl' or 'parquet'")
    return found


def _first_readable_schema(
    files: Sequence[str], columns: Sequence[str] | None, lenient: bool
) -> pa.Schema | None:
    for path in files:
        try:
            return parquet_schema(path, columns)
        except MalformedInputError:
            if not lenient:
                raise  # lenient: the task reading this file skips and counts it
    return None
