"""What a DataKit stage reads: a document set, Parquet, JSONL or text files, as documents.

    from keel.data.inputs import read_documents

    docs = read_documents("raw/*.jsonl.zst")  # a flow Dataset of (id, text, source) rows
    docs = read_documents("deduped/", columns=["id", "text"])  # a document set, projected

By the input's files (a directory is a document set: its part-*.parquet files):
- Parquet (a document set, a glob or a file): read as is; `columns` and `filter` are pushed down
  into the reader. Documents without an `id` column get one computed from their text (when
  `columns` asks for ids or is not given).
- JSONL (.jsonl, .json, .ndjson; plain, .gz or .zst): one document per record, its text in
  `text`; `id` the record's own when it is a string, else documents.document_id of the text;
  `source` the record's own when a string, else the file's path; `url` when the record has one.
  Other fields are read where a stage asks for them (filter's attribute columns, extract's
  HTML field), typed as the stage needs them.
- text (.txt, .text; plain, .gz or .zst): one document per UTF-8 file, its source the path.
Texts are taken as they are: `keel data ingest` is the stage that normalizes them. A JSONL record
without a string `text` is an error naming the file (ingest counts and drops such records).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keel.core.errors import UsageError
from keel.data import documents
from keel.data.documents import TEXT_SUFFIXES
from keel.flow import Dataset, from_items, read_jsonl, read_parquet
from keel.flow.ops import Row
from keel.flow.readers import read_jsonl as read_jsonl_file
from keel.flow.sources import JSONL_SUFFIXES, expand, format_of_name, uncompressed_name

Input = str | Sequence[str]
"""A document set directory, a glob or a file (any fsspec URL), or a list of them."""
RAW_SCHEMA = pa.schema(
    [
        (documents.ID_COLUMN, pa.string()),
        (documents.TEXT_COLUMN, pa.string()),
        (documents.SOURCE_COLUMN, pa.string()),
        (documents.URL_COLUMN, pa.string()),
    ]
)
"""The columns of documents read from JSONL or text files."""
_FILE = "__keel_input_file"
POSITION_COLUMN = "__keel_position"
"""read_documents(positions=True): each document's place in the input, the same on every read
(keel.flow.sources.with_positions): (file index << 40) | record number within the file."""


def find_places(sorted_places: np.ndarray, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `places` is in `sorted_places` (uint64, ascending): its index there, int64
    [len(places)] (meaningful only where found), and whether it is there, bool [len(places)].
    How a later pass picks out the documents an earlier one chose by place."""
    at = np.searchsorted(sorted_places, places)
    found = at < len(sorted_places)
    found[found] = sorted_places[at[found]] == places[found]
    return at.astype(np.int64), found


def input_format(input: Input) -> str:
    """ "parquet", "jsonl" or "text", by the suffix of the input's first file (a directory is a
    document set: Parquet). UsageError for an unknown suffix or inputs that mix formats."""
    globs = documents.parquet_glob(input)
    names = [globs] if isinstance(globs, str) else list(globs)
    formats = {_format_of(name) for name in names}
    if len(formats) > 1:
        raise UsageError(
            f"the input mixes formats ({', '.join(sorted(formats))}): pass one format at a time"
        )
    return formats.pop()


def read_documents(
    input: Input,
    columns: Sequence[str] | None = None,
    filter: pc.Expression | None = None,
    fields: Mapping[str, pa.DataType] | None = None,
    require_text: bool = True,
    positions: bool = False,
) -> Dataset:
    """The input's documents as a flow Dataset (module doc): Parquet as is, JSONL and text files
    as RAW_SCHEMA rows; `columns` projects them, `filter` keeps the rows where it holds.
    JSONL only: `fields` are record fields kept besides RAW_SCHEMA's, as these types (a stage's
    attribute columns, an HTML field; null where a record lacks one); `require_text=False`
    accepts records without text (extract reads HTML). `positions`: a last column,
    POSITION_COLUMN, places each document in the input (before `filter`), so a second read can
    pick out documents a first one chose."""
    globs = documents.parquet_glob(input)
    format = input_format(input)
    place = POSITION_COLUMN if positions else None
    if format == "parquet":
        schema = read_parquet(globs).source.schema
        names = () if schema is None else schema.names
        computed = documents.ID_COLUMN not in names and documents.TEXT_COLUMN in names
        if not computed or (columns is not None and documents.ID_COLUMN not in columns):
            docs = read_parquet(globs, columns=columns, position_column=place)
        else:  # documents without ids: computed from the text, so every stage can name them
            read = None if columns is None else [c for c in columns if c != documents.ID_COLUMN]
            if read is not None and documents.TEXT_COLUMN not in read:
                read.append(documents.TEXT_COLUMN)
            docs = read_parquet(globs, columns=read, position_column=place).map_batches(add_ids)
    elif format == "jsonl":
        convert = functools.partial(
            jsonl_documents, fields=dict(fields or {}), require_text=require_text
        )
        docs = read_jsonl(globs, file_column=_FILE, position_column=place).map_batches(convert)
    else:
        files = expand(globs)
        docs = (
            from_items([{"path": path} for path in files], len(files), position_column=place)
            .flat_map(text_file_document)
            .map_batches(_typed)
        )
    if filter is not None:
        docs = docs.filter(filter)
    if columns:
        return docs.select(*columns, *([POSITION_COLUMN] if positions else []))
    return docs


