"""Tokenization into a token cache (run_tokenize, 2 workers) against raw `tokenizers`.

What it measures, in tokens per second (tokens: the ids of all documents, EOS not counted):
- raw encode_batch: `tokenizer.encode_batch(texts)` on the whole list of texts, in one process,
  with the library's default parallelism (a Rayon pool of one thread per core, 2 here). The
  texts are already in memory as Python strings; only the call is timed.
- raw encode_batch_fast: the same with `encode_batch_fast` (no offsets), which run_tokenize uses.
- keel 1 file / keel 8 files: `run_tokenize(input, out, TokenizeConfig(tokenizer_path=...),
  RunOptions(workers=2))` end to end: keel/flow worker start-up, reading the document Parquet,
  encoding, writing the token parts, streaming them into shards with SHA-256, tokenizer.json,
  manifest.json, stage.json. The same documents as one Parquet file (one task: one worker
  encodes on 2 threads) and as 8 files (two workers, one thread each).
All use the same tokenizer: a byte-level BPE of 32,768 ids that run_tokenize trained on the
corpus once beforehand (its training time is reported apart). Each run is a fresh subprocess
(imports excluded from its time); runs are interleaved (raw, raw fast, keel 1, keel 8, raw, ...)
so that load from other processes on this shared machine hits all contenders alike; medians of
--repeats runs. Besides wall-clock seconds, each run reports CPU seconds (user + system: the
raw call's process time, Rayon threads included; keel's coordinator plus its reaped workers,
around run_tokenize), which other processes' load disturbs much less than wall time.
Peak memory: the summed RSS of the run's process tree, sampled every 50 ms.
Every keel cache is checked: its token stream equals the raw encoding plus EOS, byte for byte.

The corpus: wikitext-2 valid.txt + test.txt (2.4 MB, 121 articles split at their " = Title = "
lines, normalized like any document set), repeated to --megabytes of UTF-8 text.

    python benchmarks/tokenize_bench.py [--megabytes 50] [--repeats 3] [--out DIR]
    python benchmarks/tokenize_bench.py --smoke   # what CI runs: seconds, no shared data

--smoke: the first SMOKE_ARTICLES of the WikiText-2 articles bundled with keel (0.2 MB of
keel/experiments/sample/wikitext2.jsonl.gz; ../shared/datasets is not read), a tokenizer of
SMOKE_VOCAB_SIZE ids, 1 repeat, every contender as above (each cache checked against the raw
encoding), the table printed. Without --out, a smoke run works in a temporary directory that is
removed at the end; a full run caches its input and tokenizer in /tmp/keel-tokenize-bench.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from measure import run_measured, scratch_directory

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "datasets" / "wikitext2"
SAMPLE = REPO / "keel" / "experiments" / "sample" / "wikitext2.jsonl.gz"
DEFAULT_OUT = Path("/tmp/keel-tokenize-bench")
CONTENDERS = ("raw encode_batch", "raw encode_batch_fast", "keel 1 file", "keel 8 files")
VOCAB_SIZE = 32_768
SMOKE_VOCAB_SIZE = 1_024
SMOKE_ARTICLES = 16
"""0.2 MB of text; a multiple of 8, so each of the 8 files gets documents."""
WORKERS = 2
MB = 1_000_000


def documents(megabytes: float, smoke: bool) -> list[str]:
    """The articles (normalized like any document set) repeated to about `megabytes` of text:
    WikiText-2's valid and test files; in a smoke run, the first SMOKE_ARTICLES articles bundled
    with keel, once."""
    from keel.data.documents import normalize_text

    if smoke:
        with gzip.open(SAMPLE, "rt", encoding="utf-8") as lines:
            return [normalize_text(json.loads(line)["text"]) for line in lines][:SMOKE_ARTICLES]
    text = "".join(
        (WIKITEXT / name).read_text(encoding="utf-8") for name in ("valid.txt", "test.txt")
    )
    articles = [normalize_text(a) for a in re.split(r"\n(?= = [^=].* = \n)", text) if a.strip()]
    size = sum(len(a.encode("utf-8")) for a in articles)
    return articles * max(1, round(megabytes * MB / size))


def prepare(out: Path, megabytes: float, vocab_size: int, smoke: bool) -> dict:
    """The two document sets and the tokenizer, made once and reused (meta.json says so)."""
    meta_path = out / "meta.json"
    needed = [out / "one", out / "eight", out / "trained" / "tokenizer.json"]
    if meta_path.exists() and all(path.exists() for path in needed):
        meta = json.loads(meta_path.read_text())
        wanted = {"megabytes": megabytes, "vocab_size": vocab_size, "smoke": smoke}
        if all(meta.get(key) == value for key, value in wanted.items()):
            return meta
    from keel.data.documents import write_texts
    from keel.data.tokenize import TokenizeConfig, run_tokenize
    from keel.flow import RunOptions

    meta_path.unlink(missing_ok=True)
    for made in ("one", "eight", "trained"):  # what this makes; nothing else in `out`
        shutil.rmtree(out / made, ignore_errors=True)
    docs = documents(megabytes, smoke)
    write_texts(out / "one", docs, 1, "wikitext2")
    write_texts(out / "eight", docs, 8, "wikitext2")
    began = time.perf_counter()
    config = TokenizeConfig(vocab_size=vocab_size)
    run_tokenize(str(out / "one"), str(out / "trained"), config, RunOptions(workers=WORKERS))
    meta = {
        "megabytes": megabytes,
        "vocab_size": vocab_size,
        "smoke": smoke,
        "documents": len(docs),
        "text_bytes": sum(len(d.encode("utf-8")) for d in docs),
        "train_and_tokenize_seconds": time.perf_counter() - began,
        "tokenizer": str(out / "trained" / "tokenizer.json"),
    }
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta


# -- one contender in a fresh subprocess -------------------------------------------------------


def run_raw(name: str, out: Path, tokenizer_path: str) -> dict:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    texts = pq.read_table(out / "one", columns=["text"]).column("text").to_pylist()
    encode = tokenizer.encode_batch_fast if name.endswith("fast") else tokenizer.encode_batch
    began, cpu = time.perf_counter(), time.process_time()
    encodings = encode(texts)
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    eos = tokenizer.token_to_id("<|endoftext|>")
    stream = np.fromiter((i for e in encodings for i in (*e.ids, eos)), dtype="<u2")
    tokens = len(stream) - len(texts)
    digest = hashlib.sha256(stream).hexdigest()
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens, "sha256": digest}


def run_keel(name: str, out: Path, tokenizer_path: str) -> dict:
    from keel.data.token_cache import TokenCache
    from keel.data.tokenize import TokenizeConfig, run_tokenize
    from keel.flow import RunOptions

    source = out / ("one" if name.endswith("1 file") else "eight")
    target = out / "cache"
    shutil.rmtree(target, ignore_errors=True)
    config = TokenizeConfig(tokenizer_path=tokenizer_path)
    began, cpu = time.perf_counter(), tree_cpu_seconds()
    report = run_tokenize(str(source), str(target), config, RunOptions(workers=WORKERS))
    seconds, cpu = time.perf_counter() - began, tree_cpu_seconds() - cpu
    cache = TokenCache(str(target))
    digest = hashlib.sha256()
    for tokens in cache.tokens:
        digest.update(tokens.tobytes())
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "tokens": report.details["tokens"] - report.documents_out,
        "sha256": digest.hexdigest(),
        "shards": len(cache.shards),
    }


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its reaped children (keel/flow's workers,
    which the run waits for when it closes its backend)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def contender_main(name: str, out: Path, tokenizer_path: str) -> None:
    run = run_raw if name.startswith("raw") else run_keel
    print(json.dumps(run(name, out, tokenizer_path)))


# -- the parent --------------------------------------------------------------------------------


def run_contender(name: str, out: Path, tokenizer_path: str) -> dict:
    command = [sys.executable, __file__, "--contender", name, "--out", str(out)]
    command += ["--tokenizer", tokenizer_path]
    report, peaks = run_measured(name, command)
    return {**report, "peak_rss": peaks["tree"]}


def benchmark(out: Path, meta: dict, repeats: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    for repeat in range(repeats):
        for name in CONTENDERS:
            load = os.getloadavg()[0]
            result = {**run_contender(name, out, meta["tokenizer"]), "load_before": load}
            runs[name].append(result)
            print(
                f"run {repeat + 1}/{repeats} {name}: {result['seconds']:.2f} s, "
                f"{result['cpu_seconds']:.2f} CPU s, load before {load:.1f}",
                file=sys.stderr,
            )
    expected = runs[CONTENDERS[0]][0]
    for name, results in runs.items():
        for result in results:
            if (result["tokens"], result["sha256"]) != (expected["tokens"], expected["sha256"]):
                raise SystemExit(f"{name}: token stream differs from raw encode_batch")
    return runs


def table(runs: dict[str, list[dict]], meta: dict) -> str:
    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    tokens = runs[CONTENDERS[0]][0]["tokens"]
    wall, cpu = median(CONTENDERS[0], "seconds"), median(CONTENDERS[0], "cpu_seconds")
    lines = [
        "| contender | wall s | M tokens/s | vs raw encode_batch | CPU s | M tokens/CPU s "
        "| vs raw (CPU) | peak RSS MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in runs:
        seconds, cpu_seconds = median(name, "seconds"), median(name, "cpu_seconds")
        lines.append(
            f"| {name} | {seconds:.2f} | {tokens / seconds / 1e6:.3f} | {wall / seconds:.2f}x "
            f"| {cpu_seconds:.2f} | {tokens / cpu_seconds / 1e6:.3f} | {cpu / cpu_seconds:.2f}x "
            f"| {median(name, 'peak_rss') / MB:.0f} |"
        )
    loads = [r["load_before"] for results in runs.values() for r in results]
    lines.append("")
    lines.append(
        f"{meta['text_bytes'] / MB:.1f} MB of text, {meta['documents']:,} documents, "
        f"{tokens:,} tokens, vocabulary {meta['vocab_size']:,}; {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; medians of {len(runs[CONTENDERS[0]])} runs; "
        f"1-minute load average before a run: {min(loads):.1f} to {max(loads):.1f}. "
        "Wall seconds per run: "
        + "; ".join(
            f"{n}: " + ", ".join(f"{r['seconds']:.2f}" for r in rs) for n, rs in runs.items()
        )
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=50.0, help="of text (not --smoke)")
    parser.add_argument("--repeats", type=int, help="runs per contender; default 3 (--smoke: 1)")
    parser.add_argument(
        "--out", type=Path, help=f"default {DEFAULT_OUT} (--smoke: a temporary directory)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the bundled sample, a small vocabulary, 1 repeat"
    )
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.contender:
        contender_main(arguments.contender, arguments.out, arguments.tokenizer)
        return
    smoke = arguments.smoke
    repeats = arguments.repeats or (1 if smoke else 3)
    vocab_size = SMOKE_VOCAB_SIZE if smoke else VOCAB_SIZE
    with scratch_directory(arguments.out or (None if smoke else DEFAULT_OUT), "tokenize-") as out:
        meta = prepare(out, arguments.megabytes, vocab_size, smoke)
        trained_s = meta["train_and_tokenize_seconds"]
        print(f"tokenizer: trained and tokenized 1 file in {trained_s:.1f} s", file=sys.stderr)
        runs = benchmark(out, meta, repeats)
        (out / "results.json").write_text(json.dumps(runs, indent=2))
    print(table(runs, meta))


if __name__ == "__main__":
    main()
