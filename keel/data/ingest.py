"""Ingest: raw inputs -> a document set (id, text, source, url), the first DataKit stage.

    from keel.data.ingest import IngestConfig, run_ingest

    run_ingest("raw/*.jsonl.zst", "docs/")  # records with a "text" field
    run_ingest("crawl/*.warc.gz", "web/")  # HTML responses -> main text
    run_ingest("pages/*.jsonl.gz", "docs/", IngestConfig(html_field="html"))  # {"url", "html"}

Formats, by suffix (before .gz/.zst) unless `IngestConfig.format` says:
- jsonl (.jsonl, .json, .ndjson) and parquet: one document per record, the text in
  `text_field`, or HTML in `html_field` whose main text is extracted (keel.data.extract); read by
  keel/flow's readers, leniently: malformed lines are skipped and counted.
- text (.txt, .text; plain, .gz or .zst): one document per UTF-8 file.
- warc (.warc, .warc.gz, .warc.zst; via warcio): one document per HTTP response record with an HTML
  content type; the URL is WARC-Target-URI. Other records (requests, metadata) are not documents.

Every text is normalized (documents.normalize_text) and its id computed from the result. Records
that make no document are counted by reason in stage.json: missing_text / missing_html (the
field is absent, null or not a string), empty_after_normalization, no_main_text (the page has
none), not_html and http_status (WARC responses that are not HTML or not 2xx), invalid_utf8 and
unreadable_file (text files that are not UTF-8, or corrupt), unreadable_warc (a WARC that breaks
mid-way: its records up to there are kept), and the malformed-input categories of keel/flow's
lenient readers (invalid_json, truncated, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import fsspec
import pyarrow as pa
import zstandard
from warcio.archiveiterator import ArchiveIterator
from warcio.exceptions import ArchiveLoadFailed
from warcio.recordloader import ArcWarcRecord

from keel.core import paths
from keel.core.errors import UsageError
from keel.data import documents
from keel.data.extract import decode_html, text_or_reason
from keel.data.stage import STAGED_SCHEMA, WIDE, Stage, staged_row, write_staged
from keel.flow import Dataset, RunOptions, from_items, read_jsonl, read_parquet
from keel.flow.ops import Row
from keel.flow.sources import COMPRESSED_SUFFIXES, JSONL_SUFFIXES, expand

STAGE = "ingest"
FORMATS = ("jsonl", "parquet", "text", "warc")
FILE_COLUMN = "__keel_file"
"""The column keel/flow fills with each record's file path, when no source is configured."""
SUFFIXES = {
    **dict.fromkeys(JSONL_SUFFIXES, "jsonl"),
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".warc": "warc",
}
HTML_TYPES = ("text/html", "application/xhtml+xml")
UNREADABLE_WARC = "unreadable_warc"
_DECOMPRESSION_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError)
_WARC_ERRORS = (ArchiveLoadFailed, AttributeError, *_DECOMPRESSION_ERRORS)
"""What reading a damaged WARC raises: warcio's own error; AttributeError from warcio 1.8 when a
record's headers are cut off (its parser calls None.startswith); the decompressor's errors.
Caught only around warcio's reading calls."""


@dataclass(frozen=True)
class IngestConfig:
    """Ingest settings: how to read the input files."""

    format: str | None = None
    """"jsonl", "parquet", "text" or "warc"; None: from the files' suffix."""
    text_field: str = "text"
    """jsonl/parquet: the field holding each document's text."""
    html_field: str | None = None
    """jsonl/parquet: when set, the field holding each record's raw HTML, whose main text becomes
    the document (text_field is then not read)."""
    url_field: str = "url"
    """jsonl/parquet: the field holding the URL, when records have one."""
    source: str | None = None
    """The `source` of every document; None: the path of the file it came from."""

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise UsageError(
                f"IngestConfig.format must be one of {', '.join(FORMATS)} or None, "
                f"got {self.format!r}"
            )


