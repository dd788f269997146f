"""A fused extract -> quality -> filter chain against the same three stages run one by one.

What it measures, on ../shared/datasets/pydocs/pages.jsonl.gz (530 raw HTML pages of the Python
3.11 docs, 51 MB), repeated `--copies` times under distinct URLs (so a run is long enough to time)
and written as `--parts` zstd Parquet files of (url, html, source):

- fused: `run_chain([extract, quality, filter])` (keel.data.runner): one flow pass reads each
  input file once, runs the three batch functions in a row and writes the kept documents once.
- one by one: `run_extract`, then `run_quality` on its output, then `run_filter` on that: each
  stage reads the one before from Parquet and writes its own output.

Both on one pool of keel's local flow backend with `--workers` processes, warmed up by one
untimed one-by-one run (the workers import the stages), default stage settings (the quality
stage without a model: language and heuristic columns). Runs are interleaved, alternating which
contender goes first, and the median of `--repeats` is reported, with the
bytes each contender read and wrote in Parquet (inputs, intermediates and outputs, from the files'
sizes). The fused output is checked to equal the one-by-one output row for row.

    python benchmarks/chain_bench.py [--copies 4] [--parts 8] [--workers 2] [--repeats 3]
    python benchmarks/chain_bench.py --smoke   # the 30 bundled pages, 1 repeat (CI)

Prints a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from keel.data import registry
from keel.data.extract import run_extract
from keel.data.filter import run_filter
from keel.data.quality import run_quality
from keel.data.runner import run_chain
from keel.flow import LocalBackend, RunOptions

REPO = Path(__file__).resolve().parents[1]
SHARED_PAGES = REPO.parent / "shared" / "datasets" / "pydocs" / "pages.jsonl.gz"
BUNDLED_PAGES = REPO / "keel" / "experiments" / "sample" / "pydocs.jsonl.gz"
CHAIN = ("extract", "quality", "filter")


def write_pages(source: Path, copies: int, parts: int, directory: Path) -> int:
    """The pages of `source`, `copies` times under distinct URLs, as `parts` Parquet files."""
    with gzip.open(source, "rt", encoding="utf-8") as lines:
        pages = [json.loads(line) for line in lines]
    rows = [(f"{page['url']}#copy{copy}", page["html"]) for copy in range(copies) for page in pages]
    directory.mkdir(parents=True)
    size = -(-len(rows) // parts)
    for part in range(parts):
        chunk = rows[part * size : (part + 1) * size]
        table = pa.table(
            {
                "url": [url for url, _ in chunk],
                "html": [html for _, html in chunk],
                "source": ["pydocs"] * len(chunk),
            }
        )
        pq.write_table(table, directory / f"part-{part:05d}.parquet", compression="zstd")
    return len(rows)


def parquet_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*.parquet"))


def run_fused(pages: Path, work: Path, options: RunOptions) -> tuple[float, Path, int]:
    output = work / "fused"
    chain = [(registry.stage(name), None) for name in CHAIN]
    started = time.perf_counter()
    run_chain(chain, str(pages), str(output), options)
    seconds = time.perf_counter() - started
    return seconds, output, parquet_bytes(pages) + parquet_bytes(output)


def run_one_by_one(pages: Path, work: Path, options: RunOptions) -> tuple[float, Path, int]:
    text, scored, kept = work / "text", work / "scored", work / "kept"
    started = time.perf_counter()
    run_extract(str(pages), str(text), options=options)
    run_quality(str(text), str(scored), options=options)
    run_filter(str(scored), str(kept), options=options)
    seconds = time.perf_counter() - started
    read = parquet_bytes(pages) + parquet_bytes(text) + parquet_bytes(scored)
    written = parquet_bytes(text) + parquet_bytes(scored) + parquet_bytes(kept)
    return seconds, kept, read + written


def table_of(directory: Path) -> pa.Table:
    parts = sorted(directory.glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(part) for part in parts]).sort_by("id")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=4, help="times each page is repeated")
    parser.add_argument("--parts", type=int, default=8, help="input Parquet files")
    parser.add_argument("--workers", type=int, default=2, help="flow worker processes")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each contender")
    parser.add_argument("--data", type=Path, default=SHARED_PAGES, help="pages.jsonl.gz")
    parser.add_argument("--smoke", action="store_true", help="30 bundled pages, 1 repeat")
    args = parser.parse_args()
    if args.smoke:
        args.data, args.copies, args.parts, args.repeats = BUNDLED_PAGES, 1, 2, 1
    logging.getLogger("keel").setLevel(logging.ERROR)  # the quality stage's "no model" note
    results: dict[str, list[tuple[float, int]]] = {"fused": [], "one by one": []}
    root = Path(tempfile.mkdtemp(prefix="keel-chain-bench-"))
    try:
        pages = root / "pages"
        documents = write_pages(args.data, args.copies, args.parts, pages)
        html_mb = parquet_bytes(pages) / 1e6
        with LocalBackend(workers=args.workers) as pool:
            options = RunOptions(backend=pool, progress=False)
            run_one_by_one(pages, root / "warm-up", options)  # the workers import the stages
            for repeat in range(args.repeats):
                work = root / f"run-{repeat}"
                if repeat % 2:  # alternate which goes first
                    single_s, single_out, single_bytes = run_one_by_one(pages, work, options)
                    fused_s, fused_out, fused_bytes = run_fused(pages, work, options)
                else:
                    fused_s, fused_out, fused_bytes = run_fused(pages, work, options)
                    single_s, single_out, single_bytes = run_one_by_one(pages, work, options)
                if not table_of(fused_out).equals(table_of(single_out)):
                    raise SystemExit("the fused chain's output differs from the stages one by one")
                results["fused"].append((fused_s, fused_bytes))
                results["one by one"].append((single_s, single_bytes))
                shutil.rmtree(work)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"# extract -> quality -> filter, fused vs one by one ({platform.python_version()})")
    print()
    print(
        f"{documents:,} pages ({args.copies} x {args.data.name}), {args.parts} Parquet files "
        f"({html_mb:.1f} MB), {args.workers} workers, median of {args.repeats}; outputs equal."
    )
    print()
    print("| contender | seconds (median) | runs | pages/s | Parquet MB read + written |")
    print("|---|---:|---|---:|---:|")
    for name, runs in results.items():
        seconds = statistics.median(s for s, _ in runs)
        listed = ", ".join(f"{s:.1f}" for s, _ in runs)
        moved = statistics.median(b for _, b in runs) / 1e6
        print(f"| {name} | {seconds:.1f} | {listed} | {documents / seconds:,.0f} | {moved:.0f} |")
    fused = statistics.median(s for s, _ in results["fused"])
    single = statistics.median(s for s, _ in results["one by one"])
    print()
    print(f"fused / one by one: {fused / single:.2f}x the time")


if __name__ == "__main__":
    main()
