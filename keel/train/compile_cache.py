"""JAX's persistent compilation cache for keel runs: a run compiles each program once per
machine, and a later run (a resume, a rerun, the next config of a sweep) loads it from disk.

`KEEL_COMPILATION_CACHE` names the directory (a path; `off` disables the cache); by default it
is `$XDG_CACHE_HOME/keel/jax` (`~/.cache/keel/jax`). Every program is cached, however small or
quick to compile: keel's CPU runs are made of small programs. The cache is bounded (least
recently used entries evicted beyond MAX_BYTES), which also makes JAX lock the directory around
each read and write, so concurrent runs (a gang, a sweep) never read a half-written entry.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

CACHE_ENV = "KEEL_COMPILATION_CACHE"
OFF = "off"
MAX_BYTES = 4 * 2**30
"""The cache's size bound in bytes: beyond it, the least recently used entries are removed."""


def cache_directory(environ: dict[str, str] | None = None) -> Path | None:
    """The cache directory `environ` (default: os.environ) asks for; None when it is `off`."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(CACHE_ENV, "")
    if chosen == OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "keel" / "jax"


def enable_compilation_cache() -> Path | None:
    """Point JAX's persistent compilation cache at `cache_directory()`; the directory, or None
    when the cache is off. Call it before the process compiles anything: JAX decides on its
    first compilation whether the process uses the cache."""
    directory = cache_directory()
    if directory is None:
        return None
    if jax.config.jax_compilation_cache_dir == str(directory):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    logger.debug("compilation cache at %s", directory)
    return directory
