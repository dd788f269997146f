"""File readers: one input file (JSONL or Parquet; a local path or any fsspec URL) as a stream of
Arrow RecordBatches of at most `chunk_rows` rows, with exact, honest handling of malformed input.

Strict mode (the default) raises `MalformedInputError` ("FILE:LINE: reason") at the first problem.
Lenient mode skips what cannot be read and counts every skip in a `SkipLog`. A truncated compressed
file or a Parquet file that breaks mid-way may already have yielded its good leading batches.

JSONL is streamed (gzip, zstandard or plain, by suffix), split into lines in ~1 MiB blocks, parsed
per line with orjson and converted per chunk with `pa.array(rows)`: memory is about one chunk.
Measured on a 50 MB file (243k rows of ~200 bytes, one core): this path reads ~250k rows/s (orjson
alone ~900k; the conversion to Arrow is ~70% of the time). `pyarrow.json.read_json` per chunk with
per-line fallback reads ~640k rows/s but silently changes data, so it is not used: lists starting
with null come back wrong (`[null, 1]` -> `[1, 0]`, apache/arrow#51305), date-like strings become
timestamps, integers above int64 become doubles, invalid UTF-8 becomes U+FFFD. And
`pa.RecordBatch.from_pylist` takes its columns from the first row only, dropping later keys.

Types are inferred per chunk. When a chunk's records have no common Arrow type ("a": 1 in one,
"a": "x" in another), the chunk is split at the first conflicting record into batches with their
own schemas; nothing is lost. A record that converts to no Arrow type even on its own (an integer
above int64, a list mixing numbers and strings) is a "schema_mismatch" problem.
"""

from __future__ import annotations

import gzip
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import zstandard

from keel.core import paths
from keel.core.errors import KeelError

SAMPLE_LIMIT = 100
PARQUET_BATCH_BYTES = 16 << 20
"""Parquet is decoded about this many (uncompressed) bytes at a time, and at most a task's
chunk_rows rows. A worker reading one 50,000-document row group (78 MB of text) for fuzzy dedup
faulted in ~126,000 pages at a batch of 65,536 rows, ~92,000 at 16,384 (~16 MB), and took
1.7-2.1 s against 2.1-3.3 s: on a VM, fresh memory costs more to fault in than the decoding."""
CATEGORIES = (
    "invalid_json",
    "invalid_utf8",
    "not_an_object",
    "truncated",
    "empty_file",
    "schema_mismatch",
    "unreadable",
)
_BLOCK_BYTES = 1 << 20  # decompressed bytes read at a time
_COMPRESSED_READ_BYTES = 1 << 16  # zstd input read at a time
_BOM = b"\xef\xbb\xbf"
_EMPTY = "empty file (no records)"
_TRUNCATED = "compressed stream ends early (truncated file?)"
_CONVERSION_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)
_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
# Pyarrow reports corrupt Parquet data as ArrowInvalid or plain OSError; these OSErrors are about
# access, not content, and must not make a file count as unreadable.
_ACCESS_ERRORS = (FileNotFoundError, PermissionError, ConnectionError, TimeoutError)


class MalformedInputError(KeelError):
    """An input file cannot be read as promised; the message is "FILE:LINE: reason"
    ("FILE: reason" when no line applies). `category` is one of CATEGORIES."""

    exit_code = 1

    def __init__(self, file: str, line: int | None, reason: str, category: str) -> None:
        super().__init__(f"{file}: {reason}" if line is None else f"{file}:{line}: {reason}")
        self.file, self.line, self.reason, self.category = file, line, reason, category

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by fields, so the error survives the trip from a worker process."""
        return (type(self), (self.file, self.line, self.reason, self.category))


@dataclass
class SkipLog:
    """Records skipped in lenient mode: counts by reason category and a bounded sample of
    (file, line, reason), the first SAMPLE_LIMIT ones kept."""

    counts: dict[str, int] = field(default_factory=dict)
    sample: list[tuple[str, int | None, str]] = field(default_factory=list)

    def add(self, file: str, line: int | None, category: str, reason: str) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown skip category {category!r}; expected one of {CATEGORIES}")
        self.counts[category] = self.counts.get(category, 0) + 1
        if len(self.sample) < SAMPLE_LIMIT:
            self.sample.append((file, line, reason))

    def merge(self, other: SkipLog) -> None:
        """Add `other`'s counts to ours; its sample follows ours, up to SAMPLE_LIMIT entries."""
        for category, count in other.counts.items():
            self.counts[category] = self.counts.get(category, 0) + count
        room = SAMPLE_LIMIT - len(self.sample)
        if room > 0:
            self.sample.extend(other.sample[:room])

    @property
    def total(self) -> int:
        """The number of skipped records (a truncated tail or a skipped file counts once)."""
        return sum(self.counts.values())


