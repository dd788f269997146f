"""A gang's programs compiled by every process before any of them runs one.

A jitted program that holds collectives (the update step, evaluation) runs only once every
process of the gang has it. Processes get their programs at different speeds: on CPUs JAX keys a
cached program by its process's own topology and writes entries from process 0 only, so process 0
loads from keel's compilation cache what every other process compiles again (measured: 18 s for
process 1 of the README's 2-process tiny-moe line, ~0 s for process 0). The fast one then waits
inside its first collective, and gloo gives up on a peer after 30 s, so a slow compile (a loaded
machine, a bigger model) failed the run. Turning the cache off for gangs is no cure: every process
then compiles, which kept them in step but made that line 40 s -> 55 s on 2 cores.

`compiled_in_step(fn, name)` wraps a jitted function for a gang: the first call with each new
signature (argument shapes, dtypes and shardings) compiles it ahead of time (`fn.lower(...)
.compile()`, which jit's own cache then reuses) and waits at a barrier of JAX's coordination
service (orbax.checkpoint.multihost.sync_global_processes with an explicit process set: a
key-value store barrier, not a collective) until every process has compiled it. A process alone
gets `fn` back unchanged.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import jax

logger = logging.getLogger(__name__)

COMPILE_BARRIER_TIMEOUT_S = 3600
"""How long a process waits for the others to compile a program (large models on GPUs take
minutes)."""
_BARRIERS = itertools.count()
"""Barrier names are used once: every process numbers its compilations in the same order."""


def compiled_in_step(fn: Callable, name: str) -> Callable:
    """`fn` (a jitted function) for this process's gang: each new signature compiled by every
    process before any of them runs it; `fn` itself when the process is alone."""
    if jax.process_count() == 1:
        return fn
    from orbax.checkpoint import multihost

    processes = set(range(jax.process_count()))
    compiled: set[Any] = set()  # the signatures compiled so far

    def call(*args: Any) -> Any:
        leaves, structure = jax.tree.flatten(args)
        signature = (structure, tuple(_abstract(leaf) for leaf in leaves))
        if signature not in compiled:
            fn.lower(*args).compile()
            barrier = f"keel-compiled-{name}-{next(_BARRIERS)}"
            logger.debug("%s: compiled, waiting for the gang at %s", name, barrier)
            multihost.sync_global_processes(
                barrier, timeout=COMPILE_BARRIER_TIMEOUT_S, processes=processes
            )
            compiled.add(signature)
        return fn(*args)

    return call


def _abstract(leaf: Any) -> Any:
    """What a program is compiled for of one argument: shape, dtype and sharding of an array
    (a NumPy array has no sharding), the type of a Python scalar."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return (leaf.shape, leaf.dtype, getattr(leaf, "sharding", None))
    return type(leaf)
