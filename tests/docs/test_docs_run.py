"""The docs run: every shell and Python block of README.md and docs/ is marked, and `run` blocks
execute as a user would paste them.

Each doc file's `run` blocks execute in order in one fresh temporary directory (so a later block
uses an earlier one's files), shell blocks with `bash -euxo pipefail` (-x: a
failure's output shows the line that failed), Python blocks saved to a file
(`# NAME.py` on a block's first line names it, so a later block can run it) and run with this
venv's python. The environment is a user's: this venv's bin first on PATH, this checkout's keel
importable, and none of the suite's test-only settings (simulated devices, KEEL_DEVICES, the
session's own compilation cache: the blocks use the user's, ~/.cache/keel/jax by default, where
the set-up command's quickstart left its compiled programs).

The README tour starts with `keel quickstart` (4-6 minutes cold on 2 cores), which the README says
to run once at set-up and which the tour then runs again ("run it twice: all cached"). The
temporary directory therefore starts as the user's clone does after set-up: it holds a copy of
the committed step outputs of that first quickstart run, taken from $KEEL_DOCS_QUICKSTART_PREFIX
(.ci/run points it at the keel-out of the quickstart it has just run) or else from this checkout's
keel-out/ (where the set-up command leaves it). The tour still runs every line top to bottom;
`keel quickstart` finds its own step cache, exactly as a user's second run does, and every other
command runs for real. Without such a prefix the quickstart simply runs cold.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import REPO, Block, blocks, documents
from quickstart_support import copy_quickstart_outputs, earlier_quickstart

BLOCK_TIMEOUT_S = 600  # a cold quickstart (no earlier run to copy) takes 4-6 min
OUTPUT_TAIL_LINES = 40
TEST_ONLY_SETTINGS = ("XLA_FLAGS", "KEEL_DEVICES", "KEEL_COMPILATION_CACHE", "PYTEST_CURRENT_TEST")


def _run_blocks(doc: Path) -> list[Block]:
    return [block for block in blocks(doc) if block.needs_mark and block.mark == "run"]


DOCS_WITH_RUN_BLOCKS = [doc for doc in documents() if _run_blocks(doc)]


def test_every_shell_and_python_block_is_marked():
    """An unmarked block fails, so a new doc says whether CI runs its commands."""
    unmarked = [
        f"{block.where}: ```{block.language} needs run, excerpt or skip=REASON"
        for doc in documents()
        for block in blocks(doc)
        if block.needs_mark and block.mark is None
    ]
    assert not unmarked, "unmarked blocks:\n" + "\n".join(unmarked)


@pytest.mark.slow
@pytest.mark.timeout(2 * BLOCK_TIMEOUT_S)
@pytest.mark.parametrize(
    "doc", DOCS_WITH_RUN_BLOCKS, ids=[str(d.relative_to(REPO)) for d in DOCS_WITH_RUN_BLOCKS]
)
def test_doc_runs(doc: Path, tmp_path: Path):
    """Every `run` block of one doc file, in order, in one fresh directory."""
    environment = _user_environment()
    if doc == REPO / "README.md" and (source := earlier_quickstart(checkout_fallback=True)):
        copy_quickstart_outputs(source, tmp_path / "keel-out")
    for number, block in enumerate(_run_blocks(doc)):
        command = _command(block, number, tmp_path)
        try:
            finished = subprocess.run(
                command,
                cwd=tmp_path,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,  # one stream, in the order it was written
                text=True,
                timeout=BLOCK_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as timeout:
            output = (timeout.stdout or b"").decode(errors="replace")
            pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s\n{_tail(output)}")
        if finished.returncode != 0:
            pytest.fail(f"{block.where}: exit code {finished.returncode}\n{_tail(finished.stdout)}")


def _command(block: Block, number: int, workdir: Path) -> list[str]:
    """The argv that runs `block` in `workdir` (a Python block is first written to a file)."""
    if block.is_shell:
        return ["bash", "-euxo", "pipefail", "-c", block.text]  # -x: the output shows each line
    script = workdir / (block.saved_as or f"block_{number}_line_{block.line}.py")
    script.write_text(block.text, encoding="utf-8")
    return [sys.executable, script.name]


def _user_environment() -> dict[str, str]:
    """This venv's bin first on PATH, this checkout importable, the suite's test settings gone."""
    environment = {k: v for k, v in os.environ.items() if k not in TEST_ONLY_SETTINGS}
    environment["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), environment["PATH"]])
    paths = [str(REPO), *filter(None, [environment.get("PYTHONPATH")])]
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    return environment


def _tail(output: str) -> str:
    return "\n".join(output.rstrip().split("\n")[-OUTPUT_TAIL_LINES:])