@dataclass
class _Reporter:
    """Where problems in one file go: raised (strict, `skipped` None) or recorded (lenient)."""

    file: str
    skipped: SkipLog | None

    def problem(self, line: int | None, category: str, reason: str) -> None:
        self.handle(MalformedInputError(self.file, line, reason, category))

    def handle(self, error: MalformedInputError) -> None:
        if self.skipped is None:
            raise error
        self.skipped.add(error.file, error.line, error.category, error.reason)


def _reporter(path: str, chunk_rows: int, lenient: bool, skipped: SkipLog | None) -> _Reporter:
    """Check the arguments every reader shares, before any reading starts."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    if lenient and skipped is None:
        raise ValueError("lenient reading needs a SkipLog to record what it skips (skipped=...)")
    return _Reporter(os.fspath(path), skipped if lenient else None)


# --- JSONL -----------------------------------------------------------------------------------


class _BrokenStream(Exception):
    """A compressed stream that ends inside a frame ("truncated") or that its codec rejects."""

    def __init__(self, category: str, reason: str) -> None:
        super().__init__(reason)
        self.category, self.reason = category, reason


def read_jsonl(
    path: str,
    *,
    chunk_rows: int = 65536,
    lenient: bool = False,
    skipped: SkipLog | None = None,
) -> Iterator[pa.RecordBatch]:
    """The records of a JSON Lines file (".gz", ".zst"/".zstd" or plain), batches of at most
    `chunk_rows` rows. Blank lines are ignored; line numbers in errors are 1-based physical lines
    of the decompressed text; "invalid UTF-8 at byte N" counts bytes of that line from 1."""
    reporter = _reporter(path, chunk_rows, lenient, skipped)
    return _read_jsonl(os.fspath(path), chunk_rows, reporter)


def _read_jsonl(path: str, chunk_rows: int, reporter: _Reporter) -> Iterator[pa.RecordBatch]:
    rows: list[dict[str, Any]] = []
    numbers: list[int] = []
    seen_record = False
    with paths.open_file(path, "rb") as raw:
        lines = _Lines(_decompressed_blocks(raw, path), reporter)
        for number, line in lines:
            if not line or line.isspace():
                continue
            seen_record = True
            row = _parse_row(line, number, reporter)
            if row is None:
                continue
            rows.append(row)
            numbers.append(number)
            if len(rows) == chunk_rows:
                yield from _rows_to_batches(rows, numbers, reporter)
                rows, numbers = [], []
    yield from _rows_to_batches(rows, numbers, reporter)
    if lines.ended_cleanly and not seen_record:
        reporter.problem(None, "empty_file", _EMPTY)


def read_decompressed(path: str) -> bytes:
    """A whole file's bytes, decompressed by its suffix (.gz, .zst, .zstd; any other: as is).
    MalformedInputError naming the file when the compressed data is truncated or corrupt."""
    with paths.open_file(path, "rb") as raw:
        try:
            return b"".join(_decompressed_blocks(raw, path))
        except _BrokenStream as broken:
            raise MalformedInputError(path, None, broken.reason, broken.category) from None


def _decompressed_blocks(raw: IO[bytes], path: str) -> Iterator[bytes]:
    """The decompressed bytes of `raw` in blocks, the codec chosen by the suffix of `path`."""
    name = path.lower()
    if name.endswith(".gz"):
        return _gzip_blocks(raw)
    if name.endswith((".zst", ".zstd")):
        return _zstd_blocks(raw)
    return iter(lambda: raw.read(_BLOCK_BYTES), b"")


def _gzip_blocks(raw: IO[bytes]) -> Iterator[bytes]:
    """Decompressed gzip blocks. read1, not read: read loses what it decompressed in the call
    that finds the stream truncated, and with it the lines just before the break."""
    with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
        while True:
            try:
                block = stream.read1(_BLOCK_BYTES)
            except EOFError as error:
                raise _BrokenStream("truncated", _TRUNCATED) from error
            except (gzip.BadGzipFile, zlib.error) as error:
                raise _corrupt(error) from error
            if not block:
                return
            yield block


def _zstd_blocks(raw: IO[bytes]) -> Iterator[bytes]:
    """Decompress every zstd frame in turn. zstandard's own stream_reader treats a truncated
    frame as a clean end of data, so frames are tracked here to notice one that never ends."""
    decompressor = zstandard.ZstdDecompressor()
    frame = decompressor.decompressobj()
    in_frame = False
    while data := raw.read(_COMPRESSED_READ_BYTES):
        while data:
            try:
                block = frame.decompress(data)
            except zstandard.ZstdError as error:
                raise _corrupt(error) from error
            in_frame = True
            if block:
                yield block
            if not frame.eof:
                break
            data = frame.unused_data
            frame, in_frame = decompressor.decompressobj(), False
    if in_frame:
        raise _BrokenStream("truncated", _TRUNCATED)


def _corrupt(error: Exception) -> _BrokenStream:
    return _BrokenStream("unreadable", f"corrupt compressed data: {error}")


class _Lines:
    """(line number, line bytes without "\\n") of decompressed blocks. A broken stream is reported
    at the line being read when it broke; `ended_cleanly` says whether the stream ended well."""

    def __init__(self, blocks: Iterator[bytes], reporter: _Reporter) -> None:
        self._blocks = blocks
        self._reporter = reporter
        self.ended_cleanly = False

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        number = 0
        pending: list[bytes] = []  # pieces of a line that spans blocks
        while (block := self._next_block(number + 1)) is not None:
            parts = block.split(b"\n")
            if len(parts) == 1:
                pending.append(block)
                continue
            pending.append(parts[0])
            parts[0] = b"".join(pending)
            pending = [parts.pop()]
            for part in parts:
                number += 1
                yield number, part
        if self.ended_cleanly and (tail := b"".join(pending)):
            yield number + 1, tail

    def _next_block(self, line: int) -> bytes | None:
        """The next block; None at the end of the stream or once a broken stream is reported."""
        try:
            return next(self._blocks)
        except StopIteration:
            self.ended_cleanly = True
        except _BrokenStream as broken:
            self._reporter.problem(line, broken.category, broken.reason)
        return None


def _parse_row(line: bytes, number: int, reporter: _Reporter) -> dict[str, Any] | None:
    """The JSON object on one line, or None once its problem is reported."""
    try:
        value = orjson.loads(line[len(_BOM) :] if number == 1 and line.startswith(_BOM) else line)
    except orjson.JSONDecodeError as error:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as bad:
            reporter.problem(number, "invalid_utf8", f"invalid UTF-8 at byte {bad.start + 1}")
            return None
        reason = f"not valid JSON: {error.msg} (column {error.colno})"
        reporter.problem(number, "invalid_json", reason)
        return None
    if not isinstance(value, dict):
        reason = f"expected a JSON object, found {_KINDS.get(type(value), 'null')}"
        reporter.problem(number, "not_an_object", reason)
        return None
    return value


def _rows_to_batches(
    rows: list[dict[str, Any]], numbers: list[int], reporter: _Reporter
) -> Iterator[pa.RecordBatch]:
    """One batch for the rows, or several when rows have no common Arrow type (split at the first
    conflicting row). A row that does not convert on its own is reported and left out."""
    if not rows:
        return
    try:
        whole = _to_batches(rows)  # the common case: one conversion
    except _CONVERSION_ERRORS:
        whole = None  # some rows conflict: convert run by run below
    if whole is not None:
        yield from whole
        return
    start = 0
    while start < len(rows):
        end, batches, error = _convert_run(rows, start)
        if error is not None:
            reason = f"record has no Arrow type: {error}"
            reporter.problem(numbers[start], "schema_mismatch", reason)
            start += 1
            continue
        yield from batches
        start = end


def _convert_run(
    rows: list[dict[str, Any]], start: int
) -> tuple[int, list[pa.RecordBatch], Exception | None]:
    """(end, batches, None) for the longest run rows[start:end] that converts, found by galloping
    then bisecting (cost O(run length x log)); (start, [], error) when rows[start] alone fails."""
    good_end, good, bad_end, size = start, [], None, 1
    failure: Exception | None = None
    while bad_end is None and good_end < len(rows):
        end = min(start + size, len(rows))
        try:
            good, good_end = _to_batches(rows[start:end]), end
        except _CONVERSION_ERRORS as error:
            failure, bad_end = error, end
        size *= 2
    if bad_end is None:
        return good_end, good, None
    if good_end == start:
        return start, [], failure
    while bad_end - good_end > 1:
        middle = (good_end + bad_end) // 2
        try:
            good, good_end = _to_batches(rows[start:middle]), middle
        except _CONVERSION_ERRORS:
            bad_end = middle
    return good_end, good, None


def _to_batches(rows: list[dict[str, Any]]) -> list[pa.RecordBatch]:
    """Rows as record batches, columns the union of all keys (one batch unless > 2 GiB)."""
    array = pa.array(rows)
    chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
    return [pa.RecordBatch.from_struct_array(chunk) for chunk in chunks]


# --- Parquet ---------------------------------------------------------------------------------


def read_parquet(
    path: str,
    *,
    columns: Sequence[str] | None = None,
    filter: pc.Expression | None = None,
    chunk_rows: int = 65536,
    expected_schema: pa.Schema | None = None,
    lenient: bool = False,
    skipped: SkipLog | None = None,
) -> Iterator[pa.RecordBatch]:
    """The rows of a Parquet file in batches of at most `chunk_rows` rows, only `columns` (in that
    order; all when None) and only rows matching `filter` (pushed down to row groups).

    With `expected_schema`, the projected columns must have exactly its names and types (order and
    nullability aside); batches then come in its column order. A mismatch is a "schema_mismatch"
    problem for the whole file."""
    reporter = _reporter(path, chunk_rows, lenient, skipped)
    names = None if expected_schema is None else set(expected_schema.names)
    if columns is not None and names is not None and set(columns) != names:
        raise ValueError(f"columns {list(columns)} differ from expected_schema's columns")
    return _read_parquet(os.fspath(path), columns, filter, chunk_rows, expected_schema, reporter)


def parquet_schema(path: str, columns: Sequence[str] | None = None) -> pa.Schema:
    """The schema of a Parquet file, projected to `columns` (in that order) when given, read from
    its footer only."""
    path = os.fspath(path)
    with _open_parquet(path, *_parquet_location(path)) as file:
        schema = file.schema_arrow
    return schema if columns is None else _project(path, schema, columns)


def _read_parquet(
    path: str,
    columns: Sequence[str] | None,
    row_filter: pc.Expression | None,
    chunk_rows: int,
    expected_schema: pa.Schema | None,
    reporter: _Reporter,
) -> Iterator[pa.RecordBatch]:
    """The batches of one Parquet file. Without a filter, decoded by ParquetFile.iter_batches one
    batch of about PARQUET_BATCH_BYTES at a time (an Arrow dataset scanner reads 16 batches
    ahead): a process's fresh memory costs more to fault in than the decoding, on a VM."""
    try:
        source, filesystem = _parquet_location(path)
        file = _open_parquet(path, source, filesystem)
    except MalformedInputError as error:
        reporter.handle(error)
        return
    with file:
        try:
            schema = file.schema_arrow
            schema = schema if columns is None else _project(path, schema, columns)
            if expected_schema is not None:
                if (difference := _schema_difference(schema, expected_schema)) is not None:
                    reason = f"schema differs: {difference}"
                    raise MalformedInputError(path, None, reason, "schema_mismatch")
                columns = expected_schema.names
        except MalformedInputError as error:
            reporter.handle(error)
            return
        columns = None if columns is None else list(columns)
        if row_filter is None:
            batch_rows = min(chunk_rows, _rows_in(file.metadata, PARQUET_BATCH_BYTES))
            batches = file.iter_batches(batch_size=batch_rows, columns=columns)
        else:
            batches = _filtered(source, filesystem, columns, row_filter, chunk_rows)
        while (batch := _next_parquet_batch(batches, reporter)) is not None:
            for offset in range(0, batch.num_rows, chunk_rows):
                yield batch.slice(offset, chunk_rows)


