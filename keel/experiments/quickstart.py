"""The quickstart: a small, real DAG over the bundled sample of Wikipedia articles.

    documents ──> word_counts ────┐
              └─> document_stats ─┴─> summary

`documents` reads the bundled sample (40 WikiText-2 articles, see NOTICE) into Parquet;
`word_counts` counts words with keel/flow (flat_map -> group_by with a map-side combiner ->
sort, on worker processes); `document_stats` is independent of it, so the two run side by side;
`summary` joins them into summary.json. Run it with `keel quickstart` or
`keel run keel/experiments/quickstart.py`; change a threshold with e.g.
`--set word_counts.min_length=4` and only that branch re-runs.
"""

from __future__ import annotations

import gzip
import itertools
import json
import re
from dataclasses import dataclass
from importlib import resources

import pyarrow as pa
import pyarrow.parquet as pq

from keel import flow
from keel.core import paths
from keel.steps import Step, output_of

WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")
"""A word: letters, with one inner apostrophe allowed (don't, Teddy's)."""


@dataclass(frozen=True)
class SampleConfig:
    sample: str = "wikitext2"
    """Name of a bundled sample: keel/experiments/sample/{sample}.jsonl.gz."""
    max_documents: int = 40


@dataclass(frozen=True)
class WordCountConfig:
    documents: str
    min_length: int = 3
    """Words shorter than this many characters are not counted."""
    lowercase: bool = True
    ignore: tuple[str, ...] = ("<unk>",)
    """Markers removed before counting (WikiText writes rare words as <unk>)."""
    workers: int = 2
    """keel/flow worker processes."""


@dataclass(frozen=True)
class DocumentStatsConfig:
    documents: str


@dataclass(frozen=True)
class SummaryConfig:
    word_counts: str
    document_stats: str
    top_words: int = 20


def read_sample(config: SampleConfig, output: str) -> None:
    """Bundled JSONL.gz -> documents.parquet with columns title, text, source."""
    bundled = resources.files("keel.experiments") / "sample" / f"{config.sample}.jsonl.gz"
    with resources.as_file(bundled) as path, gzip.open(path, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in itertools.islice(lines, config.max_documents)]
    table = pa.Table.from_pylist(rows, schema=_DOCUMENT_SCHEMA)
    _write(table, output, "documents.parquet")


def count_words(config: WordCountConfig, output: str) -> None:
    """documents -> word_counts/ (word, count), most frequent first, ties by word."""
    counts = (
        flow.read_parquet(paths.join(config.documents, "documents.parquet"), columns=["text"])
        .flat_map(lambda document: ({"word": word} for word in _words(document["text"], config)))
        .group_by("word", _add_counts, num_shards=1, combiner=_add_counts)
        .sort(("count", "descending"), ("word", "ascending"))
    )
    counts.write_parquet(paths.join(output, "word_counts"), workers=config.workers)


def _words(text: str, config: WordCountConfig) -> list[str]:
    for marker in config.ignore:
        text = text.replace(marker, " ")
    words = WORD.findall(text.lower() if config.lowercase else text)
    return [word for word in words if len(word) >= config.min_length]


def _add_counts(word: str, rows: list[dict]) -> dict:
    """Reducer and combiner: rows are single words or partial counts of `word`."""
    return {"word": word, "count": sum(row.get("count") or 1 for row in rows)}


def document_stats(config: DocumentStatsConfig, output: str) -> None:
    """documents -> document_stats.parquet: per document its title, characters, words and lines."""
    table = _read(config.documents, "documents.parquet", columns=["title", "text"])
    texts = table.column("text").to_pylist()
    stats = pa.table(
        {
            "title": table.column("title"),
            "characters": [len(text) for text in texts],
            "words": [len(WORD.findall(text)) for text in texts],
            "lines": [text.count("\n") + 1 for text in texts],
        }
    )
    _write(stats, output, "document_stats.parquet")


def summarize(config: SummaryConfig, output: str) -> None:
    """word counts + document stats -> summary.json."""
    counts = _read(config.word_counts, "word_counts").to_pylist()
    stats = _read(config.document_stats, "document_stats.parquet").to_pylist()
    words = sum(row["words"] for row in stats)
    summary = {
        "documents": len(stats),
        "characters": sum(row["characters"] for row in stats),
        "words": words,
        "mean_words_per_document": round(words / max(len(stats), 1), 1),
        "distinct_counted_words": len(counts),
        "top_words": [[row["word"], row["count"]] for row in counts[: config.top_words]],
        "longest_document": max(stats, key=lambda row: row["words"])["title"] if stats else None,
    }
    with paths.open_file(paths.join(output, "summary.json"), "w") as handle:
        handle.write(json.dumps(summary, indent=2) + "\n")


def _write(table: pa.Table, directory: str, name: str) -> None:
    with paths.open_file(paths.join(directory, name), "wb") as handle:
        pq.write_table(table, handle, compression="zstd")


def _read(directory: str, name: str, columns: list[str] | None = None) -> pa.Table:
    """A Parquet file, or a directory of them, under `directory` (any fsspec URL)."""
    fs, path = paths.filesystem(paths.join(directory, name))
    return pq.read_table(path, columns=columns, filesystem=fs)


_DOCUMENT_SCHEMA = pa.schema(
    [("title", pa.string()), ("text", pa.string()), ("source", pa.string())]
)

documents = Step("documents", read_sample, SampleConfig())
word_counts = Step("word_counts", count_words, WordCountConfig(documents=output_of(documents)))
stats = Step("document_stats", document_stats, DocumentStatsConfig(documents=output_of(documents)))
summary = Step(
    "summary",
    summarize,
    SummaryConfig(word_counts=output_of(word_counts), document_stats=output_of(stats)),
)

STEPS = [summary]
