"""Is a process still the one we started? pid plus kernel start time, so a reused pid is not
mistaken for it (step locks, local cluster tasks, the embedded controller). And how much memory
this process has held at most."""

from __future__ import annotations

import os
import resource
import sys


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (Linux), or None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """The start time of a process in clock ticks since boot (None: gone, or no /proc)."""
    fields = _proc_stat(pid)
    return None if fields is None else int(fields[19])  # field 22 of stat(5)


def process_alive(pid: int, start: int | None = None) -> bool:
    """Whether `pid` runs (not a zombie) and, when `start` is given, is the process that
    started then. Without /proc (not Linux) only the pid is checked."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _proc_stat(pid)
    if fields is None:
        return True
    if fields[0] in {"Z", "X"}:
        return False  # a zombie has exited; only its parent has not collected it yet
    return start is None or int(fields[19]) == start


def peak_resident_bytes() -> int:
    """This process's peak resident set in bytes since it started its program.

    Linux: VmHWM from /proc/self/status. Not getrusage's ru_maxrss, which a child started by
    fork and exec inherits from its parent: a worker of a 600 MB coordinator reported a 600 MB peak
    before it held any data. Elsewhere ru_maxrss (bytes on macOS, KiB on other systems)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass  # no /proc: fall back to getrusage below
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
