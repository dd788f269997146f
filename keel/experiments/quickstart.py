"""The quickstart: DataKit end to end on the bundled samples (see NOTICE), as keel steps.

    ingest_wikitext ─┬─> quality_examples -> quality_model (a classifier trained here)
    ingest_pydocs ───┤                              │
    ingest_crawl ────┴──────────────────────> quality -> filter -> exact_dedup -> fuzzy_dedup
                 (language, Gopher heuristics, quality_score)                       │
           tokenize (BPE + token cache) <- decontam (vs GSM8K) <────────────────────┘
               └─> train (tiny-moe) -> summary (drop accounting, tokens, loss, bits/byte)

ingest_wikitext reads 40 Wikipedia articles; ingest_pydocs extracts the main text of 30 raw HTML
pages of the Python docs; ingest_crawl extracts 8 pages shaped as a web crawl returns them: mirror
copies of four of the articles, one docs page fetched under two URLs, a page quoting GSM8K
problems and a keyword-spam page, so that the quality filter, exact and fuzzy dedup and
decontamination each remove something (NOTICE says how the samples were made). quality_model is
the quality classifier (keel.data.quality) trained on the two clean sources against junk made
here from the same samples (`quality_examples`: their paragraphs with the words shuffled, and the
navigation lines of the raw docs pages); the filter drops documents it scores below 0.5, which
Gopher's heuristics let through (the spam page). Every data stage runs on keel/flow worker
processes, writes stage.json with its drop accounting, and is cached as a step. `train` trains
the tiny-moe preset (an 8-expert MoE transformer) on the token cache and evaluates bits per byte
on held-out windows. Run it with `keel quickstart`, or `keel run keel/experiments/quickstart.py`;
change a threshold with e.g. `--set fuzzy_dedup.threshold=0.7` and only the steps from there on
re-run.
"""

from __future__ import annotations

import gzip
import html
import json
import random
import re
from dataclasses import dataclass, replace
from importlib import resources

import numpy as np

from keel.core import paths
from keel.data.decontam import DecontamConfig, EvalSet, run_decontam
from keel.data.dedup import ExactDedupConfig, run_exact_dedup
from keel.data.documents import StageReport, write_texts
from keel.data.filter import FilterConfig, run_filter
from keel.data.fuzzy import FuzzyDedupConfig, run_fuzzy_dedup
from keel.data.ingest import IngestConfig, run_ingest
from keel.data.inputs import read_documents
from keel.data.quality import (
    MODEL_FILE,
    QualityConfig,
    QualityTrainConfig,
    run_quality,
    run_train_quality,
)
from keel.data.steps import data_step
from keel.data.token_cache import TokenCache
from keel.data.tokenize import TokenizeConfig, run_tokenize
from keel.steps import Step, output_of
from keel.train.config import DataSource
from keel.train.presets import preset
from keel.train.steps import train_step
from keel.train.trainer import RESULT_FILE

SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class BundledIngest:
    sample: str
    """A file of keel/experiments/sample/ (named, not located: the path is not in the hash)."""
    ingest: IngestConfig


@dataclass(frozen=True)
class BundledDecontam:
    input: str
    eval_sample: str
    eval_fields: tuple[str, ...]
    ngram: int = 13
    min_matches: int = 1


@dataclass(frozen=True)
class QualityExamples:
    """Positive and negative examples for the quality classifier, from the bundled samples."""

    positive: tuple[str, ...]
    """Document sets of clean text (the ingested articles and docs pages)."""
    shuffled_from: str
    """A bundled sample (JSONL with "text") whose paragraphs, words shuffled, are negatives."""
    navigation_from: str
    """A bundled sample (JSONL with raw "html") whose navigation lines are negatives."""
    min_paragraph_words: int = 50
    seed: int = 0


def quality_examples(config: QualityExamples, output: str) -> None:
    """`output`/positive and `output`/negative: document sets the classifier trains on."""
    positive = [
        text
        for source in config.positive
        for text in read_documents(source, columns=["text"]).to_table().column("text").to_pylist()
    ]
    rng = random.Random(config.seed)
    negative = []
    for text in _bundled_rows(config.shuffled_from, "text"):
        for paragraph in text.split("\n"):
            words = paragraph.split()
            if len(words) >= config.min_paragraph_words and not paragraph.startswith("="):
                rng.shuffle(words)
                negative.append(" ".join(words))
    negative += [_navigation(page) for page in _bundled_rows(config.navigation_from, "html")]
    write_texts(paths.join(output, "positive"), positive, source="positive")
    write_texts(paths.join(output, "negative"), negative, source="negative")


def _bundled_rows(sample: str, field: str) -> list[str]:
    with resources.as_file(_bundled(sample)) as path, gzip.open(path, "rt") as lines:
        return [json.loads(line)[field] for line in lines]


