"""Fuzzy dedup on a labelled near-duplicate set: keel against datatrove's MinHash.

What it measures: both contenders read the same 2 zstd Parquet files (a few thousand documents cut
from the WikiText-2 valid and test articles, or --documents N of them from WikiText-2, the Python
docs pages and spliced originals, with planted near-duplicates and hard negatives),
find near-duplicates with the same parameters (word 5-grams, 112 signature entries, 14 bands of
8 rows, seed 1; datatrove computes 112 permutations, keel one-permutation MinHash) on 2 worker
processes, and write the kept documents. Reported per contender, medians
over --repeats runs: seconds, documents per second, and the precision, recall and F1 of its
removals against the ground truth.

The labelled set (build_labelled_set; tests/data/test_dedup.py uses it on the bundled 40-article
slice):
- originals: each article cut into documents of 150-350 words along its paragraphs; with
  --documents N, the articles are WikiText-2 valid + test (~1,800 documents) and the 530 Python
  docs pages of ../shared/datasets/pydocs (text by keel.data.extract.extract_text), and when
  those give too few, further originals are spliced from sentences drawn (seeded) from random
  articles, each word substituted at SPLICE_SUBSTITUTION so that sentences drawn many times do
  not make spliced originals share their 5-grams; the first N documents after shuffling are kept;
- near copies of an original (about 45% of them get one, some two): word substitutions,
  deletions, insertions or a mix at 0.2-2.5% of words, paragraph shuffles with light edits,
  truncations of the last 2-12% of words, and copies that differ only in case and punctuation;
- hard negatives: copies with heavy edits (5-20% of words), excerpts of 40-75% of a document,
  and splices of two halves of documents of the same article (shared topic words);
- all shuffled (seeded). Ground truth, computed from the texts, not from the labels: in input
  order, a document is a duplicate when the exact Jaccard similarity of its word 5-gram set (same
  normalization as keel: lowercase, punctuation and symbols to spaces) and that of an earlier
  kept document is >= 0.8. So planted edits near 2.3% of words land on either side of 0.8.
  Exact but not O(N^2) (similar_pairs): every pair with Jaccard >= 0.8 is found by prefix
  filtering on an inverted index of hashed shingles and verified by its exact Jaccard; 300,000
  documents take minutes.

Two scores, as the contenders keep different members of a cluster:
- ordered P/R/F1: removed ids against the ground truth's ids (keel keeps the first in input order,
  as the ground truth does; datatrove keeps the root of its union-by-size, often a later copy);
- order-free P/R/F1: a removal is right when the contender kept a document with true Jaccard >=
  0.8 to it; recall is 1 - (duplicates the ground-truth rule still finds in the kept output) /
  (ground-truth duplicates).

How: datatrove runs its 4-stage local pipeline (signatures with 2 tasks, buckets with 14 tasks,
clustering, filter with 2 tasks; 2 workers), configured to match: MinhashConfig(n_grams=5,
num_buckets=14, hashes_per_bucket=8, seed=1, 64-bit hashes), normalization without its number
and diacritics folding, and a whitespace word tokenizer (its English default needs spaCy, which
is slower: this favours datatrove). keel runs run_fuzzy_dedup with workers=2 ("keel"), and
again with its 2 workers started before the clock starts ("keel-warm": the difference is keel's
fixed cost of starting worker interpreters). Each run is a fresh subprocess, timed around the
work alone (imports excluded, worker start-up included), contenders interleaved.

    python3 -m venv /work/dtvenv && /work/dtvenv/bin/pip install "datatrove[processing,io]==0.10.1"
    python benchmarks/dedup_bench.py [--repeats 3] [--out DIR] [--documents N] [--phases] \
        [--datatrove-python /work/dtvenv/bin/python] [--contenders keel,datatrove]

--datatrove-python runs the datatrove contender with another environment's interpreter (keel's
contenders use this one): datatrove pins xxhash < 4 and pulls in pandas, which keel's environment
should not carry. --keel-python does the same for keel's contenders: each contender then runs in
an environment of its own dependencies, as a user installs it. keel's test environment carries
pandas (datasets and evaluate, for lm-eval), and pyarrow imports pandas wherever it is installed
(pyarrow.dataset at import, pa.array at its first call): ~0.2 s more per worker process at start.

    python3 -m venv /work/kvenv && /work/kvenv/bin/pip install .   # keel's own dependencies

--phases: after the timed runs, one more cold keel run with keel.flow's stage
lines at debug level, stamped with milliseconds since its process started.
    python benchmarks/dedup_bench.py --smoke  # what CI runs: seconds, no shared data

--smoke: the labelled set built from the first SMOKE_ARTICLES of the WikiText-2 articles bundled
with keel (~280 documents; ../shared/datasets is not read), 1 repeat, every contender as above
(datatrove skipped, with one line, when it is not installed), the table printed. Without --out,
the input and the contenders' work directories live in a temporary directory that is removed at
the end.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "datasets" / "wikitext2"
PYDOCS = REPO.parent / "shared" / "datasets" / "pydocs" / "pages.jsonl.gz"
SAMPLE = REPO / "keel" / "experiments" / "sample" / "wikitext2.jsonl.gz"
NGRAM = 5
THRESHOLD = 0.8
WORKERS = 2
FILES = 2
SMOKE_ARTICLES = 15
"""Bundled articles a smoke run uses: ~280 documents, their ground truth built in ~0.2 s."""
CONTENDERS = ("keel", "keel-warm", "datatrove")
DATATROVE_INSTALL = 'pip install "datatrove[processing,io]"'
_TITLE = re.compile(r"^ = ([^=].*) = $")


# -- the labelled set -------------------------------------------------------------------------


@dataclass
class LabelledSet:
    rows: list[dict]
    """Documents in input order: id, text, source (the planted kind: original, near-*, neg-*)."""
    duplicates: set[str]
    """Ground truth: the ids a deduplicator should remove."""
    similar: dict[int, list[int]]
    """Per row number, the row numbers whose true Jaccard to it is >= THRESHOLD (both ways)."""


def articles_from_wikitext(paths: Iterable[Path]) -> list[tuple[str, str]]:
    """(title, text) of each article of raw WikiText files: an article starts at ` = Title = `;
    its lines, blank ones dropped, become paragraphs joined by newlines."""
    articles: list[tuple[str, list[str]]] = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            title = _TITLE.match(line)
            if title:
                articles.append((title.group(1), []))
            elif line.strip() and articles:
                articles[-1][1].append(line.strip())
    return [(title, "\n".join(lines)) for title, lines in articles]


def articles_from_sample(path: Path = SAMPLE) -> list[tuple[str, str]]:
    """(title, text) of the 40 articles bundled with keel."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [(row["title"], row["text"]) for row in map(json.loads, handle)]


