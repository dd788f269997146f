"""The telemetry store against DuckDB over plain Parquet: ingest, indexed queries, index size.

What it measures, in one run on this machine, on --rows synthetic cluster log rows from
benchmarks/telemetry_data.py (ts, job_id, level, worker, msg of ~80 bytes; 1000 jobs interleaved;
two needles of ~1e-5 of the rows each: CLUSTERED_NEEDLE in one job and a ~2 s window, SPREAD_NEEDLE
evenly over the whole table). The two tokens share no word: were the spread one also "needle-...",
its rows would put the clustered one's rarest trigrams into nearly every row group (the hex
suffix's trigrams are in every row group anyway), and no index could tell them apart.

1. Ingest through the client, in batches of BATCH_ROWS rows, into a fresh store with the default
   StoreOptions: in-process (TelemetryStore.write) and over HTTP (TelemetryServer on 127.0.0.1 and
   HttpTelemetry, one connection). Reported: the ack rate (rows / seconds until the last write
   returned; a write returns when its rows are durable in the WAL), the seconds from the first
   write until store.flush() returned (every row in a segment), and until store.wait_idle()
   returned (background work done). Baseline: pyarrow writing the same rows as the plain files.
2. Queries: each in QUERIES on the store (store.query) and on DuckDB (`duckdb.sql`, the default
   connection) over read_parquet of the plain files: the same rows written by pyarrow in arrival
   order, zstd, FILE_ROWS rows per file (the store's flush size) and the store's row group size.
   One untimed run of each checks that both return the same rows (compared sorted), then
   --repeats timed runs, interleaved store / DuckDB; the medians are reported with their ratio
   and the target. The store is queried as ingest left it (segments of ~flush_rows rows), and again
   after compaction. With --alternate N, a second, steadier measurement follows in the same
   process on the same store (before compaction): N rounds, each running every query once on the
   store and once on DuckDB, the side that goes first alternating from round to round; reported
   per query: both medians, their ratio and the median of the per-round ratios. Under a shared
   machine's changing load a round's two runs see nearly the same load, which the headline's
   medians of separate runs do not guarantee.
3. Index size: the sidecar indexes (.idx) of the live segments as a share of their Parquet bytes,
   after ingest and after store.compact().

Everything lives in a temporary directory under /tmp, removed at the end.

    python benchmarks/telemetry_bench.py [--rows 10000000] [--repeats 5] [--alternate 31] [--json]
    python benchmarks/telemetry_bench.py --smoke   # 20,000 rows, one run each: seconds, for CI

Prints Markdown tables to stdout (--json: one JSON document instead); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import duckdb
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import telemetry_data

from keel.telemetry.manifest import load_manifest
from keel.telemetry.segment import index_path, segment_path
from keel.telemetry.store import StoreOptions, TelemetryStore

SEED = 20240501
START = datetime.datetime(2024, 5, 1)
NAMESPACE = "cluster.logs"
CLUSTERED_NEEDLE = "needle-7f3a9c"
SPREAD_NEEDLE = "marker-5be21d"
BATCH_ROWS = 100_000
DEFAULTS = StoreOptions()
FILE_ROWS = DEFAULTS.flush_rows
MB = 1_000_000
SMOKE_ROWS = 20_000

QUERIES: dict[str, tuple[str, str]] = {
    # name: (SQL with {table} and {time_window}, target)
    "LIKE clustered needle": (
        f"SELECT * FROM {{table}} WHERE msg LIKE '%{CLUSTERED_NEEDLE}%'",
        ">= 5x faster",
    ),
    "LIKE spread needle": (
        f"SELECT * FROM {{table}} WHERE msg LIKE '%{SPREAD_NEEDLE}%'",
        "<= 1.1x slower",
    ),
    "job_id = one job": ("SELECT * FROM {table} WHERE job_id = 'job-000123'", "faster"),
    "count(*) GROUP BY level": (
        "SELECT level, count(*) AS n FROM {table} GROUP BY level",
        "faster",
    ),
    "time range + level": (
        "SELECT * FROM {table} WHERE {time_window} AND level = 'ERROR'",
        "no slower",
    ),
}
TARGETS: dict[str, Callable[[float], bool]] = {
    ">= 5x faster": lambda ratio: ratio <= 1 / 5,
    "<= 1.1x slower": lambda ratio: ratio <= 1.1,
    "faster": lambda ratio: ratio < 1.0,
    "no slower": lambda ratio: ratio <= 1.0,
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- data ------------------------------------------------------------------------------------


def make_rows(rows: int) -> pa.Table:
    table = telemetry_data.log_rows(rows, SEED, start=START, needle=CLUSTERED_NEEDLE)
    return telemetry_data.insert_needle(table, SPREAD_NEEDLE, SEED, clustered=False)


def write_plain(table: pa.Table, directory: Path) -> dict:
    """The rows as plain Parquet files (arrival order, zstd, the store's row group size)."""
    directory.mkdir(parents=True)
    started = time.perf_counter()
    for number, offset in enumerate(range(0, table.num_rows, FILE_ROWS)):
        pq.write_table(
            table.slice(offset, FILE_ROWS),
            directory / f"part-{number:04d}.parquet",
            compression="zstd",
            row_group_size=DEFAULTS.row_group_rows,
        )
    seconds = time.perf_counter() - started
    files = sorted(directory.glob("*.parquet"))
    return {
        "files": len(files),
        "bytes": sum(path.stat().st_size for path in files),
        "write_seconds": seconds,
        "rows_per_second": table.num_rows / seconds,
    }


# -- ingest ----------------------------------------------------------------------------------


def ingest(store: TelemetryStore, write: Callable[[str, pa.Table], int], table: pa.Table) -> dict:
    """Write `table` in batches with `write`, then flush `store` and wait for it to be idle."""
    started = time.perf_counter()
    for offset in range(0, table.num_rows, BATCH_ROWS):
        batch = table.slice(offset, BATCH_ROWS)
        written = write(NAMESPACE, batch)
        if written != batch.num_rows:
            raise SystemExit(f"write returned {written} for a batch of {batch.num_rows} rows")
    acked = time.perf_counter() - started
    store.flush()
    flushed = time.perf_counter() - started
    store.wait_idle()
    idle = time.perf_counter() - started
    stored = store.query(f'SELECT count(*) AS n FROM "{NAMESPACE}"').column("n")[0].as_py()
    if stored != table.num_rows:
        raise SystemExit(
            f"the store holds {stored:,} rows after ingest, expected {table.num_rows:,}"
        )
    return {
        "ack_seconds": acked,
        "ack_rows_per_second": table.num_rows / acked,
        "flushed_seconds": flushed,
        "idle_seconds": idle,
    }


def ingest_http(root: Path, table: pa.Table) -> dict | str:
    """Ingest over HTTP into a store at `root`; a message instead when the server is missing."""
    try:
        from keel.telemetry.client import HttpTelemetry
        from keel.telemetry.server import TelemetryServer
    except ImportError as error:
        return f"skipped: the HTTP server or client is not available ({error})"
    with TelemetryStore(root) as store:
        server = TelemetryServer(store)
        server.start()
        try:
            client = HttpTelemetry(server.url)
            return ingest(store, client.write, table)
        finally:
            server.stop()


# -- queries ---------------------------------------------------------------------------------


def time_window(rows: int) -> str:
    """A window over 5% of the rows' time span, in the middle (rows are ~1 ms apart)."""
    low = START + datetime.timedelta(milliseconds=rows * 0.45)
    high = START + datetime.timedelta(milliseconds=rows * 0.50)
    return (
        f"ts >= TIMESTAMP '{low.isoformat(sep=' ')}' AND ts < TIMESTAMP '{high.isoformat(sep=' ')}'"
    )


def sql_for(name: str, table: str, rows: int) -> str:
    return QUERIES[name][0].format(table=table, time_window=time_window(rows))


def same_rows(got: pa.Table, expected: pa.Table) -> str | None:
    """None if both hold the same rows (in any order) under the same column names, else why not."""
    if got.column_names != expected.column_names:
        return f"columns {got.column_names}, expected {expected.column_names}"
    if got.num_rows != expected.num_rows:
        return f"{got.num_rows:,} rows, expected {expected.num_rows:,}"

    def rows_of(table: pa.Table) -> list[tuple]:
        columns = [column.to_pylist() for column in table.columns]
        return sorted(zip(*columns, strict=True), key=lambda row: [(v is None, v) for v in row])

    return None if rows_of(got) == rows_of(expected) else "the same number of rows, other values"


def run_queries(store: TelemetryStore, plain_glob: str, rows: int, repeats: int) -> dict:
    """Per query: the rows returned, the store's and DuckDB's median seconds."""
    results = {}
    for name in QUERIES:
        ours = sql_for(name, f'"{NAMESPACE}"', rows)
        theirs = sql_for(name, f"read_parquet('{plain_glob}')", rows)
        got, expected = store.query(ours), duckdb.sql(theirs).to_arrow_table()
        problem = same_rows(got, expected)
        if problem:
            raise SystemExit(f"{name}: the store's result differs from DuckDB's: {problem}")
        store_seconds, duckdb_seconds = [], []
        for _ in range(repeats):
            store_seconds.append(_timed(lambda sql=ours: store.query(sql)))
            duckdb_seconds.append(_timed(lambda sql=theirs: duckdb.sql(sql).to_arrow_table()))
        results[name] = {
            "rows": got.num_rows,
            "store_seconds": statistics.median(store_seconds),
            "duckdb_seconds": statistics.median(duckdb_seconds),
            "expected": expected,
        }
        log(
            f"{name}: {got.num_rows:,} rows, store {results[name]['store_seconds'] * 1e3:.1f} ms, "
            f"DuckDB {results[name]['duckdb_seconds'] * 1e3:.1f} ms"
        )
    return results


def alternate_queries(store: TelemetryStore, plain_glob: str, rows: int, rounds: int) -> dict:
    """Per query: the store's and DuckDB's median seconds over `rounds` rounds, and the median
    of the per-round ratios store / DuckDB; in each round every query runs once on each side,
    the store first in even rounds, DuckDB first in odd ones."""
    runs: dict[str, dict[str, Callable[[], object]]] = {}
    for name in QUERIES:
        ours = sql_for(name, f'"{NAMESPACE}"', rows)
        theirs = sql_for(name, f"read_parquet('{plain_glob}')", rows)
        runs[name] = {
            "store": lambda sql=ours: store.query(sql),
            "duckdb": lambda sql=theirs: duckdb.sql(sql).to_arrow_table(),
        }
    seconds = {name: {"store": [], "duckdb": []} for name in QUERIES}
    for round_number in range(rounds):
        sides = ("store", "duckdb") if round_number % 2 == 0 else ("duckdb", "store")
        for name in QUERIES:
            for side in sides:
                seconds[name][side].append(_timed(runs[name][side]))
    results = {}
    for name, both in seconds.items():
        ratios = [s / d for s, d in zip(both["store"], both["duckdb"], strict=True)]
        result = {
            "store_seconds": statistics.median(both["store"]),
            "duckdb_seconds": statistics.median(both["duckdb"]),
            "median_round_ratio": statistics.median(ratios),
        }
        result["ratio"] = result["store_seconds"] / result["duckdb_seconds"]
        results[name] = result
        log(
            f"{name}, {rounds} alternating rounds: store {result['store_seconds'] * 1e3:.1f} ms, "
            f"DuckDB {result['duckdb_seconds'] * 1e3:.1f} ms, ratio {result['ratio']:.2f} "
            f"(median per round {result['median_round_ratio']:.2f})"
        )
    return results


def rerun_store(store: TelemetryStore, previous: dict, rows: int, repeats: int) -> dict[str, float]:
    """The store's median seconds per query (checked against DuckDB's earlier results)."""
    seconds = {}
    for name in QUERIES:
        sql = sql_for(name, f'"{NAMESPACE}"', rows)
        problem = same_rows(store.query(sql), previous[name]["expected"])
        if problem:
            raise SystemExit(f"{name} after compaction differs from DuckDB's result: {problem}")
        seconds[name] = statistics.median(
            _timed(lambda sql=sql: store.query(sql)) for _ in range(repeats)
        )
        log(f"{name} after compaction: store {seconds[name] * 1e3:.1f} ms")
    return seconds


def _timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


# -- index size ------------------------------------------------------------------------------


def index_size(root: Path) -> dict:
    """Bytes of the live segments' Parquet files and sidecar indexes, and their counts."""
    directory = root / NAMESPACE
    manifest = load_manifest(directory)
    if manifest is None:
        raise SystemExit(f"no manifest in {directory}")
    segments = directory / "segments"
    parquet = sum(segment_path(segments, s.name).stat().st_size for s in manifest.segments)
    index = sum(index_path(segments, s.name).stat().st_size for s in manifest.segments)
    return {
        "segments": len(manifest.segments),
        "row_groups": sum(s.row_groups for s in manifest.segments),
        "parquet_bytes": parquet,
        "index_bytes": index,
        "index_percent": 100 * index / parquet,
    }


# -- the run ---------------------------------------------------------------------------------


def benchmark(rows: int, repeats: int, work: Path, alternate: int = 0) -> dict:
    started = time.perf_counter()
    table = make_rows(rows)
    log(f"generated {rows:,} rows in {time.perf_counter() - started:.1f} s")
    plain = write_plain(table, work / "plain")
    log(f"plain Parquet: {plain['files']} files, {plain['bytes'] / MB:,.0f} MB")

    record: dict = {"rows": rows, "repeats": repeats, "alternate": alternate, "plain": plain}
    with TelemetryStore(work / "store") as store:
        record["ingest_in_process"] = ingest(store, store.write, table)
        log(f"in-process ingest: {record['ingest_in_process']}")
        http = ingest_http(work / "store-http", table)
        shutil.rmtree(work / "store-http", ignore_errors=True)
        record["ingest_http"] = http
        log(f"HTTP ingest: {http}")
        del table

        record["index_after_ingest"] = index_size(work / "store")
        queries = run_queries(store, str(work / "plain" / "*.parquet"), rows, repeats)
        if alternate:
            record["alternating"] = alternate_queries(
                store, str(work / "plain" / "*.parquet"), rows, alternate
            )

        started = time.perf_counter()
        store.compact()
        store.wait_idle()
        record["compact_seconds"] = time.perf_counter() - started
        record["index_after_compact"] = index_size(work / "store")
        compacted = rerun_store(store, queries, rows, repeats)

    record["queries"] = {
        name: {
            "sql": QUERIES[name][0],
            "rows": result["rows"],
            "store_seconds": result["store_seconds"],
            "duckdb_seconds": result["duckdb_seconds"],
            "ratio": result["store_seconds"] / result["duckdb_seconds"],
            "store_seconds_after_compact": compacted[name],
            "target": QUERIES[name][1],
            "met": _met(name, result["store_seconds"] / result["duckdb_seconds"]),
        }
        for name, result in queries.items()
    }
    return record


def _met(name: str, ratio: float) -> bool | None:
    target = QUERIES[name][1]
    return TARGETS[target](ratio) if target in TARGETS else None


def report(record: dict) -> str:
    rows = record["rows"]
    lines = [
        f"{record['machine']}",
        "",
        f"{rows:,} log rows, median of {record['repeats']} runs",
        "",
    ]
    lines += ["| ingest (batches of 100k rows) | ack rows/s | all in segments (s) | idle (s) |"]
    lines += ["| --- | ---: | ---: | ---: |"]
    for label, key in (("in-process", "ingest_in_process"), ("HTTP", "ingest_http")):
        run = record[key]
        if isinstance(run, str):
            lines.append(f"| {label} | {run} | | |")
            continue
        lines.append(
            f"| {label} | {run['ack_rows_per_second']:,.0f} | {run['flushed_seconds']:.1f} "
            f"| {run['idle_seconds']:.1f} |"
        )
    plain = record["plain"]
    lines.append(
        f"| baseline: pyarrow, plain files | {plain['rows_per_second']:,.0f} "
        f"| {plain['write_seconds']:.1f} | |"
    )
    lines += ["", "| query | rows | store (ms) | DuckDB (ms) | store / DuckDB | target | met "]
    lines[-1] += "| store after compact (ms) |"
    lines += ["| --- | ---: | ---: | ---: | ---: | --- | --- | ---: |"]
    for name, query in record["queries"].items():
        met = {True: "yes", False: "NO", None: "-"}[query["met"]]
        lines.append(
            f"| {name} | {query['rows']:,} | {query['store_seconds'] * 1e3:.1f} "
            f"| {query['duckdb_seconds'] * 1e3:.1f} | {query['ratio']:.2f} | {query['target']} "
            f"| {met} | {query['store_seconds_after_compact'] * 1e3:.1f} |"
        )
    if record.get("alternating"):
        lines += [
            "",
            f"alternating, {record['alternate']} rounds in one process (medians)",
            "",
            "| query | store (ms) | DuckDB (ms) | store / DuckDB | median of per-round ratios |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, query in record["alternating"].items():
            lines.append(
                f"| {name} | {query['store_seconds'] * 1e3:.1f} "
                f"| {query['duckdb_seconds'] * 1e3:.1f} | {query['ratio']:.2f} "
                f"| {query['median_round_ratio']:.2f} |"
            )
    lines += ["", "| index | segments | row groups | Parquet (MB) | .idx (MB) | .idx / Parquet |"]
    lines += ["| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, key in (
        ("after ingest", "index_after_ingest"),
        ("after compact", "index_after_compact"),
    ):
        size = record[key]
        lines.append(
            f"| {label} | {size['segments']} | {size['row_groups']} "
            f"| {size['parquet_bytes'] / MB:,.1f} | {size['index_bytes'] / MB:,.2f} "
            f"| {size['index_percent']:.2f}% |"
        )
    lines.append(f"| plain files | {plain['files']} | | {plain['bytes'] / MB:,.1f} | | |")
    lines += ["", f"compaction: {record['compact_seconds']:.1f} s"]
    return "\n".join(lines)


def machine() -> str:
    memory = psutil.virtual_memory().total / 2**30
    return (
        f"{os.cpu_count()} cores, {memory:.1f} GiB RAM, Python {platform.python_version()}, "
        f"pyarrow {pa.__version__}, duckdb {duckdb.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="log rows in total")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per query")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")
    parser.add_argument(
        "--smoke", action="store_true", help=f"a tiny run ({SMOKE_ROWS:,} rows, 1 repeat) for CI"
    )
    parser.add_argument(
        "--alternate",
        type=int,
        default=0,
        metavar="N",
        help="also run N rounds alternating store and DuckDB per query, in one process",
    )
    arguments = parser.parse_args()
    if arguments.smoke:
        arguments.rows, arguments.repeats, arguments.alternate = SMOKE_ROWS, 1, 2
    work = Path(tempfile.mkdtemp(prefix="keel-telemetry-bench-", dir="/tmp"))
    try:
        record = benchmark(arguments.rows, arguments.repeats, work, arguments.alternate)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record["machine"] = machine()
    record["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    print(json.dumps(record, indent=1) if arguments.json else report(record))


if __name__ == "__main__":
    main()
