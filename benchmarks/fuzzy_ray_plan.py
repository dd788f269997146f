"""Fuzzy dedup on Ray: per-worker figures measured on this machine, and the 1 TB plan they give.

    python benchmarks/fuzzy_ray_plan.py [--documents 100000] [--workers 2] [--terabytes 1]
    python benchmarks/fuzzy_ray_plan.py --smoke   # the bundled sample, plan printed (CI)

What it does:
1. Builds a document set as benchmarks/dedup_bench.py does (WikiText-2 and Python docs
   originals, spliced originals beyond them, planted near copies and hard negatives: ~30% of
   the documents are near duplicates), without its ground truth, and writes it as --files zstd
   Parquet parts.
2. Starts Ray in this process with --workers cpus (keel.flow's RayBackend), warms its workers up
   with a tiny flow (their imports), then times `run_fuzzy_dedup` over the set on that backend,
   phase by phase: the functions of keel/data/fuzzy.py that run_fuzzy_dedup calls are wrapped
   and timed, and keel.flow's stage lines (rows in and out, bytes spilled to the shuffle) are
   captured from its debug log.
3. Prints the phases (seconds; worker-seconds per million documents for the phases that run on
   the workers, seconds per million for the driver's), the shuffle bytes per document, the
   fraction of documents that are LSH candidates, and the driver's peak memory; then the plan
   for --terabytes of text (UTF-8 bytes of the `text` column, the usual way a corpus is sized):
   documents at this set's mean size, worker-hours per phase, shuffle bytes, and hours on 64,
   256 and 1,024 workers, with what does not scale (the driver's phases) named.

The plan is linear extrapolation from one run: per-document costs stay flat as the set grows
(measured: docs/benchmarks.md, the curve to 300,000 documents), and the driver's share is
reported separately because it is the part that does not spread over workers.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import resource
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import dedup_bench  # beside this script (run as `python benchmarks/fuzzy_ray_plan.py`)
import pyarrow as pa
import pyarrow.compute as pc

PHASES = {
    "find_buckets": "pass 1: read, signatures, band keys, band shuffle",
    "candidate_groups": "candidates numbered, buckets' components (driver)",
    "verify_candidates": "pass 2: candidates reread, shingled, verified in the reducers",
    "write": "kept documents filtered and written (and sources counted), side tables, commit",
}
DRIVER_PHASES = ("candidate_groups",)
WORKER_COUNTS = (64, 256, 1024)
STAGE_LINE = re.compile(
    r"stage \d+ \((?P<name>.*)\): \d+ tasks, (?P<rows_in>\d+) rows in, (?P<rows_out>\d+) out, "
    r"(?P<spilled>\d+) bytes spilled"
)


class StageLines(logging.Handler):
    """keel.flow's per-stage debug lines, parsed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.stages: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = STAGE_LINE.search(record.getMessage())
        if match:
            fields = match.groupdict()
            self.stages.append({k: v if k == "name" else int(v) for k, v in fields.items()})


