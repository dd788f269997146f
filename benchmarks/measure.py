"""Run a benchmark contender in a child process and measure its peak memory.

Shared by the benchmark scripts (they run as `python benchmarks/NAME.py`, so this module is
importable beside them). The child prints one JSON object as its last stdout line; its resident
memory and that of its descendants (worker processes) is sampled every SAMPLE_SECONDS.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Mapping, Sequence

import psutil

SAMPLE_SECONDS = 0.05


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
