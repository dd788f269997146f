"""Your own text -> the token caches a run reads: `keel train --data PATH --eval-data PATH`.

PATH is a token cache (a directory with manifest.json), used as it is, or documents: any file
DataKit's stages read (keel.data.inputs: text files .txt/.text, one document each; JSON Lines
.jsonl/.json/.ndjson, a `text` field per record; Parquet, a `text` column; plain, .gz or .zst),
or a directory holding any of them (searched recursively; other files are ignored; a DataKit
output's part files only). Documents are read as the stages read them and tokenized by
keel.data.tokenize (files of several formats are first gathered into one Parquet set per run of
one format) as a cached keel step, `tokenize_text`, under the run's prefix: its identity is the
input's content (SHA-256 of the file's bytes; of a directory's sorted relative names and bytes),
the tokenizer settings and the tokenizer's content, never the path, so the same text copied
elsewhere finds its cache, and a second run tokenizes nothing.

The training text gets a byte-level BPE trained on it (vocabulary: the model's) or a given
tokenizer.json; evaluation text is always encoded with the training cache's tokenizer, so its
bits per byte compare with the training loss.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from keel.core import paths
from keel.core.errors import UsageError
from keel.data.documents import TEXT_COLUMN
from keel.data.inputs import file_format, read_documents
from keel.data.token_cache import MANIFEST_FILE, TokenCache
from keel.data.tokenize import TokenizeConfig, load_tokenizer, run_tokenize
from keel.flow.sources import uncompressed_name
from keel.steps import Step, output_path, run
from keel.train.config import DataSource, TrainConfig

logger = logging.getLogger(__name__)

STEP_NAME = "tokenize_text"
STEP_VERSION = "2"
"""2: documents read by keel.data.inputs (compressed JSONL and text, .ndjson, .text) instead of
a reader of this module's own."""
READ_BLOCK = 1 << 20
"""Bytes read at a time when hashing."""
DOCUMENT_KINDS = (
    "use text (.txt, .text: one document per file), JSON Lines (.jsonl, .json, .ndjson: a `text` "
    "field per record) or Parquet (a `text` column), plain, .gz or .zst"
)


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
    """The document files `path` names, sorted: the file itself, a document set's parts (a
    directory with part-*.parquet files), or a directory's files with a document suffix
    (recursively; hidden ones skipped, and .json files: in a directory they are more often a
    config or a tokenizer than JSON Lines). UsageError when there are none, or all
    are empty."""
    where = Path(path)
    if not where.exists():
        raise UsageError(f"{flag} {path} does not exist: name a text file, a directory or a cache")
    if where.is_file():
        if file_format(where.name) is None:
            raise UsageError(
                f"{flag} {path} is not a document file: {DOCUMENT_KINDS}; a directory of them, or "
                "a token cache"
            )
        files = [where]
    elif parts := sorted(where.glob("part-*.parquet")):
        files = parts  # a document set (a DataKit output): its side tables are not documents
    else:
        files = sorted(
            file
            for file in where.rglob("*")
            if file.is_file()
            and file_format(file.name) is not None
            and not uncompressed_name(file.name).endswith(".json")  # config.json, tokenizer.json
            and not any(part.startswith(".") for part in file.relative_to(where).parts)
        )
        if not files:
            raise UsageError(
                f"{flag} {path} holds no documents ({DOCUMENT_KINDS}) and is not a token cache "
                "(no manifest.json)"
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
    """The step: run_tokenize over the documents at config.source into `output`; files of
    several formats are first written as one Parquet document set per run of one format
    (format_runs), in a scratch directory."""
    files = document_files(config.source)
    if content_sha256(config.source, files) != config.content_sha256:
        raise UsageError(f"{config.source} changed while it was being tokenized; run again")
    tokenize = replace(config.tokenize, tokenizer_path=config.tokenizer or None)
    runs = format_runs(files)
    if len(runs) == 1:
        run_tokenize(runs[0], output, tokenize)
        return
    with tempfile.TemporaryDirectory(prefix="keel-text-") as scratch:
        sets = [paths.join(scratch, f"run-{index:05d}") for index in range(len(runs))]
        for run_files, target in zip(runs, sets, strict=True):
            read_documents(run_files, columns=[TEXT_COLUMN]).write_parquet(target)
        run_tokenize(sets, output, tokenize)


def format_runs(files: Sequence[Path]) -> list[list[str]]:
    """The files cut into runs of one format (keel.data.inputs reads one format at a time), in
    their order: [[a.jsonl, b.jsonl], [c.txt], [d.jsonl]]."""
    runs = itertools.groupby(files, key=lambda file: file_format(file.name))
    return [[str(file) for file in run] for _, run in runs]


def document_texts(path: str, flag: str, limit: int | None = None) -> list[str]:
    """The texts of the documents at `path` (document_files), in order, read as DataKit's stages
    read them (keel.data.inputs); the first `limit`."""
    texts: list[str] = []
    for run_files in format_runs(document_files(path, flag)):
        table = read_documents(run_files, columns=[TEXT_COLUMN]).to_table()
        texts += [text or "" for text in table.column(TEXT_COLUMN).to_pylist()]
        if limit is not None and len(texts) >= limit:
            break
    return texts[:limit] if limit is not None else texts


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
    """The name an --eval-data set reports under (`eval/<name>/bpb`): the file's stem, without
    a compression suffix (`val.jsonl.gz` -> `val`)."""
    name = Path(path.rstrip("/")).name
    plain = uncompressed_name(name)
    return Path(name[: len(plain)]).stem


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
