"""Time to quality on CPU: keel's trainer against nanoGPT's CPU recipe, on the same text.

What it measures (one run of each side, one after the other, on the same cores):
- nanoGPT (the peer at ../shared/peers/nanoGPT, run in its own venv, --peer-python): a scratch
  copy of the peer, a data dir written by this script (character level as shakespeare_char,
  but the vocabulary is the sorted set of characters of the training AND evaluation text, so
  every evaluation character has an id; train.bin / val.bin uint16, meta.pkl {vocab_size, itos,
  stoi}), then its README's CPU recipe for shakespeare_char (NANOGPT_RECIPE: 2000 iterations,
  4 layers x 128 wide, block 64, batch 12, eval every 250 on 20 batches) with `python train.py`,
  timed as a whole process from launch. Each "step N: ... val loss X" line is timestamped as
  it is printed (PYTHONUNBUFFERED); its val loss (nats per character, 20 random batches) is
  shown as an estimated bits per byte (x chars/bytes of the evaluation text / ln 2). Then, in a
  separate untimed process in the peer venv (nanogpt_score.py), its saved checkpoint (train.py
  saves the one with the best val estimate) is scored on the WHOLE evaluation split: every
  character after the first scored once, windows of block_size, in bits per UTF-8 byte. That
  number is the target; nanoGPT reaches it at the eval line of the checkpoint's step.
- keel: `python -m keel train --preset P --data TRAIN --eval-data EVAL [--set ...]`, one
  process, timed from its launch: it trains a byte-level BPE of the preset's model.vocab_size
  on the training text, tokenizes both files (cached steps; each run starts in a fresh scratch
  directory, so nothing is cached), compiles, trains and evaluates. `eval_batches` is set past
  any set's size, so every evaluation scores the whole evaluation split (every token after the
  first, once), not only the final one. keel's persistent compilation cache starts empty
  (KEEL_COMPILATION_CACHE: a fresh directory), as on a user's first run. Its metrics.jsonl is
  tailed (every POLL_SECONDS) and each line carrying `eval/<stem>/bpb` (else eval_bpb) is
  timestamped on arrival. nanoGPT's whole-split scoring is not counted (its own 20-batch
  estimates are).
Reported: each side's total seconds and bits-per-byte curve, the wall time at which each first
reaches nanoGPT's final whole-split bits per byte (keel: the first eval at or below it, nothing
interpolated), the ratio keel / nanoGPT (the issue's target: <= 0.3), and the best bits per
byte each reaches within nanoGPT's total time. keel's and nanoGPT's bytes differ slightly: keel
normalizes the text (NFC, trailing whitespace stripped) and counts the bytes of its tokens.

    python benchmarks/speedrun_bench.py [--preset tiny-dense] [--set KEY=VALUE ...]
        [--train ../shared/datasets/wikitext2/valid.txt] [--eval .../test.txt] [--out DIR]
    python benchmarks/speedrun_bench.py --reuse-nanogpt results.json --preset tiny-dense ...
    python benchmarks/speedrun_bench.py --smoke   # what CI runs: seconds, the bundled sample

--reuse-nanogpt FILE takes the nanoGPT side from a previous run's JSON line (saved as
results.json in --out) instead of running it again: for screening keel configs against one
measured nanoGPT run. --smoke: the first SMOKE_TRAIN_CHARS / next SMOKE_EVAL_CHARS characters
of the WikiText-2 articles bundled with keel, nanoGPT for SMOKE_NANOGPT_ITERS iterations of a
1-layer model (skipped, with one stderr line, when the peer venv is absent, as in CI), keel's
preset shrunk by SMOKE_KEEL_SETS for 4 steps; the parsing and the table as in a full run.
The table goes to stdout, then one JSON line with every number; progress goes to stderr. The
machine is shared: one run's wall times move with other processes' load.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import pickle
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from measure import scratch_directory

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
WIKITEXT = REPO.parent / "shared" / "datasets" / "wikitext2"
PEER = REPO.parent / "shared" / "peers" / "nanoGPT"
PEER_PYTHON = REPO.parent / "nanogpt-venv" / "bin" / "python"
SAMPLE = REPO / "keel" / "experiments" / "sample" / "wikitext2.jsonl.gz"
DATASET = "speedrun"
"""The name of the data dir written into the scratch copy (data/speedrun)."""
NANOGPT_RECIPE = (
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
)
"""nanoGPT README's "I only have a macbook" command for shakespeare_char (commit 3adf61e)."""
SMOKE_NANOGPT_ITERS = 4
SMOKE_NANOGPT = (
    "--eval_interval=2",
    "--eval_iters=2",
    "--block_size=32",
    "--batch_size=4",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=32",
    f"--max_iters={SMOKE_NANOGPT_ITERS}",
    f"--lr_decay_iters={SMOKE_NANOGPT_ITERS}",
    "--warmup_iters=1",
    "--always_save_checkpoint=True",
)
"""Appended to the recipe in a smoke run (later flags win in nanoGPT's configurator)."""
SMOKE_TRAIN_CHARS = 40_000
SMOKE_EVAL_CHARS = 8_000
SMOKE_KEEL_SETS = (
    "model.vocab_size=320",
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_dim=16",
    "model.ffn_dim=64",
    "batch_size=4",
    "phases.0.seq_len=32",
    "phases.0.schedule.warmup_steps=1",
    "eval_every=2",
)
SMOKE_KEEL_STEPS = 4
EVAL_BATCHES_ALL = 10**9
"""An eval_batches cap that no evaluation cache reaches: every evaluation is whole."""
POLL_SECONDS = 0.05
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