def _rows_in(metadata: pq.FileMetaData, target_bytes: int) -> int:
    """How many rows of a Parquet file make about `target_bytes` decoded (its row groups'
    uncompressed sizes, all columns), at least 1,024."""
    rows = metadata.num_rows
    total = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    return max(1024, rows * target_bytes // total) if total > 0 else max(1024, rows)


def _filtered(
    source: str,
    filesystem: Any,
    columns: list[str] | None,
    row_filter: pc.Expression,
    chunk_rows: int,
) -> Iterator[pa.RecordBatch]:
    """The rows of a Parquet file where `row_filter` holds, through an Arrow dataset scanner
    (row groups whose statistics exclude the filter are not read). Built eagerly: a filter that
    does not fit the file's columns raises here, as itself. pyarrow.dataset is imported here:
    only filtered reads need it, and it costs every worker process ~40 ms at start (~0.2 s
    more where pandas is installed: it imports pandas)."""
    import pyarrow.dataset as ds

    dataset = ds.dataset(source, format="parquet", filesystem=filesystem)
    scanner = dataset.scanner(columns=columns, filter=row_filter, batch_size=chunk_rows)
    return iter(scanner.to_batches())


def _next_parquet_batch(
    batches: Iterator[pa.RecordBatch], reporter: _Reporter
) -> pa.RecordBatch | None:
    """The next batch; None at the end or once an unreadable file is reported."""
    try:
        return next(batches)
    except StopIteration:
        return None
    except _ACCESS_ERRORS:
        raise
    except (pa.ArrowInvalid, OSError) as error:
        reporter.problem(None, "unreadable", f"not a readable Parquet file: {_short(error)}")
        return None


def _parquet_location(path: str) -> tuple[str, Any]:
    """Where a Parquet file is: (its absolute path, None) when local, else (its path on the
    filesystem, that fsspec filesystem); MalformedInputError when it is empty."""
    if paths.is_local(path):
        source, filesystem = os.path.abspath(paths.local_path(path)), None
        size = os.path.getsize(source)
    else:
        filesystem, source = paths.filesystem(path)
        size = filesystem.size(source)
    if size == 0:
        raise MalformedInputError(path, None, _EMPTY, "empty_file")
    return source, filesystem


def _open_parquet(path: str, source: str, filesystem: Any) -> pq.ParquetFile:
    """The Parquet file `path` (at `source` on `filesystem`) opened, its footer read;
    MalformedInputError when it is not Parquet."""
    try:
        return pq.ParquetFile(source, filesystem=filesystem)
    except _ACCESS_ERRORS:
        raise
    except (pa.ArrowInvalid, OSError) as error:
        reason = f"not a readable Parquet file: {_short(error)}"
        raise MalformedInputError(path, None, reason, "unreadable") from error


def _short(error: Exception) -> str:
    """Pyarrow's message without the prefixes that repeat the path."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return re.sub(r"^.*Could not open Parquet input source '[^']*': ", "", text)


def _project(path: str, schema: pa.Schema, columns: Sequence[str]) -> pa.Schema:
    """`schema` reduced to `columns`, in their order; a missing column is a schema mismatch."""
    for name in columns:
        if schema.get_field_index(name) < 0:
            reason = f"schema differs: no column '{name}' (it has: {', '.join(schema.names)})"
            raise MalformedInputError(path, None, reason, "schema_mismatch")
    return pa.schema([schema.field(name) for name in columns])


def _schema_difference(actual: pa.Schema, expected: pa.Schema) -> str | None:
    """The first difference in column names or types (not order, nullability or metadata)."""
    for wanted in expected:
        index = actual.get_field_index(wanted.name)
        if index < 0:
            return f"column '{wanted.name}' is missing, expected {wanted.type}"
        found = actual.field(index).type
        if not found.equals(wanted.type):
            return f"column '{wanted.name}' is {found}, expected {wanted.type}"
    for name in actual.names:
        if expected.get_field_index(name) < 0:
            return f"column '{name}' is not in the expected schema"
    return None
