"""Tokenization: a document set -> a token cache (keel/data/token_cache.py) and its tokenizer.

The tokenizer is a byte-level BPE that `tokenizers` trains on the input's first `train_bytes` of
text (offline, deterministic: the same documents give the same tokenizer.json bytes), or a
tokenizer.json loaded by path. keel/flow workers encode chunks of documents into a large_binary
column (each document's ids followed by EOS, as little-endian bytes) written as Parquet parts;
the coordinator then streams the parts, row group by row group, into shards and writes the
manifest. Memory: a worker holds one chunk (at most `chunk_documents` documents) and the encodings
of one batch (`batch_bytes` of text); the coordinator one row group.

Threads: `tokenizers` encodes a batch on its own Rayon pool, one thread per core by default. Each
worker gets cores // (workers encoding at once) threads (`threads_per_worker`), so a single input
file still uses every core while many files on many workers do not oversubscribe them.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from keel.core import paths
from keel.core.errors import UsageError
from keel.data.documents import TEXT_COLUMN, StageReport, stage_output
from keel.data.inputs import read_documents
from keel.data.token_cache import (
    TOKENIZER_FILE,
    Manifest,
    ShardWriter,
    dtype_for_vocab,
    write_manifest,
)
from keel.flow import Dataset, RunOptions, SkipLog
from keel.flow.ops import run_narrow

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
TOKENS_COLUMN = "tokens"
BYTE_ALPHABET = 256
TRAIN_BATCH_DOCUMENTS = 1_024


@dataclass(frozen=True)
class TokenizeConfig:
    """How to tokenize. Either train a byte-level BPE (`tokenizer_path=None`) or load one."""

    vocab_size: int = 32_768
    """Ids of a trained tokenizer, the 256 byte tokens and the special tokens included."""
    tokenizer_path: str | None = None
    """A tokenizer.json (local path or fsspec URL) to use instead of training one."""
    eos_token: str = "<|endoftext|>"
    """Appended after every document; must be in a loaded tokenizer's vocabulary."""
    special_tokens: tuple[str, ...] = ()
    """More special tokens for a trained tokenizer (ids right after EOS, which is id 0)."""
    min_frequency: int = 2
    """A pair must occur this often to be merged (training)."""
    train_bytes: int = 256 * MiB
    """Training reads the input's documents in order up to this many UTF-8 bytes."""
    shard_bytes: int = 512 * MiB
    """A shard ends at the first document end at or past this size (bytes)."""
    chunk_documents: int = 8_192
    """Documents a worker reads and holds at once (caps keel/flow's chunk_rows)."""
    batch_bytes: int = 1 * MiB
    """Text (UTF-8 bytes) handed to one encode_batch call: bounds the memory of its encodings
    (about 100 bytes per token) while giving each thread many documents."""
    threads_per_worker: int | None = None
    """Encoding threads per worker; None: cores // (workers encoding at once), at least 1."""
    text_column: str = TEXT_COLUMN