@dataclass
class EvalPoint:
    """One evaluation as it happened: seconds since the side's first launch, the step, bits
    per byte (nanoGPT's: estimated from its 20-batch val loss; keel's: the whole split)."""

    seconds: float
    step: int
    bpb: float


@dataclass
class Side:
    """What one contender did: total wall seconds from launch, its evaluations in order, and
    (nanoGPT) the whole-split score of its final checkpoint."""

    name: str
    total_s: float = 0.0
    evals: list[EvalPoint] = field(default_factory=list)
    final_bpb: float | None = None
    details: dict = field(default_factory=dict)

    def first_at_or_below(self, target: float) -> EvalPoint | None:
        return next((point for point in self.evals if point.bpb <= target), None)

    def best_within(self, seconds: float) -> float | None:
        values = [point.bpb for point in self.evals if point.seconds <= seconds]
        return min(values) if values else None


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_timed(
    command: Sequence[str | Path],
    *,
    cwd: Path,
    started: float,
    env: dict[str, str] | None = None,
    on_line: Callable[[str, float], None] | None = None,
    log: Path | None = None,
) -> float:
    """Run `command` to the end; return seconds from `started` (time.perf_counter()) to its
    exit. Each stdout line goes to `on_line(line, seconds since started)` and to `log`; stderr
    is appended to `log` (or inherited). Exits the benchmark when the command fails."""
    log_file = open(log, "a", encoding="utf-8", buffering=1) if log else None  # noqa: SIM115
    try:
        child = subprocess.Popen(
            [str(part) for part in command],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log_file or None,
            text=True,
        )
        assert child.stdout is not None
        for line in child.stdout:
            now = time.perf_counter() - started
            if log_file:
                log_file.write(line)
            if on_line:
                on_line(line.rstrip("\n"), now)
        code = child.wait()
        ended = time.perf_counter() - started
    finally:
        if log_file:
            log_file.close()
    if code != 0:
        where = f"; see {log}" if log else ""
        raise SystemExit(f"{' '.join(str(p) for p in command[:4])} ... exited {code}{where}")
    return ended


# ---------------------------------------------------------------- the texts


def texts(train: Path, evaluate: Path, smoke: bool) -> tuple[str, str]:
    """(training text, evaluation text): the given files, or in a smoke run slices of the
    WikiText-2 articles bundled with keel (../shared is not read)."""
    if not smoke:
        return train.read_text(encoding="utf-8"), evaluate.read_text(encoding="utf-8")
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as lines:
        joined = "\n".join(json.loads(line)["text"] for line in lines)
    return (
        joined[:SMOKE_TRAIN_CHARS],
        joined[SMOKE_TRAIN_CHARS : SMOKE_TRAIN_CHARS + SMOKE_EVAL_CHARS],
    )


# ---------------------------------------------------------------- nanoGPT


