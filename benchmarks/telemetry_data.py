"""Synthetic cluster log rows: the one generator behind the telemetry benchmark and its tests.

`log_rows(n, seed, start=...)` returns an Arrow table with the columns of a cluster's log:

- ts (timestamp[us]): increasing with the row index, 1 ms apart on average (row i is at
  start + i ms + a jitter of 0-999 us, so the order is strict).
- job_id (string, `jobs` values "job-000123"): drawn per row, so the jobs' rows interleave as
  they do when many jobs log to one collector.
- level (string): TRACE, DEBUG, INFO, WARNING, ERROR, CRITICAL with a skewed distribution
  (LEVEL_WEIGHTS: mostly INFO, 0.5% CRITICAL).
- worker (string, `workers` values "w-017"): drawn per row.
- msg (string, ~80 bytes): one of a few templates of training-cluster log lines filled with
  numbers, hex ids and paths; ERROR and CRITICAL rows use error templates.

Needles: `needle="needle-7f3a9c"` appends " corr_id=needle-7f3a9c" to about `needle_rate` of the
rows (at least one). clustered=True puts them all in one job and one short time window (an
incident); clustered=False spaces them evenly over the whole table. `insert_needle` adds a
further needle to a table made here, so one table can hold a clustered and a spread one.

Everything is vectorised (numpy draws, pyarrow compute joins the string pieces) and built in
chunks of CHUNK_ROWS rows, each from its own seeded generator: the same (n, seed, start, ...)
always gives the same table. The module is imported by path (benchmarks/ is not a package).
"""

from __future__ import annotations

import datetime
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

CHUNK_ROWS = 1 << 20
NEEDLE_RATE = 1e-5
CLUSTER_WINDOW_ROWS = 2_000
"""A clustered needle's rows lie within this many consecutive rows (~2 s of log), or within
20 rows per needle row when there are more."""
LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LEVEL_WEIGHTS = (0.02, 0.15, 0.70, 0.09, 0.035, 0.005)
ERROR_LEVELS = ("ERROR", "CRITICAL")
SCHEMA = pa.schema(
    [
        ("ts", pa.timestamp("us")),
        ("job_id", pa.string()),
        ("level", pa.string()),
        ("worker", pa.string()),
        ("msg", pa.string()),
    ]
)

Field = Callable[[np.random.Generator, int], pa.Array]
"""Draws `count` values of one placeholder of a template, as strings."""


def _int(low: int, high: int) -> Field:
    """Uniform integers in [low, high]."""
    return lambda rng, count: pa.array(rng.integers(low, high + 1, count)).cast(pa.string())


def _fixed(high: int, decimals: int) -> Field:
    """Uniform numbers in [0, high) written with `decimals` digits after the point."""

    def draw(rng: np.random.Generator, count: int) -> pa.Array:
        whole = pa.array(rng.integers(0, high, count)).cast(pa.string())
        fraction = pa.array(rng.integers(0, 10**decimals, count)).cast(pa.string())
        return pc.binary_join_element_wise(whole, pc.utf8_lpad(fraction, decimals, "0"), ".")

    return draw


def _hex(width: int) -> Field:
    """Random lowercase hex strings of `width` characters."""
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)

    def draw(rng: np.random.Generator, count: int) -> pa.Array:
        text = digits[rng.integers(0, 16, (count, width), dtype=np.uint8)]
        offsets = np.arange(0, width * count + 1, width, dtype=np.int32)
        return pa.StringArray.from_buffers(
            count, pa.py_buffer(offsets), pa.py_buffer(text.tobytes())
        )

    return draw


def _pick(*choices: str) -> Field:
    values = pa.array(choices)
    return lambda rng, count: values.take(rng.integers(0, len(choices), count))


Template = Sequence[str | Field]