def articles_from_pydocs(path: Path = PYDOCS) -> list[tuple[str, str]]:
    """(url, main text) of each Python docs page with text (keel's own HTML extraction)."""
    from keel.data.extract import extract_text

    articles = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for row in map(json.loads, handle):
            text = extract_text(row["html"], row["url"])
            if text:
                articles.append((row["url"], text))
    return articles


def build_labelled_set(
    articles: list[tuple[str, str]],
    seed: int = 0,
    min_words: int = 150,
    max_words: int = 350,
    documents: int | None = None,
    truth: bool = True,
) -> LabelledSet:
    """Originals cut from `articles`, planted near copies and hard negatives, shuffled; see the
    module docstring. With `documents`, exactly that many (the first after shuffling), spliced
    originals added when the articles give too few. Deterministic for a seed. Without `truth`
    the ground truth is left out (no duplicates, no pairs): the set alone, in seconds."""
    from keel.data.documents import document_id

    rng = random.Random(seed)
    originals = [
        (title, doc)
        for title, text in articles
        for doc in _cut(text.split("\n"), rng, min_words, max_words)
    ]
    if documents is not None:
        wanted = math.ceil(documents / DOCUMENTS_PER_ORIGINAL) - len(originals)
        originals += _spliced_originals(articles, wanted, rng, min_words, max_words)
    vocabulary = [word for _, doc in originals for paragraph in doc for word in paragraph]
    planted: list[tuple[str, list[list[str]]]] = [("original", doc) for _, doc in originals]
    by_title: dict[str, list[list[list[str]]]] = {}
    for title, doc in originals:
        by_title.setdefault(title, []).append(doc)
    for title, doc in originals:
        copies = 2 if rng.random() < 0.1 else 1 if rng.random() < 0.4 else 0
        for _ in range(copies):
            planted.append(_near_copy(doc, rng, vocabulary))
        if rng.random() < 0.25:
            planted.append(_hard_negative(doc, by_title[title], rng, vocabulary))
    rng.shuffle(planted)
    rows, seen = [], set()
    for kind, doc in planted:
        text = "\n".join(" ".join(paragraph) for paragraph in doc if paragraph)
        doc_id = document_id(text)
        if doc_id not in seen:
            seen.add(doc_id)
            rows.append({"id": doc_id, "text": text, "source": kind})
    if documents is not None:
        rows = rows[:documents]
    if not truth:
        return LabelledSet(rows, set(), {})
    similar = similar_pairs([row["text"] for row in rows])
    removed = greedy_removals(similar, range(len(rows)))
    return LabelledSet(rows, {rows[i]["id"] for i in removed}, similar)


