"""Work directories of a killed run (`keel-flow-*` in the temporary directory) are removed by the
next run, and only those whose owner process is dead."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from keel.core.process import process_start
from keel.flow import from_items

KILLED_MID_RUN = """
import os, signal, sys
from pathlib import Path
from keel.flow import from_items

STARTED = Path(os.environ["KEEL_TEST_STARTED"])  # workers inherit the environment, not argv


def stall(row):
    STARTED.write_text("started")
    import time; time.sleep(60)
    return row

from_items([{"n": 1}]).map(stall).write_parquet(sys.argv[1], workers=1)
"""


def test_a_killed_runs_work_directory_is_removed_by_the_next_run(tmp_path, monkeypatch):
    temp = tmp_path / "tmp"
    temp.mkdir()
    started = tmp_path / "started"
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_MID_RUN), str(tmp_path / "o")],
        env={**os.environ, "TMPDIR": str(temp), "KEEL_TEST_STARTED": str(started)},
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists()
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    left = [name for name in os.listdir(temp) if name.startswith("keel-flow-")]
    assert len(left) == 1  # a kill cannot clean up after itself
    alive = temp / f"keel-flow-{os.getpid()}-{process_start(os.getpid())}-live"  # kept: we live
    alive.mkdir()

    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    from_items([{"n": 2}]).write_parquet(tmp_path / "next", workers=1)
    remaining = sorted(name for name in os.listdir(temp) if name.startswith("keel-flow-"))
    assert left[0] not in remaining and alive.name in remaining
