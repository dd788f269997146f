"""Your own text -> the token caches a run reads: `keel train --data PATH --eval-data PATH`.

PATH is a token cache (a directory with manifest.json), used as it is, or documents: a .txt file
(one document, its text as written), .jsonl files (one document per line, its `text` key),
.parquet files (the `text` column), or a directory holding any of them (searched recursively;
other files are ignored). Documents are tokenized as a cached keel step, `tokenize_text`, under
the run's prefix: its identity is the input's content (SHA-256 of the file's bytes; of a
directory's sorted relative names and bytes), the tokenizer settings and the tokenizer's content,
never the path, so the same text copied elsewhere finds its cache, and a second run tokenizes
nothing.

The training text gets a byte-level BPE trained on it (vocabulary: the model's) or a given
tokenizer.json; evaluation text is always encoded with the training cache's tokenizer, so its
bits per byte compare with the training loss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from keel.core import paths
from keel.core.errors import UsageError
from keel.data.documents import TEXT_COLUMN
from keel.data.token_cache import MANIFEST_FILE, TokenCache
from keel.data.tokenize import TokenizeConfig, load_tokenizer, run_tokenize
from keel.steps import Step, output_path, run
from keel.train.config import DataSource, TrainConfig

logger = logging.getLogger(__name__)

STEP_NAME = "tokenize_text"
STEP_VERSION = "1"
DOCUMENT_SUFFIXES = (".txt", ".jsonl", ".parquet")
READ_BLOCK = 1 << 20
"""Bytes read at a time when hashing."""
JSONL_BATCH = 4_096
"""Documents per Parquet row group when a .jsonl file is rewritten for the tokenizer."""


@dataclass(frozen=True)
class TextTokenize:
    """The `tokenize_text` step's config: what identifies a cache of documents, and (outside the
    identity) where the documents and the tokenizer are read from this time."""

    content_sha256: str
    """SHA-256 of the documents' content (see content_sha256())."""
    tokenize: TokenizeConfig
    """Tokenizer settings (its tokenizer_path stays None: the tokenizer counts by content)."""
    tokenizer_sha256: str = ""
    """SHA-256 of the tokenizer.json to encode with; empty: train a BPE on the documents."""
    source: str = field(default="", metadata={"identity": False})
    """The documents' path (a file or directory)."""
    tokenizer: str = field(default="", metadata={"identity": False})
    """The tokenizer.json's path, when tokenizer_sha256 is set."""


@dataclass(frozen=True)
class ResolvedData:
    """A --data or --eval-data path and the token cache it stands for."""

    path: str
    cache: str
    outcome: str
    """"cache" (the path is a token cache), "tokenized" or "cached" (the step's outcome)."""


def is_token_cache(path: str) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST_FILE).is_file()


def document_files(path: str, flag: str = "--data") -> list[Path]:
    """The document files `path` names, sorted: the file itself, or a directory's files with a
    document suffix (recursively, hidden ones skipped). UsageError when there are none, or all
    are empty."""
    where = Path(path)
    if not where.exists():
        raise UsageError(f"{flag} {path} does not exist: name a text file, a directory or a cache")
    if where.is_file():
        if not where.name.endswith(DOCUMENT_SUFFIXES):
            raise UsageError(
                f"{flag} {path} is not a document file: use .txt (one document), .jsonl or "
                ".parquet (a `text` field), a directory of them, or a token cache"
            )
        files = [where]
    else:
        files = sorted(
            file
            for file in where.rglob("*")
            if file.is_file()
            and file.name.endswith(DOCUMENT_SUFFIXES)
            and not any(part.startswith(".") for part in file.relative_to(where).parts)
        )
        if not files:
            raise UsageError(
                f"{flag} {path} holds no documents (.txt, .jsonl or .parquet files) and is not a "
                "token cache (no manifest.json)"
            )
    if all(file.stat().st_size == 0 for file in files):
        raise UsageError(f"{flag} {path} is empty: there is no text to train or evaluate on")
    return files


