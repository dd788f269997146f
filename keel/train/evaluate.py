"""`keel eval`: a trained run's checkpoint on lm-eval tasks read from local files, and its bits
per byte on named text sets, written to OUTPUT/eval.json and to telemetry (`eval.results`).

OUTPUT holds eval.json and tasks/ (the data files generated for bundled tasks); it is never the
run directory or inside it, which only its trainer writes. Telemetry gets one row per
(task, metric): ts, run, step, task, metric, value; a bits-per-byte set is the row
(task=<set name>, metric="bpb"). The target is the run's `telemetry`, else $KEEL_TELEMETRY,
as for training. Imports lm-eval (and pandas): only the `keel eval` command imports this module.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from keel.core import paths
from keel.core.errors import UsageError
from keel.telemetry.sink import TARGET_ENV, now, open_target
from keel.train.compile_cache import enable_compilation_cache
from keel.train.eval_tasks import task_configs
from keel.train.lm_eval_adapter import KeelLM
from keel.train.lm_scoring import DEFAULT_BATCH_SIZE, Scorer, rolling_requests
from keel.train.own_text import document_texts, eval_names
from keel.train.step import bits_per_byte
from keel.train.trained import checkpoint_step, load_trained

logger = logging.getLogger(__name__)

RESULTS_FILE = "eval.json"
RESULTS_NAMESPACE = "eval.results"


@dataclass(frozen=True)
class EvalRequest:
    run: str
    """A run directory (local or a URL)."""
    output: str
    """A local directory for eval.json; not the run directory nor inside it."""
    tasks: tuple[str, ...] = ()
    task_files: tuple[str, ...] = ()
    step: int | None = None
    """The checkpoint (default: the latest)."""
    limit: int | None = None
    """Documents per task (and per bits-per-byte set) at most; None: all."""
    eval_data: tuple[str, ...] = ()
    """Text sets (files or directories, read as `keel train --data` reads them) for bits per
    byte, each named by its file stem."""
    batch_size: int = DEFAULT_BATCH_SIZE
    """Sequences per forward pass."""


def run_eval(request: EvalRequest) -> dict[str, Any]:
    """Evaluate, write OUTPUT/eval.json and telemetry, and return what eval.json holds."""
    enable_compilation_cache()  # a later `keel eval` of this model loads its programs from disk
    output = _output_directory(request.output, request.run)
    step = checkpoint_step(request.run, request.step)
    names = eval_names(request.eval_data)
    texts = {
        name: document_texts(path, "--eval-data", request.limit)
        for name, path in zip(names, request.eval_data, strict=True)
    }
    work = output / "tasks"
    work.mkdir(parents=True, exist_ok=True)
    chosen = request.tasks or request.task_files or not request.eval_data
    configs = task_configs(request.tasks, request.task_files, work) if chosen else []
    trained = load_trained(request.run, step)
    max_length = max(phase.seq_len for phase in trained.config.phases)
    scorer = Scorer(trained, max_length, request.batch_size)
    model = KeelLM(scorer, Tokenizer.from_file(trained.tokenizer_path))
    began = time.perf_counter()
    tasks, samples = run_tasks(model, configs, request.limit) if configs else ({}, {})
    bpb = {name: _bits_per_byte(model, docs) for name, docs in texts.items()}
    results = {
        "run": request.run,
        "step": trained.step,
        "tasks": tasks,
        "samples": samples,
        "bpb": bpb,
        "limit": request.limit,
        "seconds": round(time.perf_counter() - began, 3),
    }
    paths.write_text(str(output / RESULTS_FILE), json.dumps(results, indent=2) + "\n")
    _report(trained.config.telemetry or os.environ.get(TARGET_ENV, ""), results)
    return results


def _output_directory(output: str, run: str) -> Path:
    """OUTPUT as a local path; UsageError when it is a URL or the run directory or inside it."""
    if not paths.is_local(output):
        raise UsageError(f"--output {output}: give a local directory (lm-eval reads local files)")
    target = Path(paths.local_path(output)).resolve()
    if paths.is_local(run):
        run_dir = Path(paths.local_path(run)).resolve()
        if target == run_dir or run_dir in target.parents:
            raise UsageError(
                f"--output {output} is inside the run directory {run}; only its trainer writes "
                "there: give another directory"
            )
    return target


def run_tasks(
    model: KeelLM, configs: Sequence[dict], limit: int | None
) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """lm-eval's simple_evaluate on the configs, at most `limit` documents per task (None: all):
    (task -> metric -> value, task -> documents). Metric names are lm-eval's (`metric,filter`)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    evaluated = simple_evaluate(
        model=model,
        tasks=list(configs),
        limit=limit,
        task_manager=TaskManager(include_defaults=False),
        bootstrap_iters=0,
        log_samples=False,
    )
    tasks = {}
    for task, values in evaluated["results"].items():
        tasks[task] = {
            metric: float(value)
            for metric, value in values.items()
            if "_stderr" not in metric and metric != "sample_len" and isinstance(value, int | float)
        }
    samples = {task: int(n["effective"]) for task, n in evaluated.get("n-samples", {}).items()}
    return tasks, samples


def _bits_per_byte(model: KeelLM, docs: Sequence[str]) -> float:
    """Bits per UTF-8 byte of the documents, each scored on its own from the end-of-document id
    (rolling windows of the model's context)."""
    windows = []
    for doc in docs:
        windows += rolling_requests(model.encode(doc), model.eos_id, model.scorer.max_length)
    nats = -sum(scored.logprob for scored in model.scorer.score(windows))
    return bits_per_byte(nats, sum(len(doc.encode("utf-8")) for doc in docs))


def _report(target: str, results: dict[str, Any]) -> None:
    """One eval.results row per task metric and bits-per-byte set (nothing without a target)."""
    if not target or not (results["tasks"] or results["bpb"]):
        return
    stamp, run, step = now(), results["run"], results["step"]
    rows = [
        {"ts": stamp, "run": run, "step": step, "task": task, "metric": metric, "value": value}
        for task, metrics in results["tasks"].items()
        for metric, value in metrics.items()
    ]
    rows += [
        {"ts": stamp, "run": run, "step": step, "task": name, "metric": "bpb", "value": value}
        for name, value in results["bpb"].items()
    ]
    client = open_target(target)
    try:
        client.write(RESULTS_NAMESPACE, rows)
    finally:
        client.close()
    logger.info("%d rows to %s at %s", len(rows), RESULTS_NAMESPACE, target)
