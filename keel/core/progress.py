"""Progress of long work in any terminal: a rich bar where the stream is a terminal, elsewhere (a
log file, CI, nohup, `keel job run`) one plain line every so often.

`ProgressStyle` says how to show it (`parse_progress` reads the CLI's `--progress` value);
`ProgressDisplay` shows one or more pieces of work (training steps, each flow stage's tasks) in
that style. A plain line reads

    train: step 12/60, loss 6.123, 15,234 tokens/s, elapsed 0:00:05, eta 0:00:20
    stage 1: dedup: 12/48 tasks, 120,000 rows out, elapsed 0:00:31, eta 0:01:30

ETA is the remaining work at the rate measured since the first update (so compile time and
start-up do not skew it); `?` until a second update. Lines go to the stream as they happen
(flushed), so a log read while the work runs shows them.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal, TextIO

from keel.core.errors import UsageError

Mode = Literal["auto", "bar", "lines", "off"]
MODES: tuple[Mode, ...] = ("auto", "bar", "lines", "off")

PROGRESS_FORMS = "auto, bar, lines, off, N (a line every N steps) or Ns (every N seconds)"
"""What `--progress` accepts, for help texts and errors."""


@dataclass(frozen=True)
class ProgressStyle:
    """How to show progress.

    mode: "auto" (a bar when the stream is a terminal, plain lines elsewhere), "bar", "lines" or
    "off". Lines are written every `every` units of work (None: every tenth of the total; 0:
    never by count) and at least every `every_seconds` seconds (None: never by time), and at the
    end of the work when any line was written before it.
    """

    mode: Mode = "auto"
    every: int | None = None
    every_seconds: float | None = 30.0

    def resolve(self, stream: TextIO) -> Literal["bar", "lines", "off"]:
        """The mode used on `stream`: auto becomes bar on a terminal, lines elsewhere."""
        if self.mode != "auto":
            return self.mode
        isatty = getattr(stream, "isatty", None)
        return "bar" if isatty is not None and isatty() else "lines"


QUIET = ProgressStyle(mode="off")
STAGES = ProgressStyle(every=0, every_seconds=30.0)
"""Flow stages: a bar on a terminal, else a line every 30 s of a long stage (short ones say
nothing)."""


def parse_progress(text: str | None, quiet: bool = False) -> ProgressStyle:
    """The style named by `--progress TEXT` (None: auto) and `--quiet`; UsageError otherwise."""
    if quiet:
        if text is not None and text != "off":
            raise UsageError(f"--quiet and --progress {text} contradict each other: give one")
        return QUIET
    if text is None:
        return ProgressStyle()
    value = text.strip().lower()
    if value in MODES:
        return ProgressStyle(mode=value)  # type: ignore[arg-type]
    try:
        if value.endswith("s"):
            seconds = float(value[:-1])
            if seconds > 0:
                return ProgressStyle(mode="lines", every=0, every_seconds=seconds)
        else:
            count = int(value)
            if count > 0:
                return ProgressStyle(mode="lines", every=count, every_seconds=None)
    except ValueError:
        pass  # the one error below says what is accepted
    raise UsageError(f"--progress {text!r}: use {PROGRESS_FORMS}, e.g. --progress 50")


def clock(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    whole = max(int(seconds), 0)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


class ProgressTask:
    """One piece of work of `total` units (steps, tasks) in a ProgressDisplay."""

    def __init__(self, display: ProgressDisplay, label: str, total: int, unit: str) -> None:
        self.display, self.label, self.total, self.unit = display, label, total, unit
        self.started = time.monotonic()
        self.done = 0
        self.fields: dict[str, str] = {}
        self._first: tuple[float, int] | None = None
        self._last_line: tuple[float, int] | None = None
        self._bar = display.bar.add_task(label, total=total, info="") if display.bar else None

    def update(self, done: int, **fields: str) -> None:
        """`done` units finished; `fields` are shown as they are, in order ("loss 6.123")."""
        now = time.monotonic()
        with self.display.lock:
            self.done = done
            self.fields = fields
            if self._first is None:
                self._first = (now, done)
            if self._bar is not None:
                info = ", ".join(fields.values())
                self.display.bar.update(self._bar, completed=done, info=info)
            elif self.display.mode == "lines" and self._due(now, done):
                self._write(now, done)

    def finish(self) -> None:
        """The work ended: a last line when lines were written before (a long piece of work)."""
        with self.display.lock:
            if self._last_line is not None and self._last_line[1] != self.done:
                self._write(time.monotonic(), self.done)

    def line(self, now: float) -> str:
        """The plain line for the state at `now`."""
        parts = [f"{self.unit} {self.done}/{self.total}" if self.unit == "step" else
                 f"{self.done}/{self.total} {self.unit}"]  # fmt: skip
        parts += self.fields.values()
        parts.append(f"elapsed {clock(now - self.started)}")
        parts.append(f"eta {self._eta(now)}")
        return f"{self.label}: {', '.join(parts)}"

    def _eta(self, now: float) -> str:
        if self.done >= self.total:
            return clock(0)
        if self._first is None or self.done <= self._first[1] or now <= self._first[0]:
            return "?"
        rate = (self.done - self._first[1]) / (now - self._first[0])
        return clock((self.total - self.done) / rate)

    def _due(self, now: float, done: int) -> bool:
        style = self.display.style
        since_time, since_done = self._last_line or (self.started, 0)
        every = max(self.total // 10, 1) if style.every is None else style.every
        by_count = every > 0 and (done - since_done >= every or done >= self.total)
        by_time = style.every_seconds is not None and now - since_time >= style.every_seconds
        return by_count or by_time

    def _write(self, now: float, done: int) -> None:
        self.display.stream.write(self.line(now) + "\n")
        self.display.stream.flush()
        self._last_line = (now, done)


class ProgressDisplay:
    """A context for progress in `style` on `stream` (default: stderr); `task()` adds work.

    Thread-safe: updates may come from worker threads' callbacks."""

    def __init__(self, style: ProgressStyle = ProgressStyle(), stream: TextIO | None = None):
        self.style = style
        self.stream = stream if stream is not None else sys.stderr
        self.mode = style.resolve(self.stream)
        self.lock = threading.Lock()
        self.bar = None
        self._tasks: list[ProgressTask] = []

    def __enter__(self) -> ProgressDisplay:
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]{task.description}[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
            )
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def task(self, label: str, total: int, unit: str = "step") -> ProgressTask:
        """Add a piece of work of `total` units (`unit` "step" reads "step 3/60"; others "3/60
        tasks")."""
        task = ProgressTask(self, label, total, unit)
        self._tasks.append(task)
        return task