def column_names(input: Input) -> list[str] | None:
    """The columns the input's documents have: the first Parquet file's schema (None for an
    empty document set); for JSONL, RAW_SCHEMA's names and the fields of the first file's first
    record; for text files RAW_SCHEMA's names."""
    format = input_format(input)
    if format == "text":
        return list(RAW_SCHEMA.names)
    if format == "jsonl":
        return [*RAW_SCHEMA.names, *record_fields(input)]
    schema = read_parquet(documents.parquet_glob(input)).source.schema
    if schema is None:
        return None
    if documents.TEXT_COLUMN in schema.names and documents.ID_COLUMN not in schema.names:
        return [documents.ID_COLUMN, *schema.names]  # read_documents adds them
    return list(schema.names)


def record_fields(input: Input, records: int = 1) -> dict[str, pa.DataType]:
    """JSONL input: the fields of the first file's first `records` records besides RAW_SCHEMA's,
    with the types Arrow infers from them (a field null in all of them: string); what
    read_documents' `fields` takes to keep them all."""
    first = next(
        read_jsonl_file(expand(documents.parquet_glob(input))[0], chunk_rows=records), None
    )
    if first is None:
        return {}
    return {
        field.name: pa.string() if pa.types.is_null(field.type) else field.type
        for field in first.schema
        if field.name not in RAW_SCHEMA.names
    }


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


def jsonl_documents(
    batch: pa.RecordBatch, fields: dict[str, pa.DataType], require_text: bool = True
) -> pa.RecordBatch:
    """map_batches: JSONL records (with the file column) -> RAW_SCHEMA documents and `fields`."""
    files = batch.column(_FILE).to_pylist()
    texts = _column(batch, documents.TEXT_COLUMN)
    missing = next((n for n, text in enumerate(texts) if not isinstance(text, str)), None)
    if missing is not None and require_text:
        raise UsageError(
            f"{files[missing]}: a record has no string {documents.TEXT_COLUMN!r} field; "
            "`keel data ingest` reads such files, counting and dropping those records"
        )
    texts = [text if isinstance(text, str) else None for text in texts]
    ids = [
        given if isinstance(given, str) else None if text is None else documents.document_id(text)
        for given, text in zip(_column(batch, documents.ID_COLUMN), texts, strict=True)
    ]
    sources = [
        given if isinstance(given, str) else file
        for given, file in zip(_column(batch, documents.SOURCE_COLUMN), files, strict=True)
    ]
    urls = [url if isinstance(url, str) else None for url in _column(batch, documents.URL_COLUMN)]
    arrays = [pa.array(values, pa.string()) for values in (ids, texts, sources, urls)]
    extra = {name: kind for name, kind in fields.items() if name not in RAW_SCHEMA.names}
    for name, kind in extra.items():
        try:
            arrays.append(pa.array(_column(batch, name), kind))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as error:
            raise UsageError(f"{files[0]}: field {name!r} is not {kind} ({error})") from error
    names = [*RAW_SCHEMA.names, *extra]
    if POSITION_COLUMN in batch.schema.names:
        arrays.append(batch.column(POSITION_COLUMN))
        names.append(POSITION_COLUMN)
    return pa.RecordBatch.from_arrays(arrays, names=names)


def text_file_document(item: Row) -> list[Row]:
    """flat_map: one text file (UTF-8; plain, .gz or .zst) -> one document, its path the source."""
    import fsspec  # only text files need it here; its import costs every worker ~35 ms

    path = item["path"]
    with fsspec.open(path, "rb", compression="infer") as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise UsageError(f"{path} is not UTF-8 text ({error})") from error
    document = {"id": documents.document_id(text), "text": text, "source": path, "url": None}
    if POSITION_COLUMN in item:
        document[POSITION_COLUMN] = item[POSITION_COLUMN]
    return [document]


def file_format(name: str) -> str | None:
    """ "parquet", "jsonl" or "text" by a file's name (plain, .gz, .zst or .zstd); None when it
    names none of them."""
    found = format_of_name(name)
    if found is None and uncompressed_name(name).endswith(TEXT_SUFFIXES):
        return "text"
    return found


def _format_of(glob: str) -> str:
    found = file_format(glob)
    if found is not None:
        return found
    raise UsageError(
        f"cannot tell the format of {glob}: pass a document set directory or files ending "
        f".parquet, {', '.join(JSONL_SUFFIXES + TEXT_SUFFIXES)} (optionally .gz/.zst)"
    )


def _column(batch: pa.RecordBatch, name: str) -> list:
    if name not in batch.schema.names:
        return [None] * batch.num_rows
    return batch.column(name).to_pylist()


def _typed(batch: pa.RecordBatch) -> pa.RecordBatch:
    fields = list(RAW_SCHEMA)
    if POSITION_COLUMN in batch.schema.names:
        fields.append(pa.field(POSITION_COLUMN, pa.uint64()))
    schema = pa.schema(fields)
    return pa.RecordBatch.from_arrays(
        [batch.column(field.name).cast(field.type) for field in schema], schema=schema
    )
