"""`keel data stats`: what a document set, a token cache or raw input holds, and what each stage
dropped.

A document set is read column by column (text, and language and quality_score when present),
one record batch at a time: `bytes` is the UTF-8 size of the text column (what a filter shrinks),
not the size of the Parquet files (that is `file_bytes`: compression and metadata make it grow
or shrink on its own). Histograms: document length in UTF-8 bytes, language, quality score.

Raw input (Parquet, JSONL or text files, or a glob of them) is read as the stages read it
(keel.data.inputs), on keel/flow workers that each tally their batches; it has no stage report.

A token cache is read from its manifest and shards: documents, tokens (EOS ids included) and the
document length histogram in tokens (documents end at EOS ids); it holds no text, so `bytes` is
None there.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keel.core import paths
from keel.core.errors import UsageError
from keel.data import documents, inputs
from keel.data.documents import STAGE_FILE, TEXT_COLUMN, StageReport
from keel.data.token_cache import MANIFEST_FILE, Manifest
from keel.flow import RunOptions
from keel.flow.runner import SUCCESS_MARKER
from keel.flow.sources import directory_hint, expand

LANGUAGE_COLUMN = "language"
QUALITY_COLUMN = "quality_score"
"""The attribute columns `keel data quality` adds (keel.data.langid, keel.data.quality)."""
ATTRIBUTE_TYPES = {LANGUAGE_COLUMN: pa.string(), QUALITY_COLUMN: pa.float64()}
"""The attribute columns stats reads besides the text, with their types (for JSONL fields)."""
TALLY_COLUMN = "tally"
"""The column of a worker's tallies (JSON), one row per batch, for raw input."""
LENGTH_EDGES = (0, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
"""Length bins: [0, 64), [64, 256), ... by powers of 4; the last bin is [1 Mi, inf)."""
QUALITY_BINS = 10
"""Quality score bins over [0, 1]: [0, 0.1), ..., [0.9, 1.0]."""
TOP_LANGUAGES = 10
"""Languages listed by name; the rest count as "other"."""
BATCH_ROWS = 65_536
SHARD_CHUNK_TOKENS = 16 * 1024 * 1024
"""Token ids read at once when scanning a cache shard for document ends."""


@dataclass
class Histogram:
    """Counts per bin: `bins` [(label, count)] in order; `nulls` counts documents without a
    value; `unit` says what is counted along the bins (bytes, tokens, score, language)."""

    unit: str
    bins: list[tuple[str, int]] = field(default_factory=list)
    nulls: int = 0

    @property
    def total(self) -> int:
        return sum(count for _, count in self.bins) + self.nulls


@dataclass
class DataStats:
    """What `keel data stats` reports for a document set or a token cache."""

    path: str
    kind: str
    """"documents" (Parquet parts) or "token_cache" (manifest.json)."""
    documents: int = 0
    files: int = 0
    bytes: int | None = 0
    """UTF-8 bytes of the text column (None for a token cache: it holds no text)."""
    file_bytes: int = 0
    """Bytes of the data files (Parquet parts or cache shards) as stored."""
    tokens: int | None = None
    stage: StageReport | None = None
    length: Histogram | None = None
    """Document length: UTF-8 bytes of the text, or tokens (EOS included) in a cache."""
    language: Histogram | None = None
    """None when the documents have no `language` column."""
    quality: Histogram | None = None
    """None when the documents have no `quality_score` column."""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def data_stats(path: str, options: RunOptions | None = None) -> DataStats:
    """Stats of a document-set directory or a token-cache directory (a committed document set
    with no part files, e.g. a filter that dropped everything, has 0 documents), or of raw input:
    Parquet, JSONL or text files, or a glob of them, read as the stages read them
    (keel.data.inputs) on keel/flow workers (`options`)."""
    if documents.names_files(path):
        return _input_stats(path, options)
    names = paths.list_dir(path)
    if not names:
        raise UsageError(f"{path}: no such directory, or it is empty")
    stage = StageReport.read(path) if STAGE_FILE in names else None
    if MANIFEST_FILE in names:
        return _cache_stats(path, stage)
    parts = [name for name in names if name.startswith("part-") and name.endswith(".parquet")]
    if not parts and stage is None and SUCCESS_MARKER not in names:
        raise UsageError(
            f"{path}: neither a document set (part-*.parquet) nor a token cache"
            f"{directory_hint(path)}"
        )
    stats = DataStats(path=path, kind="documents", files=len(parts), stage=stage)
    tally = Tally()
    for name in parts:
        fs, file_path = paths.filesystem(paths.join(path, name))
        stats.file_bytes += int(fs.size(file_path))
        with fs.open(file_path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            present = set(parquet.schema_arrow.names)
            if TEXT_COLUMN not in present:
                raise UsageError(f"{path}/{name}: no '{TEXT_COLUMN}' column")
            wanted = [c for c in (TEXT_COLUMN, LANGUAGE_COLUMN, QUALITY_COLUMN) if c in present]
            for batch in parquet.iter_batches(BATCH_ROWS, columns=wanted):
                tally.add(batch)
    tally.fill(stats)
    return stats


def _input_stats(input: str, options: RunOptions | None) -> DataStats:
    """Stats of raw input files: each worker tallies its batches, the tallies are summed."""
    files = expand(documents.parquet_glob(input))
    names = inputs.column_names(input) or [TEXT_COLUMN]
    fields = {name: kind for name, kind in ATTRIBUTE_TYPES.items() if name in names}
    wanted = [TEXT_COLUMN, *fields]
    tallies = (
        inputs.read_documents(input, columns=wanted, fields=fields)
        .map_batches(_tally_row)
        .to_table(options=options)
    )
    tally = Tally()
    for row in tallies.column(TALLY_COLUMN).to_pylist():
        tally.merge(Tally.from_dict(json.loads(row)))
    stats = DataStats(path=input, kind="documents", files=len(files))
    for file in files:
        fs, file_path = paths.filesystem(file)
        stats.file_bytes += int(fs.size(file_path))
    tally.fill(stats)
    return stats


def _tally_row(batch: pa.RecordBatch) -> pa.RecordBatch:
    """map_batches: documents -> one row, the batch's Tally as JSON."""
    tally = Tally()
    tally.add(batch)
    return pa.RecordBatch.from_pydict({TALLY_COLUMN: [json.dumps(tally.to_dict())]})


@dataclass
class Tally:
    """What stats counts over batches of documents (text, and language and quality_score when
    present): documents, UTF-8 text bytes, and the histograms' counts."""

    documents: int = 0
    bytes: int = 0
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(len(LENGTH_EDGES), np.int64))
    """Documents per LENGTH_EDGES bin, int64 [len(LENGTH_EDGES)]."""
    qualities: np.ndarray = field(default_factory=lambda: np.zeros(QUALITY_BINS, np.int64))
    """Documents per quality bin, int64 [QUALITY_BINS]."""
    languages: Counter[str] = field(default_factory=Counter)
    nulls: Counter[str] = field(default_factory=Counter)
    """Documents without a value, by attribute column."""
    columns: set[str] = field(default_factory=set)
    """The attribute columns seen."""

    def add(self, batch: pa.RecordBatch) -> None:
        names = batch.schema.names
        self.columns.update(name for name in (LANGUAGE_COLUMN, QUALITY_COLUMN) if name in names)
        self.documents += batch.num_rows
        sizes = _utf8_sizes(batch.column(TEXT_COLUMN))
        self.bytes += int(sizes.sum())
        self.lengths += _length_counts(sizes)
        if LANGUAGE_COLUMN in names:
            language = batch.column(LANGUAGE_COLUMN)
            self.nulls[LANGUAGE_COLUMN] += language.null_count
            self.languages.update(language.drop_null().to_pylist())
        if QUALITY_COLUMN in names:
            score = batch.column(QUALITY_COLUMN)
            self.nulls[QUALITY_COLUMN] += score.null_count
            values = np.clip(score.drop_null().to_numpy(zero_copy_only=False), 0.0, 1.0)
            self.qualities += np.histogram(values, QUALITY_BINS, (0.0, 1.0))[0]

    def merge(self, other: Tally) -> None:
        self.documents += other.documents
        self.bytes += other.bytes
        self.lengths += other.lengths
        self.qualities += other.qualities
        self.languages.update(other.languages)
        self.nulls.update(other.nulls)
        self.columns |= other.columns

    def to_dict(self) -> dict:
        return {
            "documents": self.documents,
            "bytes": self.bytes,
            "lengths": self.lengths.tolist(),
            "qualities": self.qualities.tolist(),
            "languages": dict(self.languages),
            "nulls": dict(self.nulls),
            "columns": sorted(self.columns),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Tally:
        return cls(
            data["documents"],
            data["bytes"],
            np.array(data["lengths"], np.int64),
            np.array(data["qualities"], np.int64),
            Counter(data["languages"]),
            Counter(data["nulls"]),
            set(data["columns"]),
        )

    def fill(self, stats: DataStats) -> None:
        """Set the stats' counts and histograms from this tally."""
        stats.documents, stats.bytes = self.documents, self.bytes
        stats.length = _length_histogram(self.lengths, "bytes")
        if LANGUAGE_COLUMN in self.columns:
            stats.language = _language_histogram(self.languages, self.nulls[LANGUAGE_COLUMN])
        if QUALITY_COLUMN in self.columns:
            stats.quality = Histogram(
                "score",
                [
                    (f"{i / QUALITY_BINS:.1f}-{(i + 1) / QUALITY_BINS:.1f}", int(count))
                    for i, count in enumerate(self.qualities)
                ],
                self.nulls[QUALITY_COLUMN],
            )


def _cache_stats(path: str, stage: StageReport | None) -> DataStats:
    manifest = Manifest.from_json(paths.read_text(paths.join(path, MANIFEST_FILE)))
    lengths = np.zeros(len(LENGTH_EDGES), np.int64)
    for shard in manifest.shards:
        tokens = _document_tokens(
            paths.join(path, shard.file), manifest.numpy_dtype, manifest.eos_id
        )
        lengths += _length_counts(tokens)
    return DataStats(
        path=path,
        kind="token_cache",
        documents=manifest.documents,
        files=len(manifest.shards),
        bytes=None,
        file_bytes=sum(shard.bytes for shard in manifest.shards),
        tokens=manifest.total_tokens,
        stage=stage,
        length=_length_histogram(lengths, "tokens"),
        extra={"vocab_size": manifest.vocab_size, "dtype": manifest.dtype},
    )


def _document_tokens(shard: str, dtype: np.dtype, eos_id: int) -> np.ndarray:
    """Tokens of each document of a shard (EOS included): int64 [documents in the shard]."""
    ends: list[np.ndarray] = []
    offset = 0
    with paths.open_file(shard, "rb") as handle:
        while chunk := handle.read(SHARD_CHUNK_TOKENS * dtype.itemsize):
            ids = np.frombuffer(chunk, dtype)
            ends.append(np.flatnonzero(ids == eos_id) + offset + 1)
            offset += len(ids)
    positions = np.concatenate([np.zeros(1, np.int64), *ends])
    return np.diff(positions)


def _utf8_sizes(texts: pa.Array) -> np.ndarray:
    """UTF-8 bytes of each text (a null text: 0): int64 [documents]."""
    sizes = pc.fill_null(pc.binary_length(texts), 0)
    return sizes.to_numpy(zero_copy_only=False).astype(np.int64)


def _length_counts(sizes: np.ndarray) -> np.ndarray:
    """Documents per LENGTH_EDGES bin: int64 [len(LENGTH_EDGES)]."""
    bins = np.searchsorted(np.array(LENGTH_EDGES[1:]), sizes, side="right")
    return np.bincount(bins, minlength=len(LENGTH_EDGES))


def _length_histogram(counts: np.ndarray, unit: str) -> Histogram:
    """The bins from the first to the last that holds a document."""
    filled = np.flatnonzero(counts)
    if len(filled) == 0:
        return Histogram(unit)
    bins = []
    for index in range(filled[0], filled[-1] + 1):
        low = _short(LENGTH_EDGES[index])
        high = _short(LENGTH_EDGES[index + 1]) if index + 1 < len(LENGTH_EDGES) else ""
        bins.append((f"{low}-{high}" if high else f">={low}", int(counts[index])))
    return Histogram(unit, bins)


def _language_histogram(languages: Counter[str], nulls: int) -> Histogram:
    top = languages.most_common(TOP_LANGUAGES)
    other = sum(languages.values()) - sum(count for _, count in top)
    return Histogram("language", [*top, *([("other", other)] if other else [])], nulls)


def _short(size: int) -> str:
    """64, 1Ki, 16Ki, 1Mi."""
    for unit, scale in (("Mi", 1 << 20), ("Ki", 1 << 10)):
        if size >= scale:
            return f"{size // scale}{unit}"
    return str(size)