DOCUMENTS_PER_ORIGINAL = 1.7
"""Documents each original brings, a little under the planted rate (1 + 0.56 near copies + 0.25
hard negatives, before exact copies collapse), so a --documents set always has enough."""
SPLICE_SUBSTITUTION = 0.05
"""Word substitution rate of a spliced original's sentences: a sentence is drawn many times at
300,000 documents, and its copies should not share all their 5-grams."""
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _spliced_originals(
    articles: list[tuple[str, str]],
    count: int,
    rng: random.Random,
    min_words: int,
    max_words: int,
) -> list[tuple[str, list[list[str]]]]:
    """`count` further originals of min_words..max_words words: sentences drawn from random
    articles (one paragraph of sentences from different articles), each lightly substituted,
    titled by the article of their first sentence."""
    if count <= 0:
        return []
    sentences = [
        (title, sentence.split())
        for title, text in articles
        for sentence in _SENTENCE_END.split(text.replace("\n", " "))
        if len(sentence.split()) >= 4
    ]
    vocabulary = [word for _, sentence in sentences for word in sentence]
    spliced = []
    for _ in range(count):
        target, words = rng.randint(min_words, max_words), []
        title = None
        while len(words) < target:
            source, sentence = rng.choice(sentences)
            title = title or source
            words += [
                rng.choice(vocabulary) if rng.random() < SPLICE_SUBSTITUTION else word
                for word in sentence
            ]
        spliced.append((title, [words[:target]]))  # its hard negatives splice that article
    return spliced


def _cut(
    paragraphs: list[str], rng: random.Random, min_words: int, max_words: int
) -> Iterable[list[list[str]]]:
    """Documents of min_words..max_words words (target drawn per document) from paragraphs."""
    doc: list[list[str]] = []
    target = rng.randint(min_words, max_words)
    for paragraph in paragraphs:
        words = paragraph.split()
        while words:
            room = target - sum(map(len, doc))
            doc.append(words[:room])
            words = words[room:]
            if sum(map(len, doc)) >= target:
                yield doc
                doc, target = [], rng.randint(min_words, max_words)
    if sum(map(len, doc)) >= min_words:
        yield doc


