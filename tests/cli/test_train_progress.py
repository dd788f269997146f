"""`keel train` into a log (no terminal): progress lines while the run goes, none with --quiet."""

import re
import subprocess
import time

import pytest
from cli_support import error_lines

PROGRESS_LINE = re.compile(r"^train: step (\d+)/60, loss [0-9.]+, [0-9,]+ tokens/s, elapsed ")

SMALL = ("--set", "batch_size=2", "--set", "phases.0.seq_len=32", "--set", "eval_batches=1")
"""tiny-dense at a batch that runs fast on 2 cores (the same model and 60-step schedule)."""


def train_into_log(cli, cache: str, log_name: str, *extra: str) -> subprocess.Popen:
    """`keel train --preset tiny-dense --steps 60 ... > log 2>&1`, started; the open log path."""
    log = (cli.root / log_name).open("w")
    args = ("train", "--preset", "tiny-dense", "--steps", "60", "--data", cache)
    args += ("--set", "model.vocab_size=512", *SMALL, "--output", log_name + "-run", *extra)
    return subprocess.Popen(
        cli.command(*args), stdout=log, stderr=subprocess.STDOUT, env=cli.env, cwd=cli.root
    )


@pytest.fixture
def cache(wikitext_cache) -> str:
    return wikitext_cache


def test_a_run_into_a_log_writes_progress_lines_before_it_ends(cli, cache):
    process = train_into_log(cli, cache, "log")
    log = cli.root / "log"
    seen_while_running = False
    deadline = time.monotonic() + 240
    while process.poll() is None and time.monotonic() < deadline:
        if any(PROGRESS_LINE.match(line) for line in log.read_text().splitlines()):
            seen_while_running = process.poll() is None
            break
        time.sleep(0.02)
    assert process.wait(timeout=240) == 0, log.read_text()
    lines = log.read_text().splitlines()
    assert seen_while_running, "no progress line was in the log while the run went on"
    steps = [int(m.group(1)) for m in map(PROGRESS_LINE.match, lines) if m]
    assert set(range(6, 61, 6)) <= set(steps), lines  # every tenth (and every 30 s)
    assert steps == sorted(steps) and steps[0] < 60, lines
    summary = next(i for i, line in enumerate(lines) if line.startswith("trained "))
    assert all(PROGRESS_LINE.match(line) is None for line in lines[summary:])


def test_quiet_writes_no_progress_and_a_bad_form_is_one_line(cli, cache):
    process = train_into_log(cli, cache, "quiet", "--quiet")
    assert process.wait(timeout=240) == 0
    text = (cli.root / "quiet").read_text()
    assert "trained " in text and "step 6/60" not in text and "tokens/s" not in text, text

    result = cli.run("train", "--preset", "tiny-dense", "--progress", "often")
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        "error: --progress 'often': use auto, bar, lines, off, N (a line every N steps) or Ns "
        "(every N seconds), e.g. --progress 50"
    ]