def run_ingest(
    input: str,
    output: str,
    config: IngestConfig = IngestConfig(),
    options: RunOptions | None = None,
) -> documents.StageReport:
    """Read the files matching `input` (a glob or a file; any fsspec URL) into the document set
    `output`: part files and stage.json with the records dropped by reason, committed together."""
    with documents.stage_output(output, input) as staging:
        files = _files(input)
        format = config.format or input_format(files)
        report = documents.StageReport(
            STAGE,
            details={"config": dataclasses.asdict(config), "format": format, "files": len(files)},
        )
        staged = _staged(input, files, format, config)
        skipped = write_staged(staged, staging, report, options).skipped
        report.documents_in += skipped.total
        for category, count in sorted(skipped.counts.items()):
            report.drop(category, count=count)
        if skipped.sample:
            report.details["malformed_sample"] = [
                f"{file}:{line}: {reason}" if line is not None else f"{file}: {reason}"
                for file, line, reason in skipped.sample[: documents.DROPPED_SAMPLE]
            ]
        report.write(staging)
    return report


def input_format(files: tuple[str, ...]) -> str:
    """The format all `files` share by suffix; UsageError when one is unknown or they differ."""
    found = {path: _suffix_format(path) for path in files}
    unknown = [path for path, format in found.items() if format is None]
    if unknown:
        raise UsageError(
            f"cannot tell the format of {unknown[0]} by its suffix "
            f"({', '.join(SUFFIXES)}, optionally .gz/.zst): set IngestConfig.format"
        )
    formats = sorted(set(found.values()))
    if len(formats) > 1:
        raise UsageError(
            f"the input mixes formats ({', '.join(formats)}): ingest each format separately, "
            "or set IngestConfig.format"
        )
    return formats[0]


def _suffix_format(path: str) -> str | None:
    name = path.lower()
    for suffix in COMPRESSED_SUFFIXES:
        name = name.removesuffix(suffix)
    return next((f for suffix, f in SUFFIXES.items() if name.endswith(suffix)), None)


def _files(input: str) -> tuple[str, ...]:
    fs, fs_path = paths.filesystem(input)
    if not paths.is_glob(fs_path) and fs.isdir(fs_path):
        raise UsageError(
            f"{input} is a directory: pass a glob of its files, such as {input}/*.jsonl.gz"
        )
    return expand(input)


def _staged(input: str, files: tuple[str, ...], format: str, config: IngestConfig) -> Dataset:
    """The pipeline of staged rows (stage.STAGED_SCHEMA) for one input."""
    if format in ("jsonl", "parquet"):
        field = config.html_field or config.text_field
        convert = functools.partial(
            records_batch,
            field=field,
            html=config.html_field is not None,
            url_field=config.url_field,
            source=config.source,
        )
        file_column = FILE_COLUMN if config.source is None else None
        if format == "jsonl":
            return read_jsonl(input, lenient=True, file_column=file_column).map_batches(convert)
        schema = read_parquet(input, lenient=True).source.schema
        if schema is not None and field not in schema.names:
            raise UsageError(
                f"{files[0]} has no column {field!r} (columns: {', '.join(schema.names)}): "
                "set IngestConfig.text_field (or html_field) to the column with the text"
            )
        columns = None
        if schema is not None:
            columns = [field] + ([config.url_field] if config.url_field in schema.names else [])
        dataset = read_parquet(input, columns=columns, lenient=True, file_column=file_column)
        return dataset.map_batches(convert)
    read_file = text_file_rows if format == "text" else warc_file_rows
    items = [{"path": path} for path in files]
    return (
        from_items(items, num_shards=len(items))  # one shard per file
        .flat_map(functools.partial(read_file, source=config.source))
        .map_batches(_typed)
    )


def records_batch(
    batch: pa.RecordBatch, field: str, html: bool, url_field: str, source: str | None
) -> pa.RecordBatch:
    """A chunk of JSONL/Parquet records -> staged rows: the text (or extracted HTML) of `field`,
    the URL of `url_field` when it is a string; the source is `source`, or else each row's file
    (FILE_COLUMN)."""
    values = _column(batch, field)
    urls = _column(batch, url_field)
    sources = [source] * batch.num_rows if source is not None else _column(batch, FILE_COLUMN)
    rows = [
        staged_row(*text_or_reason(value, html=html, url=url), origin, url)
        for value, url, origin in zip(values, urls, sources, strict=True)
    ]
    return pa.RecordBatch.from_pylist(rows, schema=STAGED_SCHEMA)