def _near_copy(
    doc: list[list[str]], rng: random.Random, vocabulary: list[str]
) -> tuple[str, list[list[str]]]:
    kind = rng.choice(["substitute", "delete", "insert", "mixed", "shuffle", "truncate", "case"])
    if kind == "shuffle":
        shuffled = [list(p) for p in doc]
        rng.shuffle(shuffled)
        return "near-shuffle", _edit(shuffled, rng, vocabulary, rng.uniform(0.0, 0.01), "mixed")
    if kind == "truncate":
        words = [w for p in doc for w in p]
        keep = round(len(words) * (1 - rng.uniform(0.02, 0.12)))
        return "near-truncate", [words[:keep]]
    if kind == "case":
        return "near-case", [
            [w.upper() if rng.random() < 0.5 else w for w in p if w not in {",", "."}] for p in doc
        ]
    return f"near-{kind}", _edit(doc, rng, vocabulary, rng.uniform(0.002, 0.025), kind)


def _hard_negative(
    doc: list[list[str]],
    same_article: list[list[list[str]]],
    rng: random.Random,
    vocabulary: list[str],
) -> tuple[str, list[list[str]]]:
    kind = rng.choice(["heavy", "excerpt", "splice"])
    words = [w for p in doc for w in p]
    if kind == "heavy":
        return "neg-heavy", _edit(doc, rng, vocabulary, rng.uniform(0.05, 0.2), "mixed")
    if kind == "excerpt":
        length = round(len(words) * rng.uniform(0.4, 0.75))
        start = rng.randint(0, len(words) - length)
        return "neg-excerpt", [words[start : start + length]]
    other = [w for p in rng.choice(same_article) for w in p]
    return "neg-splice", [words[: len(words) // 2], other[len(other) // 2 :]]


def _edit(
    doc: list[list[str]], rng: random.Random, vocabulary: list[str], rate: float, kind: str
) -> list[list[str]]:
    """Each word edited with probability `rate`: substituted, deleted or followed by an inserted
    word (kind "mixed": one of the three at random)."""
    edited = []
    for paragraph in doc:
        out: list[str] = []
        for word in paragraph:
            if rng.random() >= rate:
                out.append(word)
                continue
            action = rng.choice(["substitute", "delete", "insert"]) if kind == "mixed" else kind
            if action == "substitute":
                out.append(rng.choice(vocabulary))
            elif action == "insert":
                out.extend([word, rng.choice(vocabulary)])
        edited.append(out)
    return edited


def normalized_words(text: str) -> list[str]:
    """Lowercase, Unicode punctuation and symbols to spaces, split on whitespace (the same
    normalization as keel.data.minhash, written independently)."""
    table = {ord(char): " " for char in set(text) if unicodedata.category(char)[0] in ("P", "S")}
    return text.lower().translate(table).split()


def shingle_set(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = normalized_words(text)
    if 0 < len(words) < n:
        return {tuple(words)}
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def shingle_hashes(text: str) -> np.ndarray:
    """The word 5-gram set of `text` as sorted unique int64 hashes (Python's tuple hash: stable
    within one process, which is where a labelled set is built and scored)."""
    return np.unique(np.fromiter(map(hash, shingle_set(text)), dtype=np.int64))


def similar_pairs(texts: list[str], threshold: float = THRESHOLD) -> dict[int, list[int]]:
    """Every pair of texts whose exact shingle-set Jaccard is >= threshold, not O(N^2): prefix
    filtering on an inverted index. Each set is ordered rarest shingle first (document frequency,
    then hash); two sets with Jaccard >= t share at least ceil(t * |x|) shingles, so their
    prefixes of |x| - ceil(t * |x|) + 1 shingles intersect. Candidates are the pairs sharing a
    prefix shingle; each is verified by its exact Jaccard. Returns, per text number, its partners
    (both directions)."""
    sets = [shingle_hashes(text) for text in texts]
    sizes = np.array([len(one) for one in sets], dtype=np.int64)
    if not sizes.sum():
        return {}
    hashes = np.concatenate(sets)
    owner = np.repeat(np.arange(len(sets)), sizes)
    _, inverse, counts = np.unique(hashes, return_inverse=True, return_counts=True)
    frequency = counts[inverse]
    order = np.lexsort((hashes, frequency, owner))  # per text, rarest first
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rank = np.arange(len(hashes)) - starts[owner[order]]
    prefix = sizes - np.ceil(threshold * sizes - 1e-9).astype(np.int64) + 1
    chosen = order[rank < prefix[owner[order]]]
    token, member = inverse[chosen], owner[chosen]
    by_token = np.argsort(token, kind="stable")
    token, member = token[by_token], member[by_token]
    bounds = np.flatnonzero(np.diff(token)) + 1
    candidates: set[tuple[int, int]] = set()
    for group in np.split(member, bounds):
        if len(group) > 1:
            members = sorted(set(group.tolist()))
            candidates.update((a, b) for i, a in enumerate(members) for b in members[i + 1 :])
    similar: dict[int, list[int]] = {}
    for a, b in candidates:
        shared = len(np.intersect1d(sets[a], sets[b], assume_unique=True))
        if shared / (sizes[a] + sizes[b] - shared) >= threshold:
            similar.setdefault(a, []).append(b)
            similar.setdefault(b, []).append(a)
    return similar


def greedy_removals(similar: dict[int, list[int]], members: Iterable[int]) -> list[int]:
    """The ground-truth rule over `members` (text numbers, in input order): a text is a
    duplicate when an earlier kept member's Jaccard to it is >= the threshold of `similar`."""
    kept: set[int] = set()
    removed = []
    for number in members:
        if any(partner in kept for partner in similar.get(number, ())):
            removed.append(number)
        else:
            kept.add(number)
    return removed


def greedy_duplicates(texts: list[str], threshold: float = THRESHOLD) -> list[int]:
    """The ground-truth rule on `texts`: the numbers of the duplicates, in order."""
    return greedy_removals(similar_pairs(texts, threshold), range(len(texts)))


def scores(removed: set[str], truth: set[str]) -> dict[str, float]:
    """Precision, recall and F1 of `removed` ids against the ground truth's."""
    hits = len(removed & truth)
    precision = hits / len(removed) if removed else 1.0
    recall = hits / len(truth) if truth else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def order_free_scores(labelled: LabelledSet, removed: set[str]) -> dict[str, float]:
    """Scores that do not care which member of a cluster was kept (see the module docstring)."""
    dropped = {n for n, row in enumerate(labelled.rows) if row["id"] in removed}
    kept = [n for n in range(len(labelled.rows)) if n not in dropped]
    justified = sum(
        any(partner not in dropped for partner in labelled.similar.get(n, ())) for n in dropped
    )
    residual = len(greedy_removals(labelled.similar, kept))
    precision = justified / len(removed) if removed else 1.0
    recall = max(0.0, 1 - residual / len(labelled.duplicates)) if labelled.duplicates else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def write_documents(rows: list[dict], directory: Path, files: int = FILES) -> None:
    """The rows as a document set: `files` zstd Parquet parts, contiguous slices in order."""
    directory.mkdir(parents=True, exist_ok=True)
    size = -(-len(rows) // files)
    for part in range(files):
        table = pa.Table.from_pylist(rows[part * size : (part + 1) * size])
        pq.write_table(
            table, directory / f"part-{part:05d}-of-{files:05d}.parquet", compression="zstd"
        )


# -- contenders: each runs in a fresh subprocess ----------------------------------------------

KEEL_MAX_SOURCE_DROP = 1.0
"""keel's per-source guard lifted: this set's sources are its labels (a near-copy source is all
copies by construction), which the guard would refuse to drop."""


def run_keel(source: Path, work: Path) -> tuple[float, set[str]]:
    """keel as a user runs it: the stage starts its 2 worker processes, and that is timed."""
    from keel.data.fuzzy import FuzzyDedupConfig, run_fuzzy_dedup
    from keel.flow import RunOptions

    started = time.perf_counter()
    run_fuzzy_dedup(
        str(source),
        str(work / "out"),
        FuzzyDedupConfig(max_source_drop=KEEL_MAX_SOURCE_DROP),
        RunOptions(workers=WORKERS),
    )
    seconds = time.perf_counter() - started
    removed = pq.read_table(work / "out" / "removed.parquet", columns=["id"])
    return seconds, set(removed.column("id").to_pylist())


def run_keel_warm(source: Path, work: Path) -> tuple[float, set[str]]:
    """keel with its 2 workers started (and their imports done) before the clock starts: the
    fixed cost of starting them is the difference from run_keel."""
    from keel.data.fuzzy import FuzzyDedupConfig, run_fuzzy_dedup
    from keel.flow import LocalBackend, RunOptions, from_items

    with LocalBackend(workers=WORKERS) as pool:
        warm_up = from_items([{"n": n} for n in range(WORKERS)], num_shards=WORKERS)
        warm_up.map(_import_fuzzy).count(backend=pool)
        started = time.perf_counter()
        run_fuzzy_dedup(
            str(source),
            str(work / "out"),
            FuzzyDedupConfig(max_source_drop=KEEL_MAX_SOURCE_DROP),
            RunOptions(backend=pool),
        )
        seconds = time.perf_counter() - started
    removed = pq.read_table(work / "out" / "removed.parquet", columns=["id"])
    return seconds, set(removed.column("id").to_pylist())


def _import_fuzzy(row: dict) -> dict:
    import keel.data.fuzzy  # noqa: F401  (what a worker imports for its first dedup task)

    return row


def run_datatrove(source: Path, work: Path) -> tuple[float, set[str]]:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import ParquetReader
    from datatrove.pipeline.writers import JsonlWriter, ParquetWriter
    from datatrove.utils.hashing import HashConfig
    from datatrove.utils.text import TextNormConfig
    from datatrove.utils.word_tokenizers import WordTokenizer

    class WhitespaceTokenizer(WordTokenizer):
        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> list[str]:
            return [text]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    config = MinhashConfig(
        n_grams=NGRAM,
        num_buckets=14,
        hashes_per_bucket=8,
        seed=1,
        norm_config=TextNormConfig(norm_numbers=False, norm_unicode_diacritics=False),
        hash_config=HashConfig(precision=64),
    )
    logs = str(work / "logs")

    def reader() -> ParquetReader:
        return ParquetReader(str(source), glob_pattern="part-*.parquet")

    started = time.perf_counter()
    signatures = LocalPipelineExecutor(
        [
            reader(),
            _with_str_hashing(
                MinhashDedupSignature(
                    str(work / "sigs"), config=config, language=WhitespaceTokenizer("en")
                )
            ),
        ],
        tasks=FILES,
        workers=WORKERS,
        logging_dir=f"{logs}/1",
    )
    buckets = LocalPipelineExecutor(
        [MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=config)],
        tasks=config.num_buckets,
        workers=WORKERS,
        logging_dir=f"{logs}/2",
        depends=signatures,
    )
    clusters = LocalPipelineExecutor(
        [MinhashDedupCluster(str(work / "buckets"), str(work / "remove"), config=config)],
        tasks=1,
        logging_dir=f"{logs}/3",
        depends=buckets,
    )
    filtered = LocalPipelineExecutor(
        [
            reader(),
            MinhashDedupFilter(
                str(work / "remove"), exclusion_writer=JsonlWriter(str(work / "removed"))
            ),
            ParquetWriter(str(work / "out")),
        ],
        tasks=FILES,
        workers=WORKERS,
        logging_dir=f"{logs}/4",
        depends=clusters,
    )
    filtered.run()
    seconds = time.perf_counter() - started
    removed = set()
    for path in sorted((work / "removed").glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as handle:
            removed.update(json.loads(line)["id"] for line in handle)
    return seconds, removed


def _xxhash64_of_str(text: str) -> int:
    import xxhash

    return xxhash.xxh64_intdigest(text.encode("utf-8"))


def _with_str_hashing(step):
    """datatrove 0.10 pins xxhash<4 and hashes str; xxhash 4 (keel's environment) takes only
    bytes, so encode first, as xxhash 3 did inside. The hash values are the same."""
    step._hash_func = _xxhash64_of_str
    return step


def contender_main(name: str, source: Path, work: Path, debug_log: bool = False) -> None:
    """One timed run, in this (fresh) process: prints {"seconds", "removed"} as JSON."""
    run = {"keel": run_keel, "keel-warm": run_keel_warm, "datatrove": run_datatrove}[name]
    if debug_log:
        logging.basicConfig(format="%(relativeCreated)8.0f ms  %(name)s: %(message)s")
        logging.getLogger("keel").setLevel(logging.DEBUG)
    seconds, removed = run(source, work)
    print(json.dumps({"seconds": seconds, "removed": sorted(removed)}))


def run_once(name: str, source: Path, scratch: Path, python: str = sys.executable) -> dict:
    """One timed run of contender `name` in a fresh `python` process (keel's contenders: this
    interpreter or --keel-python; datatrove: --datatrove-python, its own environment)."""
    work = scratch / f"{name}-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    command = [python, __file__, "--contender", name, "--input", str(source)]
    done = subprocess.run(
        [*command, "--work", str(work)],
        capture_output=True,
        text=True,
        check=False,
        env=_environment(name),
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(work, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _environment(name: str) -> dict[str, str]:
    """A contender's environment variables: keel's import this checkout's keel, whichever
    interpreter runs them (measure.checkout_environment)."""
    from measure import checkout_environment  # beside this script; the parent's side only

    return checkout_environment(os.environ) if name.startswith("keel") else dict(os.environ)


def keel_phases(source: Path, scratch: Path, python: str = sys.executable) -> str:
    """One cold keel run with keel.flow's stage lines at debug level, each stamped with the
    milliseconds since its process started: where keel's time goes, stage by stage."""
    work = scratch / "keel-phases-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    command = [python, __file__, "--contender", "keel", "--input", str(source)]
    done = subprocess.run(
        [*command, "--work", str(work), "--debug-log"],
        capture_output=True,
        text=True,
        check=False,
        env=_environment("keel"),
    )
    if done.returncode != 0:
        raise RuntimeError(f"keel failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(work, ignore_errors=True)
    seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    return f"{done.stderr.strip()}\n(timed run: {seconds:.2f} s)"


def versions(datatrove_python: str | None = None) -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("numpy", "pyarrow", "datatrove"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} (not installed)")
    if datatrove_python:
        asked = "from importlib.metadata import version; print(version('datatrove'))"
        done = subprocess.run([datatrove_python, "-c", asked], capture_output=True, text=True)
        found[-1] = f"datatrove {done.stdout.strip()} ({datatrove_python})"
    return f"Python {sys.version.split()[0]}, {os.cpu_count()} cores; " + ", ".join(found)


def table(labelled: LabelledSet, results: dict[str, list[dict]]) -> str:
    lines = [
        "| contender | seconds | docs/s | removed | ordered P / R / F1 | order-free P / R / F1 |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for name, runs in results.items():
        seconds = statistics.median(run["seconds"] for run in runs)
        removed = set(runs[0]["removed"])
        ordered = scores(removed, labelled.duplicates)
        free = order_free_scores(labelled, removed)
        lines.append(
            f"| {name} | {seconds:.2f} | {len(labelled.rows) / seconds:,.0f} | {len(removed)} | "
            + " / ".join(f"{ordered[k]:.3f}" for k in ("precision", "recall", "f1"))
            + " | "
            + " / ".join(f"{free[k]:.3f}" for k in ("precision", "recall", "f1"))
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--smoke: 1)")
    parser.add_argument("--out", type=Path, default=None, help="scratch directory (kept)")
    parser.add_argument(
        "--smoke", action="store_true", help="the bundled sample, 1 repeat, missing peers skipped"
    )
    parser.add_argument(
        "--documents",
        type=int,
        default=None,
        help="a labelled set of exactly N documents (WikiText-2, Python docs, spliced originals)",
    )
    parser.add_argument(
        "--datatrove-python",
        default=None,
        help="the python of a separate environment with datatrove, for its contender",
    )
    parser.add_argument(
        "--keel-python",
        default=None,
        help="the python of an environment with keel's own dependencies (pip install .), for "
        "keel's contenders (they import this checkout's keel)",
    )
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated subset to run"
    )
    parser.add_argument(
        "--phases", action="store_true", help="after the runs, one keel run's stage timeline"
    )
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--debug-log", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.contender:
        contender_main(arguments.contender, arguments.input, arguments.work, arguments.debug_log)
        return
    # Beside this script; imported here, so that tests can load this module by its path, and
    # after a contender's dispatch (--datatrove-python's environment need not have psutil).
    from measure import Peer, runnable_contenders, scratch_directory

    repeats = arguments.repeats or (1 if arguments.smoke else 3)
    peers = (
        {} if arguments.datatrove_python else {"datatrove": Peer("datatrove", DATATROVE_INSTALL)}
    )
    wanted = tuple(name for name in CONTENDERS if name in arguments.contenders.split(","))
    contenders = runnable_contenders(wanted, peers, arguments.smoke)
    keel_python = arguments.keel_python or sys.executable
    pythons = {
        "datatrove": arguments.datatrove_python or sys.executable,
        "keel": keel_python,
        "keel-warm": keel_python,
    }
    started = time.perf_counter()
    if arguments.smoke:
        articles = articles_from_sample()[:SMOKE_ARTICLES]
    else:
        articles = articles_from_wikitext([WIKITEXT / "valid.txt", WIKITEXT / "test.txt"])
        if arguments.documents is not None:
            articles += articles_from_pydocs()
    labelled = build_labelled_set(articles, documents=arguments.documents)
    built = time.perf_counter() - started
    with scratch_directory(arguments.out, "dedup-bench-") as scratch:
        source = scratch / "input"
        shutil.rmtree(source, ignore_errors=True)
        write_documents(labelled.rows, source)
        kinds = Counter(row["source"].split("-")[0] for row in labelled.rows)
        print(
            f"{len(labelled.rows):,} documents from {len(articles)} articles ({dict(kinds)}), "
            f"{len(labelled.duplicates):,} ground-truth duplicates (built in {built:.0f} s)",
            flush=True,
        )
        results: dict[str, list[dict]] = {name: [] for name in contenders}
        for _ in range(repeats):
            for name in contenders:
                python = pythons.get(name, sys.executable)
                results[name].append(run_once(name, source, scratch, python))
                load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
                print(f"{name}: {results[name][-1]['seconds']:.2f} s (load {load})", flush=True)
        phases = keel_phases(source, scratch, keel_python) if arguments.phases else None
    for name, runs in results.items():
        if any(set(run["removed"]) != set(runs[0]["removed"]) for run in runs):
            print(f"note: {name} removed different ids in different runs")
    print(f"\n{versions(arguments.datatrove_python)}")
    if arguments.keel_python:
        print(f"keel's contenders ran with {arguments.keel_python}")
    print(f"medians of {repeats} runs:\n")
    print(table(labelled, results))
    if "keel" in results and "datatrove" in results:
        keel = statistics.median(run["seconds"] for run in results["keel"])
        datatrove = statistics.median(run["seconds"] for run in results["datatrove"])
        print(f"\nkeel docs/s / datatrove docs/s: {datatrove / keel:.2f}x")
    for name, runs in results.items():
        seconds = ", ".join(f"{run['seconds']:.2f}" for run in runs)
        print(f"{name} runs (s): {seconds}")
    if phases:
        print(f"\nkeel stage timeline (one cold run):\n{phases}")


if __name__ == "__main__":
    main()
