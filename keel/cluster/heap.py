"""The controller process's garbage collector: a big, stable heap, scanned rarely.

A controller keeps every active job in memory (~100,000 objects at 10,000 queued jobs) and makes
a few thousand short-lived objects a tick, nearly all freed by reference counting. With CPython's
default thresholds (700, 10, 10) the young generation is collected several times a tick and the
whole heap every few dozen ticks: at 10,000 queued jobs ~1-2 ms of a median tick and ~5 ms on
average (docs/benchmarks.md, "cluster: controller tick latency"). So once the controller has
loaded its state it freezes what is alive (`gc.freeze`: never scanned again; a frozen object is
still freed when its last reference goes) and raises the young generation's threshold to YOUNG
allocations. Reference cycles are still collected, less often: at most ~YOUNG tracked objects of
garbage wait for it (a few MB). There is no collection before the freeze (it took ~20 ms in a
process that had imported the CLI's modules, paid by every embedded controller's start): cycles
already unreachable then are kept for good, a bounded one-time cost.

These are settings of the whole process, made by its long-lived part: the controller of
`keel cluster start` or the one a `keel job run` embeds.
"""

from __future__ import annotations

import gc

YOUNG = 50_000  # allocations of tracked objects (net) between young-generation collections


def settle() -> None:
    """Freeze what is alive now and raise the young threshold (never lowering it)."""
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG), middle, old)