def text_file_rows(item: Row, source: str | None) -> Iterator[Row]:
    """One text file (UTF-8; plain, .gz or .zst) -> one staged row, its path the source and the
    locator; "invalid_utf8" or "unreadable_file" (corrupt compression) when it has no text."""
    path = item["path"]
    with fsspec.open(path, "rb", compression="infer") as handle:
        try:
            data = handle.read()
        except _DECOMPRESSION_ERRORS:
            data = None
    if data is None:
        text, reason = None, "unreadable_file"
    else:
        try:
            text, reason = text_or_reason(data.decode("utf-8-sig"))
        except UnicodeDecodeError:
            text, reason = None, "invalid_utf8"
    yield staged_row(text, reason, source or path, None, locator=path)


def warc_file_rows(item: Row, source: str | None) -> Iterator[Row]:
    """One WARC file (plain, .gz or .zst) -> a staged row per response record. A file that is
    cut short or corrupt yields its records up to the break, then one "unreadable_warc" row."""
    path = item["path"]
    source = source or path
    # warcio reads gzip itself, member by member, so that the records before a damaged member
    # are kept (Python's gzip fails the whole read); other compressions go through fsspec
    compression = None if path.lower().endswith(".gz") else "infer"
    with fsspec.open(path, "rb", compression=compression) as handle:
        try:
            for url, status, content_type, body in warc_responses(handle):
                yield warc_response_row(url, status, content_type, body, source)
        except UnreadableWarcError as error:
            yield staged_row(None, UNREADABLE_WARC, source, None, locator=f"{path}: {error}")


class UnreadableWarcError(Exception):
    """A WARC stream is corrupt or ends inside a record."""


def warc_responses(handle: IO[bytes]) -> Iterator[tuple[str | None, str, str, bytes | None]]:
    """The response records of a WARC stream (plain or gzip): (WARC-Target-URI, HTTP status code,
    Content-Type, body); the body is read only for 2xx HTML responses (None otherwise).

    warcio reads damaged files leniently; this raises UnreadableWarcError where it can tell that
    a file is damaged: warcio fails to parse a record, the stream ends inside a record's
    content, or bytes are left after the last whole record."""
    records = ArchiveIterator(handle)
    last = None
    while True:
        try:
            record = next(records, None)
        except _WARC_ERRORS as error:
            raise UnreadableWarcError(f"{type(error).__name__}: {error}") from error
        if record is None:
            break
        last = record
        if record.rec_type != "response":
            continue
        http = record.http_headers
        status = http.get_statuscode() if http is not None else ""
        content_type = (http.get_header("Content-Type") or "") if http is not None else ""
        body = None
        if status.startswith("2") and _mime(content_type) in HTML_TYPES:
            try:
                body = record.content_stream().read()
            except _WARC_ERRORS as error:
                raise UnreadableWarcError(f"{type(error).__name__}: {error}") from error
            if _unread(record):
                raise UnreadableWarcError("the file ends inside a record")
        yield record.rec_headers.get_header("WARC-Target-URI"), status, content_type, body
    if (last is not None and _unread(last)) or records.offset != handle.tell():
        raise UnreadableWarcError("the file ends inside a record")


def warc_response_row(
    url: str | None, status: str, content_type: str, body: bytes | None, source: str
) -> Row:
    """A WARC response -> a staged row: the main text of a 2xx HTML response, else
    "http_status" or "not_html"."""
    if status and not status.startswith("2"):
        return staged_row(None, "http_status", source, url)
    if _mime(content_type) not in HTML_TYPES or body is None:
        return staged_row(None, "not_html", source, url)
    html = decode_html(body, content_type)
    return staged_row(*text_or_reason(html, html=True, url=url), source, url)


def _mime(content_type: str) -> str:
    return content_type.split(";")[0].strip().lower()


def _unread(record: ArcWarcRecord) -> bool:
    """Whether bytes that the record's Content-Length promises are missing (a cut-off file)."""
    return getattr(record.raw_stream, "limit", 0) > 0


def _column(batch: pa.RecordBatch, name: str) -> list:
    if name not in batch.schema.names:
        return [None] * batch.num_rows
    return batch.column(name).to_pylist()


def _typed(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Rows from flat_map (types inferred per chunk: null where a chunk has no value) ->
    STAGED_SCHEMA."""
    return pa.RecordBatch.from_arrays(
        [batch.column(field.name).cast(field.type) for field in STAGED_SCHEMA],
        schema=STAGED_SCHEMA,
    )


INGEST = Stage(
    STAGE,
    IngestConfig,
    WIDE,
    run=run_ingest,
    help="Raw JSONL/Parquet/text/HTML/WARC files -> a normalized document set with ids.",
)
