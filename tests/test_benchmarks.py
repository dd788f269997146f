"""Every benchmark script runs its --smoke configuration (a tiny run through the same code paths,
seconds) and exits 0, so a refactor cannot break one silently.

The scripts are found by glob: every benchmarks/*.py with a `if __name__ == "__main__":` block
(helper modules such as measure.py and telemetry_data.py have none), so a new script is covered
without touching this file. Each runs as a user runs it, `python benchmarks/NAME.py --smoke` from
the repository root, in its own process group (killed whole on a timeout), with TMPDIR pointed at
the test's temporary directory so whatever a run leaves lands there.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAIN_BLOCK = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.MULTILINE)
TIMEOUT_S = 240
"""Per script; a smoke run takes seconds to ~20 s on 2 idle cores."""
TAIL_CHARS = 4000


def benchmark_scripts() -> list[Path]:
    """benchmarks/*.py that run as scripts (those with a main block), in name order."""
    scripts = sorted((REPO / "benchmarks").glob("*.py"))
    return [path for path in scripts if MAIN_BLOCK.search(path.read_text(encoding="utf-8"))]


SCRIPTS = benchmark_scripts()


def test_discovery_finds_the_scripts_and_skips_the_helpers():
    names = {path.name for path in SCRIPTS}
    assert {"dedup_bench.py", "flow_bench.py", "train_bench.py"} <= names
    assert not {"measure.py", "telemetry_data.py"} & names


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_smoke_run_exits_0(script: Path, tmp_path: Path):
    command = [sys.executable, str(script.relative_to(REPO)), "--smoke"]
    child = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the script and its workers
        stdout, stderr = child.communicate()
        pytest.fail(
            f"{' '.join(command)} ran past {TIMEOUT_S} s\n"
            f"--- stderr (tail) ---\n{stderr[-TAIL_CHARS:]}\n"
            f"--- stdout (tail) ---\n{stdout[-TAIL_CHARS:]}"
        )
    assert child.returncode == 0, (
        f"{' '.join(command)} exited with {child.returncode}\n"
        f"--- stderr (tail) ---\n{stderr[-TAIL_CHARS:]}\n"
        f"--- stdout (tail) ---\n{stdout[-TAIL_CHARS:]}"
    )
    assert stdout.strip(), f"{' '.join(command)} printed no results"