def content_sha256(path: str, files: Sequence[Path]) -> str:
    """SHA-256 of the content: a file's bytes; for a directory each file's relative name (POSIX
    form) and bytes, in sorted order, each length-prefixed so that no two inputs collide."""
    root = Path(path)
    digest = hashlib.sha256()
    for file in files:
        if root.is_dir():
            name = file.relative_to(root).as_posix().encode()
            digest.update(len(name).to_bytes(8, "little") + name)
            digest.update(file.stat().st_size.to_bytes(8, "little"))
        with file.open("rb") as handle:
            while block := handle.read(READ_BLOCK):
                digest.update(block)
    return digest.hexdigest()


def tokenize_text(config: TextTokenize, output: str) -> None:
    """The step: the documents at config.source as Parquet in a scratch directory (a .txt file
    one row, a .jsonl file its `text` values), then run_tokenize into `output`."""
    files = document_files(config.source)
    if content_sha256(config.source, files) != config.content_sha256:
        raise UsageError(f"{config.source} changed while it was being tokenized; run again")
    tokenize = replace(config.tokenize, tokenizer_path=config.tokenizer or None)
    with tempfile.TemporaryDirectory(prefix="keel-text-") as scratch:
        inputs = [_as_parquet(file, Path(scratch), index) for index, file in enumerate(files)]
        run_tokenize(inputs, output, tokenize)


def _as_parquet(file: Path, scratch: Path, index: int) -> str:
    """A Parquet file of `file`'s documents with a `text` column: .parquet files as they are."""
    if file.suffix == ".parquet":
        return str(file)
    target = scratch / f"part-{index:05d}.parquet"
    schema = pa.schema([(TEXT_COLUMN, pa.large_string())])
    with pq.ParquetWriter(target, schema, compression="zstd") as writer:
        if file.suffix == ".txt":
            text = file.read_bytes().decode("utf-8", errors="strict")
            if text:
                writer.write_table(pa.table({TEXT_COLUMN: [text]}, schema=schema))
            return str(target)
        batch: list[str] = []
        with file.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                batch.append(_jsonl_text(file, number, line))
                if len(batch) >= JSONL_BATCH:
                    writer.write_table(pa.table({TEXT_COLUMN: batch}, schema=schema))
                    batch = []
        if batch:
            writer.write_table(pa.table({TEXT_COLUMN: batch}, schema=schema))
    return str(target)


