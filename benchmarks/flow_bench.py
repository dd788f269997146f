"""Exact dedup of synthetic documents: keel/flow (local backend) against DuckDB and polars.

What it measures: each contender (keel; DuckDB, the SQL in DUCKDB_QUERY; polars) reads the same
8 zstd Parquet files, keeps the first row per `id` (first in file order, then row order), and
writes the kept rows as zstd Parquet to a fresh directory. Two more do DataKit's exact dedup task,
the first row per `text` (a repeated document repeats both, so the kept rows are the same):
`keel-exact-stage` (keel.data.dedup.run_exact_dedup, which also writes removed.parquet and
stage.json) and `polars-text` (`unique(subset="text", ...)`). Reported per contender (medians over
--repeats runs): seconds, input rows per second, and peak resident memory.

How:
- The input is generated once and cached in --out: `--docs` documents with columns id (32 hex
  chars), text (~450 bytes of seeded random words from a fixed vocabulary) and source (one of 16
  labels, drawn per row). About 30% of rows repeat the id and text of an earlier document, spread
  over all files; their source label usually differs from the first occurrence's, so keeping the
  wrong copy shows up in the check below. Generation is vectorised (numpy + pyarrow).
- Each run is a fresh subprocess (this script with --contender), so imports, caches and allocator
  state never carry over. Its seconds are timed inside the subprocess around the work alone
  (imports excluded; keel's worker start-up included). Runs are interleaved: keel, duckdb,
  polars, keel, ... The input files stay in the page cache for all of them.
- Peak memory: the parent samples the subprocess and all its descendants with psutil every 50 ms
  and keeps the peak of the SUM of their RSS (keel: coordinator plus worker processes; DuckDB and
  polars: one process) and the peak of the largest single process. A sum of RSS counts shared
  pages (libraries) once per process, so it slightly overstates a multi-process tree.
- Every run's output is checked against the expected first occurrences: the same rows, ids and
  sources, so all contenders produce the same set.

    pip install "polars>=1.0"   # only to measure; not a keel dependency
    python benchmarks/flow_bench.py [--docs 2000000] [--repeats 3] [--out DIR] [--contenders a,b]
        [--keel-python /tmp/kvenv/bin/python]
    python benchmarks/flow_bench.py --smoke   # what CI runs: seconds

--keel-python runs keel's contenders with the interpreter of an environment of keel's own
dependencies (`python3 -m venv /tmp/kvenv && /tmp/kvenv/bin/pip install .`), importing this
checkout's keel, as the peers run with only theirs: keel's test environment carries pandas
(datasets and evaluate, for lm-eval), which pyarrow imports in every worker process that
converts an array (~0.2 s each at start).

--smoke: SMOKE_DOCS documents (~2 MB of text), 1 repeat, every contender as above (polars
skipped, with one line, when it is not installed), each output checked, the table printed.
Without --out, a smoke run generates its input in a temporary directory that is removed at the
end; a full run caches it in /tmp/keel-flow-bench.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from measure import (
    Peer,
    checkout_environment,
    run_measured,
    runnable_contenders,
    scratch_directory,
)

FORMAT_VERSION = 1
SEED = 20240611
FILES = 8
ROW_GROUP_ROWS = 65_536
DUPLICATE_FRACTION = 0.30
TEXT_BYTES = 450
VOCABULARY_WORDS = 8192
SOURCE_LABELS = tuple(f"crawl-{n:02d}" for n in range(16))
CONTENDERS = ("keel", "duckdb", "polars", "keel-exact-stage", "polars-text")
PEERS = {
    "polars": Peer("polars", 'pip install "polars>=1.0"'),
    "polars-text": Peer("polars", 'pip install "polars>=1.0"'),
}
"""DuckDB is a keel dependency (the telemetry store's comparisons use it too): not a peer."""
DEFAULT_OUT = Path("/tmp/keel-flow-bench")
SMOKE_DOCS = 5_000
THREADS = 2
MB = 1_000_000

DUCKDB_QUERY = """
SELECT * EXCLUDE (filename, file_row_number)
FROM read_parquet('{glob}', filename = true, file_row_number = true)
QUALIFY row_number() OVER (PARTITION BY id ORDER BY filename, file_row_number) = 1
"""
"""The fastest correct form measured here, and the leanest: arg_min(struct_pack(id, text, source),
(filename, file_row_number)) ... GROUP BY id and first(... ORDER BY filename, file_row_number) took
5-15% longer at ~1.8x the peak memory; DISTINCT ON (id) ... ORDER BY id, filename, file_row_number
took 2-3x as long."""


# -- synthetic input -------------------------------------------------------------------------


def mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 values: a seeded, stateless pseudo-random function."""
    with np.errstate(over="ignore"):
        x = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15 ^ SEED)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def vocabulary() -> pa.StringArray:
    """VOCABULARY_WORDS distinct-ish lowercase words of 2 to 11 letters, always the same."""
    rng = np.random.default_rng(SEED)
    lengths = rng.integers(2, 12, VOCABULARY_WORDS)
    letters = rng.integers(ord("a"), ord("z") + 1, int(lengths.sum()), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.StringArray.from_buffers(
        VOCABULARY_WORDS, pa.py_buffer(offsets), pa.py_buffer(letters.tobytes())
    )


def hex_ids(docs: np.ndarray) -> pa.StringArray:
    """The 32-hex-char id of each document number (128 bits from two mixes)."""
    words = np.stack([mix(docs * np.uint64(2)), mix(docs * np.uint64(2) + np.uint64(1))], axis=1)
    raw = np.ascontiguousarray(words).view(np.uint8).reshape(len(docs), 16)
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    text = np.empty((len(docs), 32), dtype=np.uint8)
    text[:, 0::2] = digits[raw >> 4]
    text[:, 1::2] = digits[raw & 15]
    offsets = np.arange(0, 32 * len(docs) + 1, 32, dtype=np.int32)
    return pa.StringArray.from_buffers(
        len(docs), pa.py_buffer(offsets), pa.py_buffer(text.tobytes())
    )


def texts(docs: np.ndarray, words: pa.StringArray) -> pa.Array:
    """Each document number's text: a deterministic run of vocabulary words."""
    mean_word = pc.mean(pc.utf8_length(words)).as_py() + 1
    mean_count = round(TEXT_BYTES / mean_word)
    spread = mean_count // 5
    counts = mean_count - spread + (mix(docs ^ np.uint64(0xC0FFEE)) % np.uint64(2 * spread + 1))
    counts = counts.astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    position = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], counts)
    seeds = np.repeat(docs.astype(np.uint64) << np.uint64(8), counts) + position.astype(np.uint64)
    chosen = words.take(pa.array((mix(seeds) % np.uint64(len(words))).astype(np.int32)))
    lists = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), chosen)
    return pc.binary_join(lists, " ")


