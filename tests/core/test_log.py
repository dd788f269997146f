"""keel's log lines in a file or pipe (CI logs, Slurm output files) are one line per record,
however long, so a grep for a message finds it whole."""

from __future__ import annotations

import subprocess
import sys

LONG_PATH = "/tmp/" + "/".join(["a-rather-long-directory-name"] * 6) + "/work"

PROGRAM = f"""
import logging
from keel.core.log import setup_logging
setup_logging()
logging.getLogger("keel.train.trainer").info("resuming %s from step %d", {LONG_PATH!r}, 10)
logging.getLogger("keel.steps").debug("not shown at INFO")
"""


def test_a_long_record_is_one_line_when_stderr_is_not_a_terminal():
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True
    )
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].endswith(f"INFO     resuming {LONG_PATH} from step 10")
