"""`keel train --gate N`: a few steps in a temporary directory, median tokens/s and peak memory;
a memory limit below XLA's estimate fails at once naming both figures."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from keel.core.errors import UsageError
from keel.train.gate import parse_memory_limit

KEEL = [sys.executable, "-m", "keel"]
SMALL = ["--set", "model.n_layers=1", "--set", "batch_size=4", "--set", "model.vocab_size=512"]


def _keel(tmp_path, cache: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *KEEL,
            "train",
            "--preset",
            "tiny-dense",
            *SMALL,
            "--data",
            cache,
            "--prefix",
            "ko",
            *args,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_gate_reports_median_tokens_per_s_and_writes_no_run(wikitext_cache, tmp_path):
    done = _keel(tmp_path, wikitext_cache, "--gate", "4", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["steps"] == 4 and result["tokens_per_s"] > 0
    assert result["peak_bytes"] > result["estimate_bytes"] > 0  # a process holds more than a step
    assert not (tmp_path / "keel-out").exists()  # nothing of the run is written


def test_a_limit_below_the_estimate_fails_naming_both_figures(wikitext_cache, tmp_path):
    done = _keel(tmp_path, wikitext_cache, "--gate", "4", "--memory-limit", "1KB")
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert re.search(r"estimate [\d.]+ \w+ per device .* exceeds --memory-limit 1000 B", line)


@pytest.mark.parametrize(
    ("text", "expected"), [("80GB", 80 * 10**9), ("141GiB", 141 * 2**30), ("1e3", None)]
)
def test_memory_limits_read_as_bytes(text, expected):
    if expected is None:
        with pytest.raises(UsageError, match="expected bytes"):
            parse_memory_limit(text)
    else:
        assert parse_memory_limit(text) == expected