def document_numbers(count: int) -> np.ndarray:
    """The document number of each row: a new number for an original, an earlier row's number
    (chosen uniformly among all earlier originals) for a duplicate."""
    rng = np.random.default_rng(SEED + 1)
    duplicate = rng.random(count) < DUPLICATE_FRACTION
    duplicate[0] = False
    originals_so_far = np.cumsum(~duplicate)
    earlier = np.floor(rng.random(count) * originals_so_far).astype(np.int64)
    return np.where(duplicate, earlier, originals_so_far - 1).astype(np.uint64)


def sources(rows: np.ndarray) -> pa.Array:
    labels = pa.array(SOURCE_LABELS)
    pick = mix(rows.astype(np.uint64) ^ np.uint64(0xBEEF)) % np.uint64(len(SOURCE_LABELS))
    return labels.take(pa.array(pick.astype(np.int32)))


def generate(directory: Path, docs: int) -> dict:
    """Write the input files and the expected result (id, source of each first occurrence)."""
    data = directory / "data"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    words = vocabulary()
    numbers = document_numbers(docs)
    rows = np.arange(docs, dtype=np.uint64)
    first = np.concatenate([[True], numbers[1:] > np.maximum.accumulate(numbers)[:-1]])
    text_bytes = 0
    for index, part in enumerate(np.array_split(rows, FILES)):
        table = pa.table(
            {
                "id": hex_ids(numbers[part]),
                "text": texts(numbers[part], words),
                "source": sources(part),
            }
        )
        text_bytes += table.column("text").nbytes
        path = data / f"part-{index:02d}.parquet"
        pq.write_table(table, path, compression="zstd", row_group_size=ROW_GROUP_ROWS)
    expected = pa.table({"id": hex_ids(numbers[first]), "source": sources(rows[first])})
    pq.write_table(expected, directory / "expected.parquet", compression="zstd")
    meta = {
        "format": FORMAT_VERSION,
        "docs": docs,
        "unique": int(first.sum()),
        "text_bytes": int(text_bytes),
        "file_bytes": sum(path.stat().st_size for path in data.glob("*.parquet")),
    }
    (directory / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def ensure_input(directory: Path, docs: int) -> dict:
    """The cached input's description, generating it first when missing or of another size."""
    meta_path = directory / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("format") == FORMAT_VERSION and meta.get("docs") == docs:
            return meta
    started = time.perf_counter()
    meta = generate(directory, docs)
    print(f"generated {docs:,} docs in {time.perf_counter() - started:.1f} s: {meta}")
    return meta


# -- contenders (each runs in its own subprocess) ------------------------------------------------


def run_keel(glob: str, target: Path) -> dict:
    from keel.flow import read_parquet

    timer = StageTimer()
    result = read_parquet(glob).deduplicate("id", num_shards=8).write_parquet(target, workers=2)
    stages = [
        {
            "stage": stage.stage,
            "name": stage.name,
            "seconds": timer.seconds[stage.stage] if stage.stage < len(timer.seconds) else None,
            "rows_in": stage.rows_in,
            "rows_out": stage.rows_out,
            "bytes_spilled": stage.bytes_spilled,
            "peak_worker_rss": stage.peak_worker_rss,
        }
        for stage in result.stages
    ]
    return {"rows_out": result.rows, "stages": stages}


class StageTimer(logging.Handler):
    """Times keel's stages from the runner's log record at the end of each stage."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: list[float] = []
        self._last = time.perf_counter()
        runner_log = logging.getLogger("keel.flow.runner")
        runner_log.addHandler(self)
        runner_log.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("stage "):
            now = time.perf_counter()
            self.seconds.append(now - self._last)
            self._last = now


def run_duckdb(glob: str, target: Path) -> dict:
    import duckdb

    target.mkdir(parents=True)
    connection = duckdb.connect(config={"threads": THREADS})
    path = target / "part-0.parquet"
    query = DUCKDB_QUERY.format(glob=glob)
    connection.execute(f"COPY ({query}) TO '{path}' (FORMAT parquet, COMPRESSION zstd)")
    return {"rows_out": pq.ParquetFile(path).metadata.num_rows}


def run_polars(glob: str, target: Path) -> dict:
    import polars as pl

    target.mkdir(parents=True)
    path = target / "part-0.parquet"
    (
        pl.scan_parquet(glob)
        .unique(subset="id", keep="first", maintain_order=True)
        .sink_parquet(path, compression="zstd")
    )
    return {"rows_out": pq.ParquetFile(path).metadata.num_rows, "threads": pl.thread_pool_size()}


def run_keel_exact_stage(glob: str, target: Path) -> dict:
    """DataKit's exact dedup stage (`keel data dedup --mode exact`): the first document of each
    text, keyed by a hash of the text whatever the ids; it also writes removed.parquet (the
    removed rows' ids and sources) and stage.json, from a first pass over text, ids and sources."""
    from keel.data.dedup import ExactDedupConfig, run_exact_dedup
    from keel.flow import RunOptions

    report = run_exact_dedup(
        glob, str(target), ExactDedupConfig(num_shards=FILES), RunOptions(workers=THREADS)
    )
    return {"rows_out": report.documents_out}


def run_polars_text(glob: str, target: Path) -> dict:
    """polars keeping the first row of each text (the exact dedup stage's task)."""
    import polars as pl

    target.mkdir(parents=True)
    path = target / "part-0.parquet"
    (
        pl.scan_parquet(glob)
        .unique(subset="text", keep="first", maintain_order=True)
        .sink_parquet(path, compression="zstd")
    )
    return {"rows_out": pq.ParquetFile(path).metadata.num_rows, "threads": pl.thread_pool_size()}


RUNNERS = {
    "keel": run_keel,
    "duckdb": run_duckdb,
    "polars": run_polars,
    "keel-exact-stage": run_keel_exact_stage,
    "polars-text": run_polars_text,
}


def contender_main(name: str, glob: str, target: Path) -> None:
    """Inside the subprocess: run one contender, print its timing and counters as JSON."""
    started = time.perf_counter()
    report = RUNNERS[name](glob, target)
    report["seconds"] = time.perf_counter() - started
    print(json.dumps(report))


# -- the parent: subprocesses, memory sampling, checks, table -------------------------------


def run_contender(name: str, glob: str, target: Path, keel_python: str | None = None) -> dict:
    """One run of `name` in a fresh subprocess; its report plus peak RSS of its process tree.
    keel's contenders run with `keel_python` when given (an environment of keel's own
    dependencies), importing this checkout's keel."""
    shutil.rmtree(target, ignore_errors=True)
    environment = {**os.environ, "POLARS_MAX_THREADS": str(THREADS)}
    python = sys.executable
    if keel_python and name.startswith("keel"):
        python, environment = keel_python, checkout_environment(environment)
    command = [python, __file__, "--contender", name, "--glob", glob, "--target", target]
    report, peaks = run_measured(name, command, environment)
    return {**report, "peak_tree_rss": peaks["tree"], "peak_single_rss": peaks["single"]}


def check_output(name: str, target: Path, expected: pa.Table) -> None:
    """The output must hold exactly the first occurrences: same ids, each with its source."""
    parts = sorted(str(path) for path in target.glob("part-*.parquet"))  # not removed.parquet
    kept = pq.read_table(parts, columns=["id", "source"]).sort_by("id")
    kept = kept.cast(pa.schema([("id", pa.string()), ("source", pa.string())]))  # polars: large
    if kept.num_rows != expected.num_rows:
        raise SystemExit(f"{name}: {kept.num_rows:,} rows, expected {expected.num_rows:,}")
    if not kept.column("id").equals(expected.column("id")):
        raise SystemExit(f"{name}: the set of ids differs from the expected one")
    if not kept.column("source").equals(expected.column("source")):
        raise SystemExit(f"{name}: some kept rows are not the first occurrence of their id")


def benchmark(
    directory: Path, contenders: tuple[str, ...], repeats: int, keel_python: str | None = None
) -> dict[str, list[dict]]:
    glob = str(directory / "data" / "*.parquet")
    expected = pq.read_table(directory / "expected.parquet").sort_by("id")
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for repeat in range(repeats):
        for name in contenders:
            target = directory / "out" / name
            run = run_contender(name, glob, target, keel_python)
            check_output(name, target, expected)
            runs[name].append(run)
            print(
                f"repeat {repeat + 1}/{repeats} {name}: {run['seconds']:.1f} s, "
                f"peak tree RSS {run['peak_tree_rss'] / MB:,.0f} MB, {run['rows_out']:,} rows out",
                flush=True,
            )
    shutil.rmtree(directory / "out", ignore_errors=True)
    return runs


def medians(runs: list[dict], docs: int) -> dict:
    seconds = statistics.median(run["seconds"] for run in runs)
    return {
        "seconds": seconds,
        "rows_per_second": docs / seconds,
        "peak_tree_mb": statistics.median(run["peak_tree_rss"] for run in runs) / MB,
        "peak_single_mb": statistics.median(run["peak_single_rss"] for run in runs) / MB,
    }


def table(summary: dict[str, dict]) -> str:
    lines = [
        "| contender | seconds | rows/s | peak RSS, tree (MB) | peak RSS, largest process (MB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, row in summary.items():
        lines.append(
            f"| {name} | {row['seconds']:.1f} | {row['rows_per_second']:,.0f} | "
            f"{row['peak_tree_mb']:,.0f} | {row['peak_single_mb']:,.0f} |"
        )
    return "\n".join(lines)


def ratios(summary: dict[str, dict]) -> str:
    """keel against each peer of its task (by id; by text for the exact dedup stage), and the
    targets: flow's dedup within 2x of DuckDB's time at no more than its peak memory; the exact
    dedup stage within 1.2x of polars' (issue 18) at no more than its peak memory."""
    pairs = [("keel", other) for other in ("duckdb", "polars")]
    pairs += [("keel-exact-stage", "polars-text")]
    lines = []
    for ours, other in pairs:
        if ours in summary and other in summary:
            time_ratio = summary[ours]["seconds"] / summary[other]["seconds"]
            memory_ratio = summary[ours]["peak_tree_mb"] / summary[other]["peak_tree_mb"]
            lines.append(
                f"- {ours}/{other}: time {time_ratio:.2f}x, peak memory {memory_ratio:.2f}x"
            )
    for ours, other, factor in (("keel", "duckdb", 2.0), ("keel-exact-stage", "polars-text", 1.2)):
        if ours in summary and other in summary:
            fast = summary[ours]["seconds"] <= factor * summary[other]["seconds"]
            lean = summary[ours]["peak_tree_mb"] <= summary[other]["peak_tree_mb"]
            lines.append(
                f"- target for {ours} (within {factor:g}x of {other}'s time: "
                f"{'yes' if fast else 'no'}; at no more than its peak memory: "
                f"{'yes' if lean else 'no'}): {'met' if fast and lean else 'NOT met'}"
            )
    return "\n".join(lines)


def versions(contenders: tuple[str, ...]) -> str:
    from importlib.metadata import version

    memory = psutil.virtual_memory().total / 2**30
    packages = dict.fromkeys(
        name.split("-")[0] for name in contenders if not name.startswith("keel")
    )
    peers = "".join(f", {package} {version(package)}" for package in packages)
    return (
        f"{os.cpu_count()} cores, {memory:.1f} GiB RAM, Python {platform.python_version()}, "
        f"pyarrow {pa.__version__}{peers}"
    )


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--docs",
        type=int,
        help=f"documents (rows) in total; default 2,000,000 (--smoke: {SMOKE_DOCS:,})",
    )
    parser.add_argument("--repeats", type=int, help="runs per contender; default 3 (--smoke: 1)")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"input cache and outputs; default {DEFAULT_OUT} (--smoke: a temporary directory)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny input, 1 repeat, missing peers skipped"
    )
    parser.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma-separated, of {', '.join(CONTENDERS)} (default: all)",
    )
    parser.add_argument(
        "--keel-python",
        help="the python of an environment with keel's own dependencies (pip install .) for "
        "keel's contenders, as a user installs it (they import this checkout's keel)",
    )
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--glob", help=argparse.SUPPRESS)
    parser.add_argument("--target", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    arguments = parse_arguments()
    if arguments.contender:
        contender_main(arguments.contender, arguments.glob, arguments.target)
        return
    smoke = arguments.smoke
    docs = arguments.docs or (SMOKE_DOCS if smoke else 2_000_000)
    repeats = arguments.repeats or (1 if smoke else 3)
    chosen = tuple(name for name in arguments.contenders.split(",") if name)
    unknown = sorted(set(chosen) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"--contenders: unknown {', '.join(unknown)}; use {', '.join(CONTENDERS)}")
    contenders = runnable_contenders(chosen, PEERS, smoke)
    with scratch_directory(arguments.out or (None if smoke else DEFAULT_OUT), "flow-bench-") as out:
        meta = ensure_input(out, docs)
        runs = benchmark(out, contenders, repeats, arguments.keel_python)
        summary = {name: medians(runs[name], meta["docs"]) for name in contenders}
        record = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": versions(contenders),
            "keel_python": arguments.keel_python or sys.executable,
            "input": meta,
            "summary": summary,
            "runs": runs,
        }
        (out / "results.json").write_text(json.dumps(record, indent=1))
    print(f"\n{versions(contenders)}")
    if arguments.keel_python:
        print(f"keel's contenders ran with {arguments.keel_python}")
    print(
        f"input: {meta['docs']:,} docs ({meta['unique']:,} unique), "
        f"{meta['text_bytes'] / MB:,.0f} MB of text, {meta['file_bytes'] / MB:,.0f} MB of Parquet"
    )
    print(f"medians of {repeats} runs:\n\n{table(summary)}\n\n{ratios(summary)}")
    if smoke:
        print("(a smoke run: it checks that the benchmark works; its input is too small to judge)")


if __name__ == "__main__":
    main()