TEMPLATES: tuple[Template, ...] = (
    ("train step ", _int(1, 500_000), " loss=", _fixed(12, 4), " grad_norm=", _fixed(8, 3),
     " lr=", _pick("3e-4", "1e-4", "6e-5", "2.5e-4"), " tok/s=", _int(10_000, 400_000),
     " mfu=0.", _int(10, 65)),
    ("GET /v1/shards/", _hex(16), " 200 ", _int(1, 5_000_000), " bytes in ", _int(1, 900),
     " ms from 10.", _int(0, 255), ".", _int(0, 255), ".", _int(1, 254)),
    ("checkpoint shard ", _int(0, 63), "/64 saved to /ckpt/run-", _hex(8), "/step_",
     _int(0, 500_000), ".safetensors (", _int(1, 4096), " MiB)"),
    ("nccl allreduce bucket ", _int(0, 511), " size=", _int(1, 268_435_456), " bytes took ",
     _fixed(3, 3), " s on rank ", _int(0, 1023), " group=", _pick("dp", "tp", "pp", "ep")),
    ("worker heartbeat seq=", _int(0, 10_000_000), " rss=", _int(100, 80_000),
     "MiB gpu_util=", _int(0, 100), "% temp=", _int(30, 90), "C task=", _hex(12)),
    ("dataloader prefetched ", _int(1, 64), " batches from shard ", _hex(8), " queue_depth=",
     _int(0, 32), " wait=", _fixed(2, 3), "s"),
    ("scheduler placed task ", _hex(12), " on node-", _int(0, 511), " after ",
     _int(0, 60_000), " ms in queue ", _pick("default", "preempt", "eval", "batch")),
)  # fmt: skip
TEMPLATE_WEIGHTS = (0.30, 0.20, 0.03, 0.15, 0.17, 0.10, 0.05)

ERROR_TEMPLATES: tuple[Template, ...] = (
    ("retrying fetch of block ", _hex(16), " after error: connection reset by peer (attempt ",
     _int(1, 9), ")"),
    ("NaN detected in ", _pick("grad", "loss", "activations"), " at step ", _int(1, 500_000),
     " on rank ", _int(0, 1023), ", skipping batch ", _hex(8)),
    ("worker lost: node-", _int(0, 511), " exit code ", _pick("137", "139", "1", "-9"),
     " task ", _hex(12), " will be rescheduled"),
    ("CUDA error: out of memory allocating ", _int(1, 80_000), " MiB on device ", _int(0, 7),
     " (task ", _hex(12), ")"),
)  # fmt: skip


def log_rows(
    n: int,
    seed: int,
    *,
    start: datetime.datetime,
    jobs: int = 1000,
    workers: int = 200,
    needle: str | None = None,
    clustered: bool = True,
    needle_rate: float = NEEDLE_RATE,
) -> pa.Table:
    """`n` log rows (schema SCHEMA), the first at `start` (naive = UTC), ~1 ms apart; with
    `needle`, that token in ~needle_rate of the rows (see the module docstring)."""
    if n < 0 or jobs < 1 or workers < 1:
        raise ValueError(f"need n >= 0, jobs >= 1, workers >= 1 (got {n}, {jobs}, {workers})")
    if start.tzinfo is not None:
        start = start.astimezone(datetime.UTC).replace(tzinfo=None)
    origin = np.datetime64(start, "us")
    job_names = pa.array([f"job-{j:06d}" for j in range(jobs)])
    worker_names = pa.array([f"w-{w:03d}" for w in range(workers)])
    chunks = [
        _chunk(first, min(CHUNK_ROWS, n - first), seed, origin, job_names, worker_names)
        for first in range(0, n, CHUNK_ROWS)
    ]
    table = pa.Table.from_batches(chunks, schema=SCHEMA)
    if needle is not None:
        table = insert_needle(table, needle, seed, clustered=clustered, rate=needle_rate, jobs=jobs)
    return table