def _navigation(page: str) -> str:
    """The short lines (6 words or fewer) of an HTML page with its tags stripped: menus,
    breadcrumbs, tables of contents, footers."""
    page = re.sub(r"(?s)<(script|style)\b.*?</\1>", "", page)
    lines = (
        " ".join(line.split()) for line in html.unescape(re.sub(r"<[^>]+>", "\n", page)).split("\n")
    )
    return "\n".join(line for line in lines if line and len(line.split()) <= 6)


@dataclass(frozen=True)
class SummaryConfig:
    stages: tuple[str, ...]
    """Outputs of the data stages, in pipeline order."""
    cache: str
    train: str
    """The train step's output (result.json)."""


def ingest_bundled(config: BundledIngest, output: str) -> None:
    with resources.as_file(_bundled(config.sample)) as path:
        run_ingest(str(path), output, config.ingest)


def decontam_bundled(config: BundledDecontam, output: str) -> None:
    with resources.as_file(_bundled(config.eval_sample)) as path:
        eval_set = EvalSet(str(path), config.eval_fields, name=config.eval_sample.split(".")[0])
        decontam = DecontamConfig((eval_set,), config.ngram, config.min_matches)
        run_decontam(config.input, output, decontam)


def summarize(config: SummaryConfig, output: str) -> None:
    """Each stage's documents in/out and drops by reason, and the token cache's totals."""
    reports = [StageReport.read(stage) for stage in config.stages]
    cache = TokenCache(config.cache)
    summary = {
        "stages": [
            {
                "step": paths.local_path(stage).name if paths.is_local(stage) else stage,
                "stage": report.stage,
                "documents_in": report.documents_in,
                "documents_out": report.documents_out,
                "dropped": report.dropped,
            }
            for stage, report in zip(config.stages, reports, strict=True)
        ],
        "tokens": cache.manifest.total_tokens,
        "documents": cache.manifest.documents,
        "vocab_size": cache.manifest.vocab_size,
        "cache": config.cache,
        "unigram_entropy": unigram_entropy(cache),
        "train": {"output": config.train, **_train_result(config.train)},
    }
    paths.write_text(paths.join(output, SUMMARY_FILE), json.dumps(summary, indent=2) + "\n")


def unigram_entropy(cache: TokenCache) -> float:
    """Entropy (nats per token) of the cache's token frequencies: the loss of a model that
    ignores context, the bar a language model has to get well below."""
    counts = np.zeros(cache.manifest.vocab_size, np.int64)
    for shard in cache.tokens:
        counts += np.bincount(shard, minlength=len(counts))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _train_result(run_dir: str) -> dict:
    result = json.loads(paths.read_text(paths.join(run_dir, RESULT_FILE)))
    keys = ("step", "loss", "eval_loss", "eval_bpb", "tokens_per_s", "mfu")
    return {key: result[key] for key in keys if key in result}


def _bundled(name: str):
    return resources.files("keel.experiments") / "sample" / name


wikitext = Step(
    "ingest_wikitext",
    ingest_bundled,
    BundledIngest("wikitext2.jsonl.gz", IngestConfig(format="jsonl", source="wikitext2")),
)
pydocs = Step(
    "ingest_pydocs",
    ingest_bundled,
    BundledIngest(
        "pydocs.jsonl.gz", IngestConfig(format="jsonl", html_field="html", source="pydocs")
    ),
)
crawl = Step(
    "ingest_crawl",
    ingest_bundled,
    BundledIngest(
        "crawl.jsonl.gz", IngestConfig(format="jsonl", html_field="html", source="crawl")
    ),
)
examples = Step(
    "quality_examples",
    quality_examples,
    QualityExamples(
        (output_of(wikitext), output_of(pydocs)), "wikitext2.jsonl.gz", "pydocs.jsonl.gz"
    ),
)
quality_model = data_step(
    "quality_model",
    run_train_quality,
    (output_of(examples, "positive"), output_of(examples, "negative")),
    QualityTrainConfig(n_features=2**18),
)
quality = data_step(
    "quality",
    run_quality,
    (output_of(wikitext), output_of(pydocs), output_of(crawl)),
    QualityConfig(model_path=output_of(quality_model, MODEL_FILE)),
)
kept = data_step("filter", run_filter, output_of(quality), FilterConfig(min_quality_score=0.5))
exact = data_step("exact_dedup", run_exact_dedup, output_of(kept), ExactDedupConfig())
fuzzy = data_step("fuzzy_dedup", run_fuzzy_dedup, output_of(exact), FuzzyDedupConfig())
clean = Step(
    "decontam",
    decontam_bundled,
    BundledDecontam(output_of(fuzzy), "gsm8k.jsonl.gz", ("question", "answer")),
)
tokens = data_step("tokenize", run_tokenize, output_of(clean), TokenizeConfig(vocab_size=4096))
trained = train_step("train", replace(preset("tiny-moe"), data=(DataSource(output_of(tokens)),)))
summary = Step(
    "summary",
    summarize,
    SummaryConfig(
        stages=tuple(
            output_of(step)
            for step in (wikitext, pydocs, crawl, quality, kept, exact, fuzzy, clean, tokens)
        ),
        cache=output_of(tokens),
        train=output_of(trained),
    ),
)

STEPS = [summary]