def _jsonl_text(file: Path, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise UsageError(f"{file}:{number} is not JSON: {error}") from error
    text = record.get(TEXT_COLUMN) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise UsageError(f"{file}:{number} has no {TEXT_COLUMN!r} string")
    return text


def resolve_data(
    path: str, prefix: str, vocab_size: int, tokenizer: str | None = None
) -> ResolvedData:
    """The token cache of the training data at `path`: the path itself when it is a cache,
    else the `tokenize_text` step's output under `prefix` (run now, or found cached), with a
    BPE of `vocab_size` ids trained on the text, or the tokenizer.json at `tokenizer`."""
    if is_token_cache(path):
        if tokenizer is not None:
            raise UsageError(
                f"--data {path} is a token cache, tokenized already: --tokenizer goes with text"
            )
        return ResolvedData(path, paths.normalize(path), "cache")
    files = document_files(path, "--data")
    if tokenizer is not None and not paths.exists(tokenizer):
        raise UsageError(f"--tokenizer {tokenizer} does not exist: name a tokenizer.json")
    config = TextTokenize(
        content_sha256=content_sha256(path, files),
        tokenize=TokenizeConfig(vocab_size=vocab_size),
        tokenizer_sha256=hashlib.sha256(load_tokenizer(tokenizer)).hexdigest() if tokenizer else "",
        source=str(Path(path).resolve()),
        tokenizer=str(Path(tokenizer).resolve()) if tokenizer else "",
    )
    return _run_step(path, prefix, config)


def resolve_eval_data(path: str, prefix: str, train_cache: str) -> ResolvedData:
    """The token cache of evaluation data at `path`, in the training cache's tokenizer: a cache
    of the same tokenizer as it is (another tokenizer: UsageError), documents encoded with the
    training cache's tokenizer.json by the `tokenize_text` step."""
    train = TokenCache(train_cache).manifest
    if is_token_cache(path):
        other = TokenCache(path).manifest
        if other.tokenizer_sha256 != train.tokenizer_sha256:
            raise UsageError(
                f"--eval-data {path} is a token cache of another vocabulary ({other.vocab_size} "
                f"ids, tokenizer {other.tokenizer_sha256[:12]}) than the training data's "
                f"({train.vocab_size} ids, tokenizer {train.tokenizer_sha256[:12]}): pass the "
                "evaluation text itself, which is encoded with the training tokenizer"
            )
        return ResolvedData(path, paths.normalize(path), "cache")
    files = document_files(path, "--eval-data")
    config = TextTokenize(
        content_sha256=content_sha256(path, files),
        tokenize=TokenizeConfig(vocab_size=train.vocab_size, eos_token=train.eos_token),
        tokenizer_sha256=train.tokenizer_sha256,
        source=str(Path(path).resolve()),
        tokenizer=TokenCache(train_cache).tokenizer_path(),
    )
    return _run_step(path, prefix, config)


def eval_name(path: str) -> str:
    """The name an --eval-data set reports under (`eval/<name>/bpb`): the file's stem."""
    return Path(path.rstrip("/")).stem


def eval_names(eval_paths: Sequence[str]) -> tuple[str, ...]:
    """Each --eval-data path's name; UsageError when two share one (their metrics would clash)."""
    names = tuple(eval_name(path) for path in eval_paths)
    for index, name in enumerate(names):
        if name in names[:index]:
            first = eval_paths[names.index(name)]
            raise UsageError(
                f"--eval-data {first} and {eval_paths[index]} have one stem, {name!r}: both "
                f"would report as eval/{name}/bpb; rename one"
            )
    return names


def _run_step(path: str, prefix: str, config: TextTokenize) -> ResolvedData:
    step = Step(STEP_NAME, tokenize_text, config, STEP_VERSION)
    report = run([step], prefix)
    if not report.ok:
        error = next(iter(report.errors.values()), "failed")
        raise UsageError(f"tokenizing {path} failed: {error}")
    outcome = "cached" if report.cached else "tokenized"
    cache = output_path(paths.normalize(prefix), step)
    logger.info("%s: %s into %s", path, outcome, cache)
    return ResolvedData(path, cache, outcome)


def with_training_data(
    config: TrainConfig, path: str, prefix: str, tokenizer: str | None = None
) -> tuple[TrainConfig, ResolvedData]:
    """`config` training on `path` (see resolve_data) in place of the data it names."""
    named = [phase.name for phase in config.phases if phase.mixture]
    if named:
        raise UsageError(
            f"--data replaces the config's data, but phase {named[0]!r} names its own mixture: "
            "drop --data, or the phases' mixtures"
        )
    resolved = resolve_data(path, prefix, config.model.vocab_size, tokenizer)
    source = DataSource(resolved.cache, name=f"{eval_name(path)}-heldout")
    return replace(config, data=(source,)), resolved


def with_eval_data(
    config: TrainConfig, eval_paths: Sequence[str], prefix: str
) -> tuple[TrainConfig, list[ResolvedData]]:
    """`config` evaluating the sets at `eval_paths` (see resolve_eval_data), named by their
    stems, in place of its eval_data; its data must be caches already."""
    names = eval_names(eval_paths)
    sources = config.data or next(phase.mixture for phase in config.phases if phase.mixture)
    resolved = [resolve_eval_data(path, prefix, sources[0].cache) for path in eval_paths]
    caches = tuple(item.cache for item in resolved)
    return replace(config, eval_data=caches, eval_names=names), resolved