def insert_needle(
    table: pa.Table,
    needle: str,
    seed: int,
    *,
    clustered: bool,
    rate: float = NEEDLE_RATE,
    jobs: int = 1000,
) -> pa.Table:
    """`table` with " corr_id=<needle>" appended to the msg of ~rate of its rows; clustered:
    those rows all lie in one short window and get one job_id (one of `jobs`)."""
    positions, job = needle_rows(table.num_rows, needle, seed, clustered=clustered, rate=rate)
    if not len(positions):
        return table
    columns = {name: table.column(name) for name in table.column_names}
    tagged = pc.binary_join_element_wise(
        columns["msg"].take(positions).combine_chunks(), f" corr_id={needle}", ""
    )
    columns["msg"] = _replace_rows(columns["msg"], positions, tagged)
    if clustered:
        name = pa.array([f"job-{job % jobs:06d}"] * len(positions))
        columns["job_id"] = _replace_rows(columns["job_id"], positions, name)
    return pa.table(columns, schema=table.schema)


def needle_rows(
    n: int, needle: str, seed: int, *, clustered: bool, rate: float = NEEDLE_RATE
) -> tuple[np.ndarray, int]:
    """The sorted row indices that get `needle`, and the job number a clustered needle uses."""
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    rng = np.random.default_rng([seed, zlib.crc32(needle.encode()), 1])
    count = min(n, max(1, round(n * rate)))
    job = int(rng.integers(0, 1 << 30))
    if not clustered:
        return np.unique(np.linspace(0, n - 1, count).round().astype(np.int64)), job
    window = min(n, max(CLUSTER_WINDOW_ROWS, 20 * count))
    first = int(rng.integers(0, n - window + 1))
    chosen = np.sort(rng.choice(window, size=count, replace=False)).astype(np.int64)
    return chosen + first, job


def _chunk(
    first: int,
    count: int,
    seed: int,
    origin: np.datetime64,
    job_names: pa.Array,
    worker_names: pa.Array,
) -> pa.RecordBatch:
    """Rows first .. first+count-1, from a generator seeded by (seed, chunk number)."""
    rng = np.random.default_rng([seed, first // CHUNK_ROWS])
    index = np.arange(first, first + count, dtype=np.int64)
    micros = index * 1000 + rng.integers(0, 1000, count)
    ts = pa.array(origin + micros.astype("timedelta64[us]"), type=pa.timestamp("us"))
    level_index = rng.choice(len(LEVELS), size=count, p=LEVEL_WEIGHTS)
    level = pa.array(LEVELS).take(level_index)
    error = np.isin(level_index, [LEVELS.index(name) for name in ERROR_LEVELS])
    template = np.where(
        error,
        len(TEMPLATES) + rng.integers(0, len(ERROR_TEMPLATES), count),
        rng.choice(len(TEMPLATES), size=count, p=TEMPLATE_WEIGHTS),
    )
    return pa.record_batch(
        [
            ts,
            job_names.take(rng.integers(0, len(job_names), count)),
            level,
            worker_names.take(rng.integers(0, len(worker_names), count)),
            _messages(rng, template),
        ],
        schema=SCHEMA,
    )


def _messages(rng: np.random.Generator, template: np.ndarray) -> pa.Array:
    """Each row's message from its template number (TEMPLATES, then ERROR_TEMPLATES)."""
    every = (*TEMPLATES, *ERROR_TEMPLATES)
    order = np.argsort(template, kind="stable")
    counts = np.bincount(template, minlength=len(every))
    pieces = []
    for number, parts in enumerate(every):
        if counts[number]:
            filled = [p if isinstance(p, str) else p(rng, int(counts[number])) for p in parts]
            pieces.append(pc.binary_join_element_wise(*filled, ""))
    grouped = pa.concat_arrays(pieces)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return grouped.take(inverse)


def _replace_rows(
    column: pa.ChunkedArray, positions: np.ndarray, values: pa.Array
) -> pa.ChunkedArray:
    """`column` with row positions[i] set to values[i] (positions sorted)."""
    chunks = []
    offset = 0
    for chunk in column.chunks:
        low, high = np.searchsorted(positions, [offset, offset + len(chunk)])
        if high > low:
            mask = np.zeros(len(chunk), dtype=bool)
            mask[positions[low:high] - offset] = True
            chunk = pc.replace_with_mask(chunk, pa.array(mask), values[low:high])
        chunks.append(chunk)
        offset += len(chunk)
    return pa.chunked_array(chunks, type=column.type)