def train_tokenizer(
    texts: Iterator[list[str]],
    vocab_size: int,
    special_tokens: Sequence[str] = ("<|endoftext|>",),
    min_frequency: int = 2,
) -> Tokenizer:
    """A byte-level BPE trained on batches of texts: no normalizer, GPT-2's pre-tokenizer split,
    every byte in the vocabulary (nothing is unknown), special tokens first (ids 0, 1, ...).
    Deterministic: the same texts and settings give the same tokenizer.json."""
    minimum = BYTE_ALPHABET + len(special_tokens)
    if vocab_size < minimum:
        raise UsageError(f"vocab_size {vocab_size} is below {minimum} (256 bytes + special tokens)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def tokenizer_json(tokenizer: Tokenizer) -> bytes:
    """The bytes of tokenizer.json for a tokenizer (compact, in a stable order)."""
    return tokenizer.to_str().encode("utf-8")


def load_tokenizer(path: str) -> bytes:
    """The bytes of a tokenizer.json (local path or fsspec URL); UsageError when it is missing."""
    if not paths.exists(path):
        raise UsageError(f"tokenizer {path} does not exist: pass the path of a tokenizer.json")
    with paths.open_file(path, "rb") as handle:
        return handle.read()


@dataclass(frozen=True)
class Encoder:
    """The map_batches function: a chunk with a text column -> one `tokens` row per document,
    its ids followed by EOS as little-endian bytes of `dtype` (large_binary)."""

    tokenizer: bytes = field(repr=False)
    """tokenizer.json bytes, parsed once per worker process."""
    eos_id: int
    dtype: str
    text_column: str = TEXT_COLUMN
    batch_bytes: int = 1 * MiB
    threads: int = 1

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        _set_threads(self.threads)
        tokenizer = _worker_tokenizer(self.tokenizer)
        column = batch.column(self.text_column)
        if column.null_count:
            raise UsageError(f"{column.null_count} documents have no {self.text_column!r} (null)")
        sizes = pc.binary_length(column.cast(pa.large_string())).to_numpy(zero_copy_only=False)
        dtype = np.dtype(self.dtype)
        pieces = [
            encode_documents(
                tokenizer, column.slice(start, stop - start).to_pylist(), self.eos_id, dtype
            )
            for start, stop in _batches(sizes, self.batch_bytes)
        ]
        ids = np.concatenate([piece[0] for piece in pieces])
        lengths = np.concatenate([piece[1] for piece in pieces])
        return pa.record_batch({TOKENS_COLUMN: _as_binary(ids, lengths)})


def encode_documents(
    tokenizer: Tokenizer, texts: list[str], eos_id: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Encode texts in one encode_batch_fast call (no special tokens added, no offsets):
    (ids [tokens] of `dtype`, each document's ids followed by `eos_id`; lengths [documents],
    EOS included)."""
    ids = [
        encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    ]
    for document in ids:
        document.append(eos_id)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(data: bytes) -> Tokenizer:
    """The parsed tokenizer of this process, kept across tasks (a memo keyed by the tokenizer's
    bytes): parsing takes ~0.1 s for 32k ids, and the BPE model's word cache stays warm. With a
    fresh tokenizer per task, 8 files of the benchmark corpus took 1.27x the CPU of one kept."""
    tokenizer = _parse(data, TOKENIZER_FILE)
    tokenizer.encode_special_tokens = True  # "<|endoftext|>" in a text is text, not EOS
    return tokenizer


def run_tokenize(
    input: str | Sequence[str],
    output: str,
    config: TokenizeConfig = TokenizeConfig(),
    options: RunOptions | None = None,
) -> StageReport:
    """Tokenize a document set into a token cache at `output`: shard-NNNNN.bin, tokenizer.json,
    manifest.json, stage.json and _SUCCESS, committed together. An input without documents is a
    UsageError (nothing to train on, no window to read), and leaves nothing behind."""
    with stage_output(output, input) as staging:
        return _tokenize_into(staging, input, config, options or RunOptions())


def _tokenize_into(
    staging: str, input: str | Sequence[str], config: TokenizeConfig, options: RunOptions
) -> StageReport:
    """run_tokenize's work: every file of the token cache written into `staging`."""
    docs = _read(input, config.text_column)
    if not _has_documents(docs):
        raise UsageError(f"no documents in {input}: nothing to tokenize")
    report = StageReport("tokenize")
    if config.tokenizer_path is not None:
        data = load_tokenizer(config.tokenizer_path)
        report.details["tokenizer"] = {"loaded": config.tokenizer_path}
    else:
        texts = _TrainingTexts(docs, config.text_column, config.train_bytes)
        special = (config.eos_token, *config.special_tokens)
        trained = train_tokenizer(iter(texts), config.vocab_size, special, config.min_frequency)
        data = tokenizer_json(trained)
        report.details["tokenizer"] = {
            "trained_on_bytes": texts.bytes,
            "documents": texts.count,
            "requested_vocab_size": config.vocab_size,
        }
    tokenizer = _parse(data, config.tokenizer_path or TOKENIZER_FILE)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = tokenizer.token_to_id(config.eos_token)
    if eos_id is None:
        raise UsageError(
            f"the tokenizer has no token {config.eos_token!r}: set eos_token to its end of text"
        )
    dtype = dtype_for_vocab(vocab_size)
    threads = config.threads_per_worker or _default_threads(docs, options)
    encoder = Encoder(data, eos_id, dtype.str, config.text_column, config.batch_bytes, threads)
    if options.settings.chunk_rows > config.chunk_documents:
        settings = replace(options.settings, chunk_rows=config.chunk_documents)
        options = replace(options, settings=settings)
    result = docs.map_batches(encoder).write_parquet(staging, options=options, commit=False)

    writer = ShardWriter(staging, dtype, eos_id, config.shard_bytes)
    for part in result.files:
        for tokens, ends in _part_documents(part, dtype):
            writer.append(tokens, ends)
    shards = tuple(writer.close())
    with paths.open_file(paths.join(staging, TOKENIZER_FILE), "wb") as handle:
        handle.write(data)
    for name in result.files:
        paths.remove_file(name)
    manifest = Manifest(
        tokenizer_sha256=hashlib.sha256(data).hexdigest(),
        vocab_size=vocab_size,
        dtype=dtype.name,
        eos_id=eos_id,
        eos_token=config.eos_token,
        total_tokens=sum(shard.tokens for shard in shards),
        documents=sum(shard.documents for shard in shards),
        shards=shards,
        details={"tokenizer": report.details["tokenizer"]},
    )
    write_manifest(staging, manifest)
    report.documents_in = report.documents_out = result.rows
    report.details.update(
        tokens=manifest.total_tokens,
        shards=len(shards),
        vocab_size=vocab_size,
        dtype=dtype.name,
        tokenizer_sha256=manifest.tokenizer_sha256,
    )
    report.write(staging)
    logger.info("tokenized %d documents into %d tokens", result.rows, manifest.total_tokens)
    return report


class _TrainingTexts:
    """The input's texts in order, in batches, up to `limit` UTF-8 bytes (the document that
    crosses it included); counts what it yielded."""

    def __init__(self, docs: Dataset, column: str, limit: int) -> None:
        self.docs, self.column, self.limit = docs, column, limit
        self.bytes = 0
        self.count = 0

    def __iter__(self) -> Iterator[list[str]]:
        source = self.docs.source
        for shard in range(source.num_shards):
            for read in source.read(shard, TRAIN_BATCH_DOCUMENTS, SkipLog({}, [])):
                batch = run_narrow(self.docs.ops, read)  # JSONL and text files: to documents
                if batch is None:
                    continue
                texts = batch.column(self.column).drop_null()
                sizes = pc.binary_length(texts.cast(pa.large_string())).to_numpy()
                cumulative = np.cumsum(sizes) + self.bytes
                keep = int(np.searchsorted(cumulative, self.limit, side="left")) + 1
                texts, sizes = texts.slice(0, keep), sizes[:keep]
                self.bytes += int(sizes.sum())
                self.count += len(texts)
                yield texts.to_pylist()
                if self.bytes >= self.limit:
                    return


def _read(input: str | Sequence[str], column: str) -> Dataset:
    """The input's `column` (keel.data.inputs: a document set, Parquet, JSONL or text files)."""
    return read_documents(
        input, columns=[column], fields={column: pa.string()}, require_text=column == TEXT_COLUMN
    )


def _has_documents(docs: Dataset) -> bool:
    """Whether the input holds a document: Parquet footers, read until one file has a row (JSONL
    input counts as non-empty here; keel/flow rejects an empty JSONL file when it reads it)."""
    if getattr(docs.source, "format", None) != "parquet":
        return True
    for path in docs.source.files:
        with paths.open_file(path, "rb") as handle:
            if pq.ParquetFile(handle).metadata.num_rows:
                return True
    return False


def _default_threads(docs: Dataset, options: RunOptions) -> int:
    """Cores // the workers that encode at once (at most one per input file), at least 1."""
    cores = os.cpu_count() or 1
    workers = options.workers or getattr(options.backend, "workers", None) or cores
    return max(1, cores // max(1, min(workers, docs.source.num_shards)))


def _set_threads(threads: int) -> None:
    """Set the encoding threads of this (worker) process. One thread: parallelism off, read on
    every encode call. More: the size of the Rayon pool, fixed when a process first encodes."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    os.environ["RAYON_NUM_THREADS"] = str(threads)


def _batches(sizes: np.ndarray, batch_bytes: int) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of documents of about `batch_bytes` (each at least one document)."""
    start, total = 0, 0
    for index, size in enumerate(sizes.tolist()):
        total += size
        if total >= batch_bytes:
            yield start, index + 1
            start, total = index + 1, 0
    if start < len(sizes):
        yield start, len(sizes)


def _as_binary(ids: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """Documents' ids [tokens] cut by `lengths` [documents] into large_binary values (zero copy)."""
    offsets = np.concatenate([[0], np.cumsum(lengths * ids.dtype.itemsize)])
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(ids)]
    return pa.Array.from_buffers(pa.large_binary(), len(lengths), buffers)


def _part_documents(path: str, dtype: np.dtype) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A tokens part, one row group at a time: (ids [n], document ends [documents])."""
    with paths.open_file(path, "rb") as handle:
        parquet = pq.ParquetFile(handle)
        for group in range(parquet.num_row_groups):
            column = parquet.read_row_group(group, columns=[TOKENS_COLUMN]).column(0)
            array = column.combine_chunks()
            _, offsets_buffer, data_buffer = array.buffers()
            offsets = np.frombuffer(offsets_buffer, np.int64)[
                array.offset : array.offset + len(array) + 1
            ]
            data = np.frombuffer(data_buffer, np.uint8)[offsets[0] : offsets[-1]]
            yield data.view(dtype), (offsets[1:] - offsets[0]) // dtype.itemsize


def _parse(data: bytes, where: str) -> Tokenizer:
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as error:  # tokenizers raises a bare Exception for malformed JSON
        raise UsageError(
            f"{where} is not a tokenizer.json that `tokenizers` reads: {error}"
        ) from error
