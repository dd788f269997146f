"""Logging set-up for keel's commands: readable lines on stderr, so stdout stays for results.

On a terminal the lines go through rich (aligned columns, wrapped to the window). Anywhere else
(a CI log, a Slurm job's output file, a pipe to grep) each record is one plain line, never
wrapped: rich wraps at 80 columns when it finds no terminal, which split a message such as
"resuming RUN from step 10" across lines wherever the path was long.

Library modules only call `logging.getLogger(__name__)`; the CLI calls `setup_logging` once.
"""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.logging import RichHandler

TIME_FORMAT = "%X"
PLAIN_FORMAT = "[%(asctime)s] %(levelname)-8s %(message)s"


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler writing to whatever sys.stderr is at each record, as rich's console
    does (a test runner may swap sys.stderr after set-up)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: int | str = logging.INFO) -> None:
    """Send keel's log records to stderr (rich on a terminal, one plain line per record
    elsewhere); leave other libraries' loggers at WARNING."""
    console = Console(stderr=True)
    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(
            console=console,
            show_path=False,
            rich_tracebacks=False,
            log_time_format=f"[{TIME_FORMAT}]",
        )
    else:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(PLAIN_FORMAT, datefmt=TIME_FORMAT))
    keel_logger = logging.getLogger("keel")
    keel_logger.handlers[:] = [handler]
    keel_logger.setLevel(level)
    keel_logger.propagate = False
