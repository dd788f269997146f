"""The Arrow allocator of flow's processes: jemalloc, keeping freed pages for ~10 seconds.

Every flow process (the coordinator and its workers) allocates Arrow memory from jemalloc with
jemalloc's own decay time (10 s) instead of pyarrow's choices (mimalloc by default; jemalloc
with a 1 s decay when asked for). A task frees its batches and the next one allocates the same
sizes again; with pages kept, the next task reuses them instead of faulting fresh ones in, which
on a VM costs far more than the arithmetic on them. Measured on 2M documents of exact dedup
(docs/benchmarks.md): the workers' page faults fell from ~1.2M to ~0.85M, standalone runs from
9.1-10.4 s to 8.3-8.9 s, and the benchmark's ratio to polars from 1.86x to 1.46x. mimalloc,
pyarrow's default, backs its arenas with transparent huge pages: the first read of a 59 MB
Parquet file spent 3 s of system time zeroing them. The system allocator returns large blocks
at once and faults them in again on the next batch. The decay matters: at pyarrow's 1 s the
same workers faulted 1.2-1.3M times and the run took 9.2-10.4 s, against 0.83M and 8.7 s at 10 s
(alternated runs). Buffers of tens of MB go back at once at any finite decay (368 MB freed in
32 MB buffers: resident memory back to its start at 1, 10 and 30 s alike); what the longer decay
keeps are the smaller blocks a batch allocates. No decay at all halved the faults again but
let a reducer's resident memory grow past its bound (tests/flow/test_memory.py: +94 MB against
+68 MB at 10 s and +61 MB with the system allocator, for a 40 MB budget and an 80 MB bound).

A process whose environment names a pool (ARROW_DEFAULT_MEMORY_POOL) keeps it, and a pyarrow
built without jemalloc keeps its default.
"""

from __future__ import annotations

import functools
import os

POOL_VARIABLE = "ARROW_DEFAULT_MEMORY_POOL"
JEMALLOC_VARIABLE = "JE_ARROW_MALLOC_CONF"
"""Read by the jemalloc that pyarrow bundles when it starts (its MALLOC_CONF)."""
JEMALLOC_SETTINGS = "dirty_decay_ms:10000,muzzy_decay_ms:10000"


def worker_environment() -> dict[str, str]:
    """The variables a worker process needs for flow's allocator (empty where this process's
    environment chose a pool itself, or pyarrow has no jemalloc)."""
    if POOL_VARIABLE in os.environ or not _has_jemalloc():
        return {}
    return {POOL_VARIABLE: "jemalloc", JEMALLOC_VARIABLE: os.environ[JEMALLOC_VARIABLE]}


@functools.cache
def use_in_this_process() -> None:
    """Make jemalloc, with flow's decay, this process's default Arrow pool (once; buffers the
    previous pool allocated stay with it). Nothing where the environment chose a pool."""
    if worker_environment():
        import pyarrow as pa

        pa.set_memory_pool(pa.jemalloc_memory_pool())


@functools.cache
def _has_jemalloc() -> bool:
    """Whether pyarrow has jemalloc. Asking may start this process's jemalloc, which reads its
    settings then: flow's decay goes into the environment first (a user's own settings win)."""
    os.environ.setdefault(JEMALLOC_VARIABLE, JEMALLOC_SETTINGS)
    import pyarrow as pa

    try:
        pa.jemalloc_memory_pool()
    except NotImplementedError:
        return False
    return True
