"""Logging set-up for keel's commands: rich, readable lines on stderr, so stdout stays for results.

Library modules only call `logging.getLogger(__name__)`; the CLI calls `setup_logging` once.
"""

from __future__ import annotations

import logging

from rich.console import Console
from rich.logging import RichHandler


def setup_logging(level: int | str = logging.INFO) -> None:
    """Send keel's log records to stderr through rich; leave other libraries' loggers at WARNING."""
    handler = RichHandler(
        console=Console(stderr=True),
        show_path=False,
        rich_tracebacks=False,
        log_time_format="[%X]",
    )
    keel_logger = logging.getLogger("keel")
    keel_logger.handlers[:] = [handler]
    keel_logger.setLevel(level)
    keel_logger.propagate = False
