"""What the benchmark scripts share: running a contender in a child process and measuring its
peak memory, the environment that makes a keel contender import this checkout, the peers a run
can use, and a scratch directory that is cleaned up.

The scripts run as `python benchmarks/NAME.py`, so this module is importable beside them. A
measured child prints one JSON object as its last stdout line; its resident memory and that of
its descendants (worker processes) is sampled every SAMPLE_SECONDS.

Every script takes --smoke: a tiny configuration through the same code paths (keel's contender
end to end, the result table printed) in seconds, which CI runs (tests/test_benchmarks.py). A
smoke run uses only data that ships with keel (keel/experiments/sample/) or synthetic data, writes
only under a temporary directory, and skips a peer that is not installed with one printed line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

SAMPLE_SECONDS = 0.05
REPO = Path(__file__).resolve().parents[1]


def checkout_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """`environment` with this checkout first on PYTHONPATH, so that a keel contender run by
    another environment's interpreter (--keel-python, which may hold an installed copy of keel)
    imports this checkout's keel. Empty entries are dropped: Python reads one as the working
    directory."""
    entries = [str(REPO), *(e for e in environment.get("PYTHONPATH", "").split(os.pathsep) if e)]
    return {**environment, "PYTHONPATH": os.pathsep.join(entries)}


def run_measured(
    name: str, command: Sequence[str], env: Mapping[str, str] | None = None
) -> tuple[dict, dict[str, int]]:
    """Run contender `name` as `command`; return its JSON report and its peak RSS in bytes:
    {"tree": summed over the process and its descendants, "single": the largest process}."""
    child = subprocess.Popen(
        [str(part) for part in command], stdout=subprocess.PIPE, env=env, text=True
    )
    peaks = {"tree": 0, "single": 0}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_tree, args=(psutil.Process(child.pid), peaks, stop))
    sampler.start()
    output, _ = child.communicate()
    stop.set()
    sampler.join()
    if child.returncode != 0:
        raise SystemExit(f"{name} failed with exit code {child.returncode}")
    return json.loads(output.strip().splitlines()[-1]), peaks


def _sample_tree(process: psutil.Process, peaks: dict[str, int], stop: threading.Event) -> None:
    while not stop.is_set():
        rss = []
        try:
            members = [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for member in members:
            try:
                rss.append(member.memory_info().rss)
            except psutil.NoSuchProcess:
                continue
        if rss:
            peaks["tree"] = max(peaks["tree"], sum(rss))
            peaks["single"] = max(peaks["single"], max(rss))
        stop.wait(SAMPLE_SECONDS)


@dataclass(frozen=True)
class Peer:
    """A library a benchmark compares keel against, not a keel dependency."""

    module: str
    """What the contender imports (checked without importing it)."""
    install: str
    """How to install it, for the message when a full run lacks it."""


def runnable_contenders(
    contenders: Sequence[str], peers: Mapping[str, Peer], smoke: bool
) -> tuple[str, ...]:
    """`contenders` minus those whose peer (`peers`: contender -> Peer; a contender not in it
    needs only keel) is not installed. A smoke run skips them, one printed line per missing
    peer; a full run stops with one line saying what to install."""
    missing: dict[Peer, list[str]] = {}
    for name in contenders:
        peer = peers.get(name)
        if peer is not None and importlib.util.find_spec(peer.module) is None:
            missing.setdefault(peer, []).append(name)
    for peer, names in missing.items():
        if not smoke:
            raise SystemExit(
                f"peer {peer.module} not installed (contenders {', '.join(names)}): "
                f"{peer.install}, or run with --smoke to skip it"
            )
        print(f"peer {peer.module} not installed: skipped ({', '.join(names)})", flush=True)
    skipped = {name for names in missing.values() for name in names}
    return tuple(name for name in contenders if name not in skipped)


@contextlib.contextmanager
def scratch_directory(out: Path | None, prefix: str) -> Iterator[Path]:
    """`out` (created, kept afterwards) when given, else a fresh temporary directory that is
    removed on exit, whether the run succeeds or not."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        yield out
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        yield Path(scratch)