def prepare_char_data(train_text: str, eval_text: str, data_dir: Path) -> dict:
    """Write nanoGPT's character-level data dir: train.bin and val.bin (uint16 ids) and meta.pkl
    ({vocab_size, itos, stoi}, as train.py reads it). The vocabulary is every character of the
    training and the evaluation text, sorted, so no evaluation character is unknown."""
    chars = sorted(set(train_text) | set(eval_text))
    if len(chars) > np.iinfo(np.uint16).max:
        raise SystemExit(f"{len(chars)} distinct characters do not fit uint16 ids")
    stoi = {char: index for index, char in enumerate(chars)}
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("train.bin", train_text), ("val.bin", eval_text)):
        np.array([stoi[char] for char in text], dtype=np.uint16).tofile(data_dir / name)
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}
    with open(data_dir / "meta.pkl", "wb") as file:
        pickle.dump(meta, file)
    return {"vocab_size": len(chars), "train_chars": len(train_text), "eval_chars": len(eval_text)}


def run_nanogpt(
    peer: Path, python: Path, texts_: tuple[str, str], scratch: Path, smoke: bool, threads: int
) -> Side:
    """nanoGPT's CPU recipe on the texts, timed from launch, and its checkpoint scored whole;
    `threads` > 0 sets OMP_NUM_THREADS (torch's intra-op threads) for the training process."""
    copy = scratch / "nanogpt"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(peer, copy, ignore=shutil.ignore_patterns("out*", "*.bin", "*.pkl"))
    data_dir = copy / "data" / DATASET
    prepared = prepare_char_data(*texts_, data_dir)
    eval_text = texts_[1]
    chars_per_byte = len(eval_text) / len(eval_text.encode("utf-8"))
    command = [
        python,
        "train.py",
        *NANOGPT_RECIPE,
        f"--dataset={DATASET}",
        "--out_dir=out",
        *(SMOKE_NANOGPT if smoke else ()),
    ]
    side = Side("nanoGPT", details={**prepared, "command": " ".join(map(str, command[1:]))})
    saves: list[tuple[int, float]] = []

    def on_line(line: str, seconds: float) -> None:
        match = NANOGPT_EVAL.match(line)
        if match:
            step, val_loss = int(match.group(1)), float(match.group(3))
            bpb = val_loss / math.log(2) * chars_per_byte
            side.evals.append(EvalPoint(seconds, step, bpb))
            progress(f"nanoGPT {seconds:7.1f} s  step {step:5d}  val est. {bpb:.4f} bpb")
        elif line.startswith("saving checkpoint") and side.evals:
            saves.append((side.evals[-1].step, seconds))

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    side.details["omp_num_threads"] = threads or None
    progress(f"nanoGPT: {' '.join(map(str, command))} (in {copy})")
    side.total_s = run_timed(
        command,
        cwd=copy,
        env=env,
        started=time.perf_counter(),
        on_line=on_line,
        log=scratch / "nanogpt.log",
    )
    progress(f"nanoGPT: done in {side.total_s:.1f} s; scoring its checkpoint on the whole split")
    score_code = (
        f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); "
        "from nanogpt_score import main; main(sys.argv[1:])"
    )
    output = subprocess.run(
        [
            python,
            "-c",
            score_code,
            "--nanogpt",
            copy,
            "--checkpoint",
            copy / "out" / "ckpt.pt",
            "--data",
            data_dir,
        ],
        cwd=copy,
        capture_output=True,
        text=True,
    )
    if output.returncode != 0:
        raise SystemExit(f"scoring nanoGPT's checkpoint failed:\n{output.stderr[-2000:]}")
    score = json.loads(output.stdout.strip().splitlines()[-1])
    side.final_bpb = score["bpb"]
    side.details["score"] = score
    side.details["chars_per_byte"] = chars_per_byte
    saved_at = dict(saves).get(score["iter_num"])
    side.details["checkpoint_step"] = score["iter_num"]
    side.details["checkpoint_s"] = saved_at if saved_at is not None else side.total_s
    return side


# ---------------------------------------------------------------- keel


def keel_command(*args: str | Path | int) -> list[str]:
    return [sys.executable, "-m", "keel", *map(str, args)]


def keel_env(compilation_cache: Path) -> dict[str, str]:
    """This checkout's keel for the child processes and an empty JAX compilation cache at
    `compilation_cache` (a first run on a machine compiles everything)."""
    env = dict(os.environ)
    env["KEEL_COMPILATION_CACHE"] = str(compilation_cache)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


