"""Document sets: the format every DataKit stage reads and writes, and its shared helpers.

A document set is a directory of zstd Parquet files `part-00000-of-00008.parquet` (keel/flow's
output) with at least
    id      32 hex chars: xxh3-128 of the text, so the same text always gets the same id
    text    UTF-8, normalized (NFC, "\\n" newlines, no control characters but tab and newline)
    source  where the document came from (a file, a dataset name)
plus optional `url` and attribute columns added by stages (scores, language, cluster, ...).

A stage's output directory holds its kept documents as part files, its side tables
(removed.parquet, contaminated.parquet, ...), `stage.json` and `_SUCCESS`. All are written into
one staging directory and appear together in one commit (`stage_output`, keel.core.commit), so
a killed stage leaves no output rather than documents without their record; `_SUCCESS` lists
stage.json as a record, and a reader refuses a directory whose listed record is missing.
`stage.json` says documents in and out, and the dropped documents counted by reason with a sample
of their ids: every dropped document is accounted for.

The output must be a new or empty directory or a previous output (it has _SUCCESS or stage.json)
and must not be or contain an input: anything else is refused before the stage does any work.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from keel.core import paths
from keel.core.commit import missing_records, staged_output
from keel.core.errors import UsageError
from keel.core.output_checks import InputPaths
from keel.flow.runner import SUCCESS_MARKER
from keel.flow.sources import COMPRESSED_SUFFIXES, JSONL_SUFFIXES, uncompressed_name

ID_COLUMN = "id"
TEXT_COLUMN = "text"
SOURCE_COLUMN = "source"
URL_COLUMN = "url"
STAGE_FILE = "stage.json"
OUTPUT_KIND = "DataKit stage output"
DROPPED_SAMPLE = 20
"""Dropped ids kept per reason in stage.json."""

TEXT_SUFFIXES = (".txt", ".text")
"""Text files: one document per file (keel.data.inputs)."""
_FILE_SUFFIXES = (".parquet", *JSONL_SUFFIXES, *TEXT_SUFFIXES)
"""An input whose name ends so (before .gz, .zst or .zstd) is a file, not a document set
directory."""
_NEWLINES = re.compile(r"\r\n?|[\u2028\u2029\x85\x0b\x0c]")
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")


def document_id(text: str) -> str:
    """The id of a document: xxh3-128 of its UTF-8 text, as 32 lowercase hex characters."""
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def normalize_text(text: str) -> str:
    """NFC, every newline convention to "\\n", control characters other than tab and newline
    removed, trailing whitespace of the whole text stripped."""
    text = unicodedata.normalize("NFC", text)
    text = _NEWLINES.sub("\n", text)
    return _CONTROL.sub("", text).rstrip()


@dataclass
class StageReport:
    """What a stage did to a document set: written as stage.json beside its output."""

    stage: str
    documents_in: int = 0
    documents_out: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    """Reason -> documents dropped for it; sums to documents_in - documents_out."""
    dropped_sample: dict[str, list[str]] = field(default_factory=dict)
    """Reason -> up to DROPPED_SAMPLE ids dropped for it."""
    details: dict = field(default_factory=dict)

    def drop(self, reason: str, ids: Sequence[str] = (), count: int | None = None) -> None:
        """Count documents dropped for `reason` (`count`, default len(ids)) and sample their ids."""
        self.dropped[reason] = self.dropped.get(reason, 0) + (len(ids) if count is None else count)
        sample = self.dropped_sample.setdefault(reason, [])
        sample.extend(ids[: max(0, DROPPED_SAMPLE - len(sample))])

    def write(self, directory: str) -> None:
        paths.write_text(paths.join(directory, STAGE_FILE), json.dumps(asdict(self), indent=2))

    @classmethod
    def read(cls, directory: str) -> StageReport:
        return cls(**json.loads(paths.read_text(paths.join(directory, STAGE_FILE))))


@contextlib.contextmanager
def stage_output(output: str | os.PathLike[str], inputs: InputPaths) -> Iterator[str]:
    """The staging directory of a stage's whole output, committed as `output` when the block
    ends: write the documents there with `write_parquet(staging, commit=False)`, then the side
    tables, then stage.json (StageReport.write). `output` is checked (never an input, never a
    directory of other files) and made writable before the block runs; on any error the staging
    directory is removed. An input directory missing a record its _SUCCESS lists is refused."""
    require_records(inputs)
    with staged_output(
        output,
        marker=SUCCESS_MARKER,
        kind=OUTPUT_KIND,
        inputs=inputs,
        replaces=(STAGE_FILE,),
        records=(STAGE_FILE,),
    ) as staging:
        yield staging


def write_texts(
    directory: str | os.PathLike[str], texts: Sequence[str], parts: int = 1, source: str = "texts"
) -> str:
    """A small document set from in-memory texts, written directly (no worker processes): `parts`
    contiguous zstd Parquet files of (id, text, source). Returns the directory. For tests,
    examples and benchmark inputs; large sets go through keel/flow's write_parquet."""
    directory = os.fspath(directory)
    paths.make_dirs(directory)
    size = -(-len(texts) // parts)
    for part in range(parts):
        chunk = list(texts[part * size : (part + 1) * size])
        table = pa.table(
            {
                ID_COLUMN: pa.array([document_id(text) for text in chunk], pa.string()),
                TEXT_COLUMN: pa.array(chunk, pa.string()),
                SOURCE_COLUMN: pa.array([source] * len(chunk), pa.string()),
            }
        )  # typed, so an empty trailing part (13 texts in 8 parts) has the same schema
        name = f"part-{part:05d}-of-{parts:05d}.parquet"
        with paths.open_file(paths.join(directory, name), "wb") as handle:
            pq.write_table(table, handle, compression="zstd")
    return directory


def parquet_glob(directory_or_glob: str | Sequence[str]) -> str | list[str]:
    """A document set directory -> the glob of its document parts (`part-*.parquet`, so side
    tables such as removed.parquet are not read as documents); a glob or a file stays as is.
    Several inputs (a list or tuple) give a list of globs, which keel/flow reads as one set."""
    if not isinstance(directory_or_glob, str):
        return [_glob_of(str(item)) for item in directory_or_glob]
    return _glob_of(directory_or_glob)


def names_files(input: str) -> bool:
    """Whether an input names files (a glob, or a file by its suffix: Parquet, JSONL or text,
    plain or compressed) rather than a document set directory."""
    if paths.is_glob(input):
        return True
    return input.lower().endswith(COMPRESSED_SUFFIXES) or uncompressed_name(input).endswith(
        _FILE_SUFFIXES
    )


def _glob_of(directory_or_glob: str) -> str:
    if names_files(directory_or_glob):
        return directory_or_glob
    return paths.join(directory_or_glob, "part-*.parquet")


def require_records(inputs: InputPaths) -> None:
    """UsageError for an input directory whose _SUCCESS lists a record (stage.json) that is
    missing: a damaged copy of a stage output, whose drop accounting is lost. Globs and files,
    and directories without records (a plain keel/flow write), pass."""
    items = [inputs] if isinstance(inputs, str | os.PathLike) else list(inputs or ())
    for item in map(os.fspath, items):
        if names_files(item):
            continue
        missing = missing_records(item, SUCCESS_MARKER)
        if missing:
            raise UsageError(
                f"{item} is an incomplete stage output: its {SUCCESS_MARKER} lists "
                f"{', '.join(missing)}, which is missing; run the stage that wrote it again"
            )


def merged_counts(counts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for mapping in counts:
        for key, value in mapping.items():
            total[key] = total.get(key, 0) + value
    return total
