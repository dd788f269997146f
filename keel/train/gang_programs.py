"""A gang's programs: compiled once, by process 0, and loaded by every other process before any
of them runs one.

A jitted program that holds collectives (the update step, evaluation) runs only once every
process of the gang has it. On CPUs JAX keys a cached program by its process's own topology (the
fingerprint differs per process for the same global devices) and writes entries from process 0
only, so process 0 loads from keel's compilation cache what every other process compiles again,
and a cold gang compiles every program once per process: on 2 cores the README's 2-process
tiny-moe line spent ~30 s with both processes compiling side by side, ~86 CPU-seconds in all.
The fast process then waits inside its first collective, where gloo gives up on a peer after
30 s. JAX's own `jax_share_binary_between_hosts` cannot help: it shares under the cache key, which
differs per process on CPUs, so a process would wait for a key nobody writes.

`compiled_in_step(fn, name)` wraps a jitted function for a gang. The first call with each new
signature (argument shapes, dtypes and shardings): process 0 compiles it ahead of time
(`fn.lower(...).compile()`, through the compilation cache), serializes the executable
(jax.experimental.serialize_executable) and puts it, compressed, in the key-value store of JAX's
coordination service; every other process reads it from there and loads it. A barrier of the
same service (orbax's sync_global_processes with an explicit process set: the store, not a
collective) then lets them all go on together. Each process calls its own loaded program from
then on. The executable is the same SPMD program for every process (the device assignment is
global), so loading process 0's is what compiling it again would give.

On other platforms JAX's cache keys agree across processes, so each process compiles (or loads
from a shared cache) as before, and waits at the same barrier. A process alone gets `fn` back
unchanged.
"""

from __future__ import annotations

import functools
import itertools
import logging
import pickle
import zlib
from collections.abc import Callable
from typing import Any

import jax

logger = logging.getLogger(__name__)

COMPILE_BARRIER_TIMEOUT_S = 3600
"""How long a process waits for process 0's program and for the others to load it (large models
on GPUs compile for minutes)."""
_BARRIERS = itertools.count()
"""Barrier and key names are used once: every process numbers its compilations in the same
order."""


def compiled_in_step(fn: Callable, name: str) -> Callable:
    """`fn` (a jitted function) for this process's gang: each new signature compiled (on CPUs by
    process 0 alone, then loaded by the others) before any process runs it; `fn` itself when the
    process is alone."""
    if jax.process_count() == 1:
        return fn
    from orbax.checkpoint import multihost

    processes = set(range(jax.process_count()))
    programs: dict[Any, Callable] = {}  # by signature

    def call(*args: Any) -> Any:
        leaves, structure = jax.tree.flatten(args)
        signature = (structure, tuple(_abstract(leaf) for leaf in leaves))
        program = programs.get(signature)
        if program is None:
            number = next(_BARRIERS)
            program, how = _gang_program(fn, args, f"keel-program-{name}-{number}")
            barrier = f"keel-compiled-{name}-{number}"
            logger.debug("%s: %s, waiting for the gang at %s", name, how, barrier)
            multihost.sync_global_processes(
                barrier, timeout=COMPILE_BARRIER_TIMEOUT_S, processes=processes
            )
            programs[signature] = program
        return program(*args)

    return call


def _gang_program(fn: Callable, args: tuple, key: str) -> tuple[Callable, str]:
    """`fn` compiled for `args`, and how this process got it: on CPUs process 0's executable,
    shared under `key`; a process compiles its own when process 0 loaded its copy from the
    compilation cache (an executable read from the cache does not serialize whole on XLA:CPU:
    "Function ... not found" when it runs), and on other platforms."""
    if jax.devices()[0].platform != "cpu":
        return fn.lower(*args).compile(), "compiled"
    from jax._src import distributed  # the coordination service's key-value store
    from jax.experimental.serialize_executable import deserialize_and_load, serialize

    client = distributed.global_state.client
    if client is None:  # a gang not made by jax.distributed.initialize: nothing to share through
        return fn.lower(*args).compile(), "compiled"
    if jax.process_index() == 0:
        hits = _cache_hits()
        compiled = fn.lower(*args).compile()
        fresh = _cache_hits() == hits
        shared = zlib.compress(pickle.dumps(serialize(compiled)), 1) if fresh else b""
        client.key_value_set_bytes(key, shared)
        if not fresh:
            return compiled, "loaded from the compilation cache"
        return compiled, f"compiled and shared ({len(shared) / 2**20:.1f} MiB)"
    shared = client.blocking_key_value_get_bytes(key, COMPILE_BARRIER_TIMEOUT_S * 1000)
    if not shared:
        return fn.lower(*args).compile(), "compiled (process 0 had it cached)"
    payload, in_tree, out_tree = pickle.loads(zlib.decompress(shared))
    return deserialize_and_load(payload, in_tree, out_tree), "loaded process 0's program"


CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
"""The jax.monitoring event JAX records when a program is loaded from the compilation cache."""
_hit_count = [0]


@functools.cache
def _listen_for_cache_hits() -> None:
    def count(event: str, **_: Any) -> None:
        if event == CACHE_HIT_EVENT:
            _hit_count[0] += 1

    jax.monitoring.register_event_listener(count)


def _cache_hits() -> int:
    """Programs this process has loaded from the compilation cache since it started listening."""
    _listen_for_cache_hits()
    return _hit_count[0]


def _abstract(leaf: Any) -> Any:
    """What a program is compiled for of one argument: shape, dtype and sharding of an array
    (a NumPy array has no sharding), the type of a Python scalar."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return (leaf.shape, leaf.dtype, getattr(leaf, "sharding", None))
    return type(leaf)