class MetricsTail:
    """Follows a metrics.jsonl as it grows (a thread): each line with an evaluation becomes an
    EvalPoint timestamped on arrival, seconds since `started`."""

    def __init__(self, path: Path, started: float, stem: str) -> None:
        self.path, self.started, self.key = path, started, f"eval/{stem}/bpb"
        self.points: list[EvalPoint] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._offset = 0
        self._partial = ""

    def __enter__(self) -> MetricsTail:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()  # whatever arrived after the last poll

    def _follow(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self._read()

    def _read(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as file:
            file.seek(self._offset)
            chunk = file.read()
            self._offset = file.tell()
        now = time.perf_counter() - self.started
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.strip():
                continue
            record = json.loads(line)
            bpb = record.get(self.key, record.get("eval_bpb"))
            if bpb is not None:
                self.points.append(EvalPoint(now, int(record["step"]), float(bpb)))
                progress(
                    f"keel    {now:7.1f} s  step {record['step']:5d}  whole split {bpb:.4f} bpb"
                )


def run_keel(
    preset_name: str,
    sets: Sequence[str],
    steps: int | None,
    texts_: tuple[str, str],
    scratch: Path,
) -> Side:
    """`keel train --data --eval-data` on the two texts, timed from its launch."""
    work = scratch / "keel"
    if work.exists():
        shutil.rmtree(work)
    inputs = work / "input"
    inputs.mkdir(parents=True)
    train_file, eval_file = inputs / "train.txt", inputs / "test.txt"
    train_file.write_text(texts_[0], encoding="utf-8")
    eval_file.write_text(texts_[1], encoding="utf-8")
    env = keel_env(work / "jax-cache")
    run_dir = work / "run"
    step_args = ("--steps", str(steps)) if steps else ()
    set_args = [arg for value in sets for arg in ("--set", value)]
    log = scratch / "keel.log"
    side = Side("keel", details={"preset": preset_name, "sets": list(sets)})
    command = keel_command(
        "train",
        "--preset",
        preset_name,
        "--data",
        train_file,
        "--eval-data",
        eval_file,
        "--output",
        run_dir,
        "--quiet",  # the log gets the summary only
        "--set",
        f"eval_batches={EVAL_BATCHES_ALL}",  # every evaluation whole, not only the last
        *set_args,
        *step_args,
    )
    side.details["command"] = " ".join(command[1:])
    progress(f"keel: {side.details['command']}")
    started = time.perf_counter()
    with MetricsTail(run_dir / "metrics.jsonl", started, eval_file.stem) as tail:
        side.total_s = run_timed(command, cwd=work, env=env, started=started, log=log)
    side.evals = tail.points
    side.final_bpb = tail.points[-1].bpb if tail.points else None
    return side


# ---------------------------------------------------------------- report


def compare(nanogpt: Side | None, keel: Side, target: float | None, budget: float | None) -> dict:
    """The numbers the table shows: target, times to it, ratio, best within nanoGPT's time."""
    out: dict = {"target_bpb": target, "nanogpt_total_s": budget}
    if nanogpt is not None:
        out["nanogpt_to_target_s"] = nanogpt.details["checkpoint_s"]
        out["nanogpt_best_within_s"] = nanogpt.final_bpb
    if target is not None:
        reached = keel.first_at_or_below(target)
        out["keel_to_target_s"] = reached.seconds if reached else None
        out["keel_to_target_step"] = reached.step if reached else None
        if reached and out.get("nanogpt_to_target_s"):
            out["ratio"] = reached.seconds / out["nanogpt_to_target_s"]
    if budget is not None:
        out["keel_best_within_s"] = keel.best_within(budget)
    return out


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(nanogpt: Side | None, keel: Side, numbers: dict) -> str:
    target = numbers.get("target_bpb")
    budget = numbers.get("nanogpt_total_s")
    lines = [
        f"target: nanoGPT's final whole-split bits per byte = {fmt(target, '.4f')}; "
        f"nanoGPT's total time = {fmt(budget, '.1f')} s",
        "",
        f"{'side':<8} {'total s':>8} {'final bpb':>10} {'s to target':>12} "
        f"{'best bpb in nanoGPT time':>25}",
    ]
    if nanogpt is not None:
        lines.append(
            f"{'nanoGPT':<8} {nanogpt.total_s:>8.1f} {fmt(nanogpt.final_bpb, '.4f'):>10} "
            f"{fmt(numbers.get('nanogpt_to_target_s'), '.1f'):>12} "
            f"{fmt(numbers.get('nanogpt_best_within_s'), '.4f'):>25}"
        )
    lines.append(
        f"{'keel':<8} {keel.total_s:>8.1f} {fmt(keel.final_bpb, '.4f'):>10} "
        f"{fmt(numbers.get('keel_to_target_s'), '.1f'):>12} "
        f"{fmt(numbers.get('keel_best_within_s'), '.4f'):>25}"
    )
    lines.append(f"ratio keel / nanoGPT time to target: {fmt(numbers.get('ratio'), '.2f')}")
    for side, what in ((nanogpt, "val estimate, 20 batches"), (keel, "whole split")):
        if side is None:
            continue
        lines += ["", f"{side.name} evaluations ({what}):", f"{'s':>8} {'step':>6} {'bpb':>8}"]
        lines += [f"{p.seconds:>8.1f} {p.step:>6d} {p.bpb:>8.4f}" for p in side.evals]
    return "\n".join(lines)


def side_from_json(record: dict) -> Side:
    side = Side(**{**record, "evals": [EvalPoint(**point) for point in record["evals"]]})
    return side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=Path, default=WIKITEXT / "valid.txt")
    parser.add_argument("--eval", type=Path, default=WIKITEXT / "test.txt")
    parser.add_argument("--preset", default="tiny-dense", help="keel train --preset")
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], help="keel train --set (repeatable)"
    )
    parser.add_argument("--steps", type=int, help="keel train --steps")
    parser.add_argument("--peer", type=Path, default=PEER, help="nanoGPT's checkout")
    parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON, help="its venv's python")
    parser.add_argument(
        "--peer-threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS for nanoGPT's training (default: torch's own, one per core)",
    )
    parser.add_argument("--reuse-nanogpt", type=Path, help="a previous run's results.json")
    parser.add_argument("--target-bpb", type=float, help="the target without a nanoGPT side")
    parser.add_argument("--out", type=Path, help="keep the work here (default: a temporary dir)")
    parser.add_argument("--smoke", action="store_true", help="a few iterations of each, seconds")
    arguments = parser.parse_args()
    smoke = arguments.smoke
    sets = [*(SMOKE_KEEL_SETS if smoke else ()), *arguments.sets]
    steps = SMOKE_KEEL_STEPS if smoke else arguments.steps
    with scratch_directory(arguments.out, "speedrun-") as scratch:
        pair = texts(arguments.train, arguments.eval, smoke)
        nanogpt: Side | None = None
        if arguments.reuse_nanogpt:
            previous = json.loads(arguments.reuse_nanogpt.read_text(encoding="utf-8"))
            nanogpt = side_from_json(previous["nanogpt"])
            progress(f"nanoGPT: reused from {arguments.reuse_nanogpt}")
        elif not arguments.peer_python.exists():
            if not smoke:
                raise SystemExit(
                    f"nanoGPT's venv {arguments.peer_python} is missing: python3 -m venv "
                    f"{arguments.peer_python.parents[1]} && pip install torch numpy there, "
                    "or run with --smoke to skip it"
                )
            progress(f"nanoGPT side skipped: no peer venv at {arguments.peer_python} (no torch)")
        else:
            nanogpt = run_nanogpt(
                arguments.peer, arguments.peer_python, pair, scratch, smoke, arguments.peer_threads
            )
        keel = run_keel(arguments.preset, sets, steps, pair, scratch)
        target = nanogpt.final_bpb if nanogpt else arguments.target_bpb
        budget = nanogpt.total_s if nanogpt else None
        numbers = compare(nanogpt, keel, target, budget)
        record = {
            "benchmark": "speedrun",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
            "smoke": smoke,
            "train": str(arguments.train) if not smoke else "bundled sample",
            "eval": str(arguments.eval) if not smoke else "bundled sample",
            **numbers,
            "nanogpt": asdict(nanogpt) if nanogpt else None,
            "keel": asdict(keel),
        }
        (scratch / "results.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
    print(table(nanogpt, keel, numbers))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