def timed_phases(module) -> tuple[dict[str, float], dict[str, int]]:
    """Wrap the phases of keel.data.fuzzy that run_fuzzy_dedup calls. Returns the dict their
    seconds land in and the dict of what the driver collects: the buckets' members, places
    in the input (`bucket_members`, each distinct bucket once;
    `candidates`: distinct places) and the removals the reducers send back (`removed_rows`,
    `removed_bytes`: removed.parquet's and evidence.parquet's rows)."""
    seconds: dict[str, float] = defaultdict(float)
    collected: dict[str, int] = {}

    def note(name: str, result) -> None:
        if name == "find_buckets":
            chunks = result.chunks if isinstance(result, pa.ChunkedArray) else [result]
            flat = pa.chunked_array([chunk.flatten() for chunk in chunks], result.type.value_type)
            collected["bucket_members"] = len(flat)
            collected["candidates"] = len(pc.unique(flat))
        elif name == "verify_candidates":
            collected["removed_rows"] = result.removed.num_rows
            collected["removed_bytes"] = result.removed.nbytes + result.evidence.nbytes

    for name in PHASES:
        if name == "write":
            continue
        original = getattr(module, name)

        @functools.wraps(original)
        def wrapper(*args, _original=original, _name=name, **kwargs):
            began = time.perf_counter()
            try:
                result = _original(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - began
            note(_name, result)
            return result

        setattr(module, name, wrapper)
    return seconds, collected


def measure(source: Path, work: Path, workers: int) -> dict:
    """One timed run of run_fuzzy_dedup on a warmed-up Ray backend of `workers` cpus."""
    from keel.data import fuzzy
    from keel.flow import RunOptions, from_items
    from keel.flow.backends.ray import RayBackend

    began = time.perf_counter()
    backend = RayBackend(workers=workers)  # Ray's files under RAY_TMPDIR (main: a short path)
    warm = from_items([{"n": n} for n in range(4 * workers)], num_shards=2 * workers)
    warm.map(dedup_bench._import_fuzzy).count(backend=backend)
    ray_start = time.perf_counter() - began
    seconds, collected = timed_phases(fuzzy)
    lines = StageLines()
    flow_log = logging.getLogger("keel.flow")
    flow_log.addHandler(lines)
    flow_log.setLevel(logging.DEBUG)
    try:
        began = time.perf_counter()
        report = fuzzy.run_fuzzy_dedup(
            str(source),
            str(work / "out"),
            fuzzy.FuzzyDedupConfig(max_source_drop=dedup_bench.KEEL_MAX_SOURCE_DROP),
            RunOptions(backend=backend),
        )
        total = time.perf_counter() - began
    finally:
        flow_log.removeHandler(lines)
        backend.close()
    seconds["write"] = total - sum(seconds.values())
    return {
        "ray_start_s": ray_start,
        "total_s": total,
        "phases_s": dict(seconds),
        "stages": lines.stages,
        "collected": collected,
        "removed": sum(report.dropped.values()),
        "driver_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def plan(
    run: dict, documents: int, text_bytes: int, parquet_bytes: int, workers: int, terabytes: float
) -> dict:
    """The measured run, per document, scaled to `terabytes` of text. A workers' phase costs
    `workers` x its seconds of cpu (its driver-side collection included: an upper bound), a
    driver's phase its seconds."""
    scale = terabytes * 1e12 / text_bytes  # target documents per measured document
    target_docs = documents * scale
    spilled = sum(stage["spilled"] for stage in run["stages"])
    phases = {}
    for name, seconds in run["phases_s"].items():
        on_workers = name not in DRIVER_PHASES
        cpu_seconds = seconds * (workers if on_workers else 1)
        phases[name] = {
            "seconds": seconds,
            "where": "workers" if on_workers else "driver",
            "cpu_s_per_million_docs": cpu_seconds / documents * 1e6,
            "target_hours": cpu_seconds * scale / 3600,
        }
    worker_hours = sum(p["target_hours"] for p in phases.values() if p["where"] == "workers")
    driver_hours = sum(p["target_hours"] for p in phases.values() if p["where"] == "driver")
    collected = run["collected"]
    return {
        "documents": documents,
        "text_bytes": text_bytes,
        "parquet_bytes": parquet_bytes,
        "mean_text_bytes": text_bytes / documents,
        "target_terabytes": terabytes,
        "target_documents": target_docs,
        "target_parquet_terabytes": terabytes * parquet_bytes / text_bytes,
        "shuffle_bytes_per_doc": spilled / documents,
        "target_shuffle_terabytes": spilled * scale / 1e12,
        "candidate_fraction": collected.get("candidates", 0) / documents,
        "target_candidates": collected.get("candidates", 0) * scale,
        "target_bucket_members": collected.get("bucket_members", 0) * scale,
        "target_driver_removed_terabytes": collected.get("removed_bytes", 0) * scale / 1e12,
        "phases": phases,
        "worker_hours": worker_hours,
        "driver_hours": driver_hours,
        "hours_on": {n: worker_hours / n + driver_hours for n in WORKER_COUNTS},
    }


def render(run: dict, result: dict, workers: int) -> str:
    collected = run["collected"]
    lines = [
        f"{result['documents']:,} documents, {result['text_bytes'] / 1e6:,.1f} MB of text "
        f"({result['mean_text_bytes']:,.0f} bytes each), {result['parquet_bytes'] / 1e6:,.1f} MB "
        f"of zstd Parquet; Ray on {workers} cpus (start and warm-up {run['ray_start_s']:.1f} s, "
        f"not in the phases); run {run['total_s']:.2f} s, {run['removed']:,} removed.",
        "",
        "| phase | where | seconds | cpu-seconds per million documents | hours for the target |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, phase in result["phases"].items():
        lines.append(
            f"| {PHASES[name]} | {phase['where']} | {phase['seconds']:.2f} | "
            f"{phase['cpu_s_per_million_docs']:,.0f} | {phase['target_hours']:,.1f} |"
        )
    stages = "; ".join(
        f"{s['name']}: {s['rows_in']:,} rows in, {s['rows_out']:,} out, "
        f"{s['spilled'] / 1e6:,.1f} MB spilled"
        for s in run["stages"]
    )
    lines += [
        "",
        f"flow stages: {stages}",
        f"the driver collected: {collected.get('bucket_members', 0):,} bucket members "
        f"({collected.get('candidates', 0):,} candidates, "
        f"{result['candidate_fraction']:.1%} of the documents), and "
        f"{collected.get('removed_rows', 0):,} removals from the reducers "
        f"({collected.get('removed_bytes', 0) / 1e6:,.1f} MB); "
        f"driver peak RSS {run['driver_peak_rss_bytes'] / 2**20:,.0f} MiB",
        "",
        f"Plan for {result['target_terabytes']:g} TB of text "
        f"({result['target_parquet_terabytes']:.2f} TB of zstd Parquet at this set's ratio): "
        f"{result['target_documents'] / 1e6:,.0f}M documents; shuffle "
        f"{result['shuffle_bytes_per_doc']:.0f} bytes a document = "
        f"{result['target_shuffle_terabytes']:.2f} TB; {result['worker_hours']:,.0f} "
        f"worker-hours, {result['driver_hours']:,.1f} hours on the driver; the driver would "
        f"collect {result['target_bucket_members'] / 1e6:,.0f}M bucket members and "
        f"{result['target_driver_removed_terabytes']:.2f} TB of removals.",
        "",
        "| workers | hours (workers' share + driver) |",
        "| ---: | ---: |",
    ]
    lines += [f"| {n:,} | {hours:,.1f} |" for n, hours in result["hours_on"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2, help="Ray cpus")
    parser.add_argument("--files", type=int, default=8, help="Parquet parts of the input")
    parser.add_argument("--terabytes", type=float, default=1.0, help="text to plan for")
    parser.add_argument("--smoke", action="store_true", help="the bundled sample, 2 files")
    args = parser.parse_args()
    if args.smoke:
        articles, args.files = dedup_bench.articles_from_sample(), 2
        rows = dedup_bench.build_labelled_set(articles, truth=False).rows
    else:
        articles = (
            dedup_bench.articles_from_wikitext(sorted(dedup_bench.WIKITEXT.glob("*.txt")))
            + dedup_bench.articles_from_pydocs()
        )
        rows = dedup_bench.build_labelled_set(articles, documents=args.documents, truth=False).rows
    # Ray's sockets live under its temporary directory and a socket path may not exceed 107
    # bytes, so Ray gets a short one of its own (a test's TMPDIR can be long).
    ray_files = tempfile.mkdtemp(prefix="keel-ray-", dir="/tmp")
    os.environ.setdefault("RAY_TMPDIR", ray_files)
    try:
        result, run = _measured_plan(rows, args)
    finally:
        shutil.rmtree(ray_files, ignore_errors=True)
    print(render(run, result, args.workers))
    print(json.dumps({"run": run, "plan": result}))


def _measured_plan(rows: list[dict], args: argparse.Namespace) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory(prefix="keel-ray-plan-") as scratch:
        source = Path(scratch) / "input"
        dedup_bench.write_documents(rows, source, files=args.files)
        text_bytes = sum(len(row["text"].encode()) for row in rows)
        parquet_bytes = sum(path.stat().st_size for path in source.glob("*.parquet"))
        run = measure(source, Path(scratch), args.workers)
    return plan(run, len(rows), text_bytes, parquet_bytes, args.workers, args.terabytes), run


if __name__ == "__main__":
    main()
