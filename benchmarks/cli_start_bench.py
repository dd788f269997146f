"""Start-up time of the `keel` command: the wall time of whole `python -m keel ...` processes.

What it measures: for each command below, the median over --repeats runs of the wall time from
spawning `python -m keel ARGS` to its exit (interpreter start, imports, the command's work,
output to a pipe), for this checkout and, with --before REV, for the tree of git revision REV
(extracted with `git archive` into a scratch directory and put first on PYTHONPATH, so both run
with the same interpreter and libraries). Runs alternate between the two trees, so load on a
shared machine falls on both alike.

    keel --help                          the command list
    keel job status JOB --root ROOT      one job's state from a controller's SQLite database
    keel logs query SQL --root ROOT      a one-row query on a telemetry store

ROOT holds one submitted job and a 3-row telemetry namespace, written by this checkout's keel
before timing (both trees read them).

    python benchmarks/cli_start_bench.py --before 87d4e1e [--repeats 7]
    python benchmarks/cli_start_bench.py --smoke     # 1 run of each, this checkout only (CI)

The table goes to stdout, then one JSON line with every number; progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from measure import scratch_directory

REPO = Path(__file__).resolve().parents[1]
JOB_ID = "j-000001"


def commands(root: Path) -> dict[str, list[str]]:
    """Label -> `python -m keel` arguments."""
    return {
        "keel --help": ["--help"],
        "keel job status": ["job", "status", JOB_ID, "--root", str(root / "cluster")],
        "keel logs query": [
            "logs",
            "query",
            'SELECT count(*) AS n FROM "bench.rows"',
            "--root",
            str(root / "telemetry"),
        ],
    }


def prepare_root(root: Path) -> None:
    """One pending job (the controller's database) and a 3-row telemetry namespace."""
    from keel.cluster import state
    from keel.cluster.spec import JobSpec

    database = state.connect(root / "cluster" / "state.db")
    assert state.submit(database, JobSpec(command=("true",))) == JOB_ID
    rows = root / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in (1, 2, 3))
    )
    _keel(
        os.environ.copy(),
        ["logs", "write", "-n", "bench.rows", str(rows), "--root", str(root / "telemetry")],
        check=True,
    )


def extract_revision(revision: str, into: Path) -> Path:
    """The tree of git `revision` (its keel package and the rest) under `into`."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", revision], cwd=REPO, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _keel(env: dict[str, str], args: list[str], check: bool = False) -> float:
    """Seconds from spawning `python -m keel ARGS` to its exit. It runs in the system's
    temporary directory: `python -m` puts the working directory first on sys.path, and this
    checkout's keel must not shadow the tree PYTHONPATH names."""
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "keel", *args],
        env=env,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    seconds = time.perf_counter() - started
    if result.returncode != 0 and check:
        raise SystemExit(f"keel {' '.join(args)} failed: {result.stderr.strip()[-500:]}")
    if result.returncode != 0:
        print(f"note: keel {args[0]} exited {result.returncode}", file=sys.stderr)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="A git revision to compare against (e.g. 87d4e1e).")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="1 run of each, this checkout only.")
    args = parser.parse_args()
    repeats = 1 if args.smoke else args.repeats

    with scratch_directory(None, "keel-cli-start-") as scratch:
        root = scratch / "root"
        prepare_root(root)
        trees = {"this checkout": REPO}
        if args.before and not args.smoke:
            trees[f"before ({args.before})"] = extract_revision(args.before, scratch / "before")
        envs = {
            name: {**os.environ, "PYTHONPATH": str(tree), "KEEL_LOG_LEVEL": "WARNING"}
            for name, tree in trees.items()
        }
        times: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
        for round_index in range(repeats):
            print(f"round {round_index + 1}/{repeats}", file=sys.stderr)
            for label, keel_args in commands(root).items():
                for name, env in envs.items():
                    times[name].setdefault(label, []).append(_keel(env, keel_args))

    medians = {
        name: {label: statistics.median(values) for label, values in by_label.items()}
        for name, by_label in times.items()
    }
    names = list(trees)
    print(f"{'command':<18}" + "".join(f"{name:>24}" for name in names))
    for label in commands(Path(".")):
        print(f"{label:<18}" + "".join(f"{medians[name][label]:>23.2f}s" for name in names))
    print(json.dumps({"repeats": repeats, "median_s": medians, "runs_s": times}))


if __name__ == "__main__":
    main()
