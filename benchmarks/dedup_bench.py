"""Fuzzy dedup on a labelled near-duplicate set from WikiText-2: keel against datatrove's MinHash.

What it measures: both contenders read the same 2 zstd Parquet files (a few thousand documents cut
from the WikiText-2 valid and test articles, with planted near-duplicates and hard negatives),
find near-duplicates with the same parameters (word 5-grams, 112 permutations, 14 bands of 8
rows, seed 1) on 2 worker processes, and write the kept documents. Reported per contender, medians
over --repeats runs: seconds, documents per second, and the precision, recall and F1 of its
removals against the ground truth.

The labelled set (build_labelled_set; tests/data/test_dedup.py uses it on the bundled 40-article
slice):
- originals: each article cut into documents of 150-350 words along its paragraphs;
- near copies of an original (about 45% of them get one, some two): word substitutions,
  deletions, insertions or a mix at 0.2-2.5% of words, paragraph shuffles with light edits,
  truncations of the last 2-12% of words, and copies that differ only in case and punctuation;
- hard negatives: copies with heavy edits (5-20% of words), excerpts of 40-75% of a document,
  and splices of two halves of documents of the same article (shared topic words);
- all shuffled (seeded). Ground truth, computed from the texts, not from the labels: in input
  order, a document is a duplicate when the exact Jaccard similarity of its word 5-gram set (same
  normalization as keel: lowercase, punctuation and symbols to spaces) and that of an earlier
  kept document is >= 0.8. So planted edits near 2.3% of words land on either side of 0.8.

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

    pip install "datatrove[processing,io]"   # only to measure; not a keel dependency
    python benchmarks/dedup_bench.py [--repeats 3] [--out DIR]
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

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "datasets" / "wikitext2"
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
    best_jaccard: dict[str, float]
    """Per id, the true Jaccard to its most similar earlier kept document (0 when none)."""


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


def build_labelled_set(
    articles: list[tuple[str, str]], seed: int = 0, min_words: int = 150, max_words: int = 350
) -> LabelledSet:
    """Originals cut from `articles`, planted near copies and hard negatives, shuffled; see the
    module docstring. Deterministic for a seed."""
    from keel.data.documents import document_id

    rng = random.Random(seed)
    originals = [
        (title, doc)
        for title, text in articles
        for doc in _cut(text.split("\n"), rng, min_words, max_words)
    ]
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
    removed, best = greedy_duplicates([row["text"] for row in rows])
    return LabelledSet(
        rows,
        {rows[i]["id"] for i in removed},
        {row["id"]: score for row, score in zip(rows, best, strict=True)},
    )


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


def greedy_duplicates(
    texts: list[str], threshold: float = THRESHOLD
) -> tuple[list[int], list[float]]:
    """The ground-truth rule: in order, a text is a duplicate when its exact shingle-set Jaccard
    to an earlier kept text is >= threshold. Returns the duplicates' indices and each text's best
    Jaccard to an earlier kept text (an inverted index of the kept texts' shingles)."""
    index: dict[tuple[str, ...], list[int]] = {}
    sizes: dict[int, int] = {}
    removed, best = [], []
    for number, text in enumerate(texts):
        shingles = shingle_set(text)
        shared = Counter(kept for s in shingles for kept in index.get(s, ()))
        score = max(
            (n / (len(shingles) + sizes[kept] - n) for kept, n in shared.items()), default=0.0
        )
        best.append(score)
        if score >= threshold:
            removed.append(number)
            continue
        sizes[number] = len(shingles)
        for s in shingles:
            index.setdefault(s, []).append(number)
    return removed, best


def scores(removed: set[str], truth: set[str]) -> dict[str, float]:
    """Precision, recall and F1 of `removed` ids against the ground truth's."""
    hits = len(removed & truth)
    precision = hits / len(removed) if removed else 1.0
    recall = hits / len(truth) if truth else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def order_free_scores(labelled: LabelledSet, removed: set[str]) -> dict[str, float]:
    """Scores that do not care which member of a cluster was kept (see the module docstring)."""
    kept = [row for row in labelled.rows if row["id"] not in removed]
    kept_index: dict[tuple[str, ...], list[int]] = {}
    kept_sizes = []
    for number, row in enumerate(kept):
        shingles = shingle_set(row["text"])
        kept_sizes.append(len(shingles))
        for s in shingles:
            kept_index.setdefault(s, []).append(number)
    justified = 0
    for row in labelled.rows:
        if row["id"] in removed:
            shingles = shingle_set(row["text"])
            shared = Counter(k for s in shingles for k in kept_index.get(s, ()))
            justified += any(
                n / (len(shingles) + kept_sizes[k] - n) >= THRESHOLD for k, n in shared.items()
            )
    residual = len(greedy_duplicates([row["text"] for row in kept])[0])
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


def contender_main(name: str, source: Path, work: Path) -> None:
    """One timed run, in this (fresh) process: prints {"seconds", "removed"} as JSON."""
    run = {"keel": run_keel, "keel-warm": run_keel_warm, "datatrove": run_datatrove}[name]
    seconds, removed = run(source, work)
    print(json.dumps({"seconds": seconds, "removed": sorted(removed)}))


def run_once(name: str, source: Path, scratch: Path) -> dict:
    work = scratch / f"{name}-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    command = [sys.executable, __file__, "--contender", name, "--input", str(source)]
    done = subprocess.run(
        [*command, "--work", str(work)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(work, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("numpy", "pyarrow", "datatrove"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} (not installed)")
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
    # Beside this script; imported here, so that tests can load this module by its path.
    from measure import Peer, runnable_contenders, scratch_directory

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--smoke: 1)")
    parser.add_argument("--out", type=Path, default=None, help="scratch directory (kept)")
    parser.add_argument(
        "--smoke", action="store_true", help="the bundled sample, 1 repeat, missing peers skipped"
    )
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.contender:
        contender_main(arguments.contender, arguments.input, arguments.work)
        return
    repeats = arguments.repeats or (1 if arguments.smoke else 3)
    peers = {"datatrove": Peer("datatrove", DATATROVE_INSTALL)}
    contenders = runnable_contenders(CONTENDERS, peers, arguments.smoke)
    if arguments.smoke:
        articles = articles_from_sample()[:SMOKE_ARTICLES]
    else:
        articles = articles_from_wikitext([WIKITEXT / "valid.txt", WIKITEXT / "test.txt"])
    labelled = build_labelled_set(articles)
    with scratch_directory(arguments.out, "dedup-bench-") as scratch:
        source = scratch / "input"
        shutil.rmtree(source, ignore_errors=True)
        write_documents(labelled.rows, source)
        kinds = Counter(row["source"].split("-")[0] for row in labelled.rows)
        print(
            f"{len(labelled.rows):,} documents from {len(articles)} articles ({dict(kinds)}), "
            f"{len(labelled.duplicates):,} ground-truth duplicates"
        )
        results: dict[str, list[dict]] = {name: [] for name in contenders}
        for _ in range(repeats):
            for name in contenders:
                results[name].append(run_once(name, source, scratch))
    for name, runs in results.items():
        if any(set(run["removed"]) != set(runs[0]["removed"]) for run in runs):
            print(f"note: {name} removed different ids in different runs")
    print(f"\n{versions()}\nmedians of {repeats} runs:\n")
    print(table(labelled, results))
    keel = statistics.median(run["seconds"] for run in results["keel"])
    if "datatrove" in results:
        datatrove = statistics.median(run["seconds"] for run in results["datatrove"])
        print(f"\nkeel docs/s / datatrove docs/s: {datatrove / keel:.2f}x")
    for name, runs in results.items():
        seconds = ", ".join(f"{run['seconds']:.2f}" for run in runs)
        print(f"{name} runs (s): {seconds}")


if __name__ == "__main__":
    main()
