"""`keel sample` against transformers' `generate`, and `keel eval` against lm-eval's HF backend,
on the same tiny trained model (CPU, float32), in one run.

The run: a token cache of the bundled Wikipedia sample (keel/experiments/sample/), a tiny-dense
model trained a few steps on it in a scratch directory (or --run DIR, an existing run), exported
with `keel export --format hf`'s function (export_hf, in this process). Then:

1. Generation tokens/s, batch 1 and 8 (--batches). Both sides get the same prompt tokens
   ([batch, --prompt-tokens] ids: the first tokens of distinct documents, no padding), greedy,
   exactly --new-tokens new tokens (no stop token on either side).
   - keel: `keel.model.generate.generate`, the function `keel sample` calls (jitted prefill,
     then one jitted step per token over the key/value cache).
   - transformers: `AutoModelForCausalLM.from_pretrained(export).generate(do_sample=False,
     max_new_tokens=N)` under `torch.inference_mode`, eos_token_id unset.
   Timing window, the same for both: one whole call (prefill + every decode step, the returned
   tokens on the host), after one untimed warm-up call each, so jit compilation (keel) and
   first-call costs (transformers) are excluded; the warm-up calls' times are reported apart
   ("first call"). tokens/s = batch x new tokens / seconds; the repeats alternate keel and
   transformers; medians. Sanity check: the greedy tokens of both, compared position by position
   (printed: identical rows, and the first differing position otherwise; a tiny model can have
   near-ties that float rounding breaks differently).
2. Eval throughput, requests/s, on the bundled multiple-choice task (wikitext_cloze, 4 choices:
   4 loglikelihood requests a document), --limit documents, batch size 8 on both sides.
   - keel: `keel.train.evaluate.run_eval`, the function `keel eval RUN --tasks wikitext_cloze
     --limit N --output DIR` calls (checkpoint load, task build, lm-eval's simple_evaluate over
     keel's adapter, eval.json written).
   - lm-eval: `lm_eval.simple_evaluate(model="hf", model_args={pretrained: export, device:
     cpu, dtype: float32}, batch_size=8)` on the same task config.
   Timing window: the whole call (model load included on both sides), after one warm-up call
   each (keel's jit compilation excluded; its first call reported apart). Both accuracies are
   printed: the same model must score the same.

    python benchmarks/sample_bench.py [--repeats 5] [--new-tokens 64] [--limit 100]
        [--run RUNDIR] [--out DIR]
    python benchmarks/sample_bench.py --smoke   # CI: 1 layer, vocab 512, 2 training steps, ~30 s
    python benchmarks/sample_bench.py --eval-only --run RUNDIR   # part 2 alone, on a trained run

Needs torch, transformers and lm-eval (pip install 'keel[interop,eval]'); without them it stops
with one line, --smoke included (CI installs them). Prints a table per part, then one JSON line
with every number.
"""

from __future__ import annotations

import os

# Nothing downloads: transformers, datasets and lm-eval read local files only (set before import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import datetime
import gzip
import importlib.util
import json
import logging
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from measure import scratch_directory

from keel.core.config import apply_overrides
from keel.data.documents import write_texts
from keel.data.token_cache import TokenCache
from keel.data.tokenize import TokenizeConfig, run_tokenize
from keel.flow import RunOptions
from keel.model.generate import SamplingConfig, generate
from keel.train.hf_export import export_hf
from keel.train.presets import preset
from keel.train.trained import TrainedModel, load_trained
from keel.train.trainer import train

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO / "keel/experiments/sample/wikitext2.jsonl.gz"
PEERS = ("torch", "transformers", "lm_eval", "accelerate")
"""The peers' modules; lm-eval's HF backend imports accelerate (lm-eval's `hf` extra)."""
TASK = "wikitext_cloze"
EVAL_BATCH = 8
"""Sequences per forward pass on both sides (keel eval's EvalRequest default)."""


@dataclass(frozen=True)
class Setup:
    """What a configuration trains and measures."""

    overrides: tuple[str, ...]
    """On top of the tiny-dense preset."""
    vocab: int
    batches: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int
    repeats: int
    limit: int
    """Documents of the multiple-choice task."""


FULL = Setup(
    overrides=(
        "batch_size=4",
        "phases.0.seq_len=512",
        "steps=30",
        "checkpoint_every=30",
        "eval_every=1000",
        "phases.0.schedule.warmup_steps=3",
    ),
    vocab=4096,
    batches=(1, 8),
    prompt_tokens=32,
    new_tokens=64,
    repeats=5,
    limit=100,
)
SMOKE = Setup(
    overrides=(
        "model.n_layers=1",
        "batch_size=4",
        "phases.0.seq_len=512",
        "steps=2",
        "checkpoint_every=2",
        "eval_every=1000",
        "phases.0.schedule.warmup_steps=1",
    ),
    vocab=512,
    batches=(1, 8),
    prompt_tokens=16,
    new_tokens=16,
    repeats=1,
    limit=4,
)


STARTED = time.perf_counter()


def progress(message: str) -> None:
    """A progress line on stderr, with the seconds since the script started."""
    print(f"[{time.perf_counter() - STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


def require_peers() -> None:
    """Stop with one line when torch, transformers or lm-eval is missing (smoke mode too: CI
    installs them, so a missing one is a broken environment, not a skip)."""
    missing = [name for name in PEERS if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"error: sample_bench needs {', '.join(missing)}: pip install 'keel[interop,eval]' "
            "'accelerate>=0.26'"
        )


def train_tiny(scratch: Path, setup: Setup) -> Path:
    """A token cache of the bundled sample and a tiny-dense run on it; the run directory."""
    with gzip.open(WIKITEXT, "rt", encoding="utf-8") as lines:
        texts = [json.loads(line)["text"] for line in lines]
    progress(f"tokenizing the bundled sample (vocabulary {setup.vocab})")
    docs = write_texts(scratch / "docs", texts)
    cache = scratch / "cache"
    run_tokenize(docs, str(cache), TokenizeConfig(vocab_size=setup.vocab), RunOptions(workers=1))
    overrides = [f"data=[{{cache: {cache}}}]", f"model.vocab_size={setup.vocab}", *setup.overrides]
    config = apply_overrides(preset("tiny-dense"), overrides)
    run = scratch / "run"
    progress(f"training {config.steps} steps")
    train(config, str(run), devices=jax.devices()[:1])
    return run


def export(trained: TrainedModel, output: Path) -> str:
    """The model as `keel export RUN --format hf --output OUTPUT` writes it (the function that
    command calls, in this process: a second process would only add its start); the class."""
    progress("keel export --format hf")
    return export_hf(trained, str(output)).name


def prompt_tokens(trained: TrainedModel, batch: int, length: int) -> np.ndarray:
    """[batch, length] int32: the first `length` tokens of `batch` distinct documents of the
    run's token cache."""
    sources = trained.config.data
    rows = []
    for document in TokenCache(sources[0].cache).documents():
        if len(document) > length:
            rows.append(np.asarray(document[:length], np.int32))
        if len(rows) == batch:
            return np.stack(rows)
    raise SystemExit(f"the token cache has fewer than {batch} documents of {length} tokens")


def keel_generate(trained: TrainedModel, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """[batch, new_tokens] greedy tokens, as `keel sample --temperature 0` draws them."""
    sampling = SamplingConfig(max_tokens=new_tokens, temperature=0.0)
    result = generate(trained.params, trained.model, trained.router_bias, prompt, sampling)
    return result.tokens


def hf_generate(model, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """[batch, new_tokens] greedy tokens from transformers' generate (no stop token)."""
    import torch

    ids = torch.from_numpy(prompt.astype(np.int64))
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
        )
    return out[:, prompt.shape[1] :].numpy()


def timed(call) -> tuple[float, object]:
    began = time.perf_counter()
    result = call()
    return time.perf_counter() - began, result


def bench_generation(trained: TrainedModel, export_dir: Path, setup: Setup) -> list[dict]:
    """Per batch size: first-call and median seconds and tokens/s of both, and the token check."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # generate exactly new_tokens, as keel does
    model.generation_config.pad_token_id = trained.eos_id
    rows = []
    for batch in setup.batches:
        progress(f"generation, batch {batch}")
        prompt = prompt_tokens(trained, batch, setup.prompt_tokens)
        n = setup.new_tokens
        contenders = {
            "keel": lambda p=prompt, n=n: keel_generate(trained, p, n),
            "transformers": lambda p=prompt, n=n: hf_generate(model, p, n),
        }
        first = {name: timed(call) for name, call in contenders.items()}
        seconds: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(setup.repeats):
            for name, call in contenders.items():
                seconds[name].append(timed(call)[0])
        keel_tokens, hf_tokens = first["keel"][1], first["transformers"][1]
        row = {"batch": batch, "prompt_tokens": setup.prompt_tokens, "new_tokens": n}
        for name in contenders:
            median = statistics.median(seconds[name])
            row[name] = {
                "first_call_s": round(first[name][0], 4),
                "median_s": round(median, 4),
                "runs_s": [round(s, 4) for s in seconds[name]],
                "tokens_per_s": round(batch * n / median, 1),
            }
        row["same_tokens"] = token_check(keel_tokens, hf_tokens)
        rows.append(row)
    return rows


def token_check(keel_tokens: np.ndarray, hf_tokens: np.ndarray) -> dict:
    """How many rows are identical, and per differing row its first differing position."""
    differing = {}
    for row, (ours, theirs) in enumerate(zip(keel_tokens, hf_tokens, strict=True)):
        mismatch = np.flatnonzero(ours != theirs)
        if mismatch.size:
            differing[row] = int(mismatch[0])
    return {
        "rows": len(keel_tokens),
        "identical_rows": len(keel_tokens) - len(differing),
        "first_difference": differing,
    }


def bench_eval(run: Path, export_dir: Path, scratch: Path, setup: Setup) -> dict:
    """keel eval's run_eval against lm-eval's HF backend on the bundled multiple-choice task."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from keel.train.eval_tasks import cloze_documents, task_configs
    from keel.train.evaluate import EvalRequest, run_eval

    documents = cloze_documents()[: setup.limit]
    requests = sum(len(doc["choices"]) for doc in documents)
    config = task_configs((TASK,), (), _fresh(scratch / "hf-tasks"))[0]
    max_length = max(phase.seq_len for phase in load_trained(str(run)).config.phases)  # keel's
    calls = 0

    def keel_call() -> float:
        nonlocal calls
        calls += 1
        request = EvalRequest(
            run=str(run),
            output=str(scratch / f"keel-eval-{calls}"),
            tasks=(TASK,),
            limit=setup.limit,
            batch_size=EVAL_BATCH,
        )
        return run_eval(request)["tasks"][TASK]["acc,none"]

    def hf_call() -> float:
        evaluated = simple_evaluate(
            model="hf",
            model_args={
                "pretrained": str(export_dir),
                "device": "cpu",
                "dtype": "float32",
                "max_length": max_length,
            },
            tasks=[config],
            limit=setup.limit,
            batch_size=EVAL_BATCH,
            task_manager=TaskManager(include_defaults=False),
            bootstrap_iters=0,
            log_samples=False,
        )
        return float(evaluated["results"][TASK]["acc,none"])

    contenders = {"keel": keel_call, "lm-eval hf": hf_call}
    progress(f"eval: {TASK}, {len(documents)} documents")
    first = {name: timed(call) for name, call in contenders.items()}
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(setup.repeats):
        for name, call in contenders.items():
            seconds[name].append(timed(call)[0])
    result = {
        "task": TASK,
        "documents": len(documents),
        "requests": requests,
        "batch_size": EVAL_BATCH,
    }
    for name in contenders:
        median = statistics.median(seconds[name])
        result[name] = {
            "first_call_s": round(first[name][0], 3),
            "median_s": round(median, 3),
            "runs_s": [round(s, 3) for s in seconds[name]],
            "requests_per_s": round(requests / median, 1),
            "acc": first[name][1],
        }
    return result


def _fresh(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def print_generation(rows: list[dict]) -> None:
    print("\ngeneration (greedy, CPU float32; window: one whole call, prefill + decode, warm)")
    print(f"{'batch':>5} {'contender':<13} {'first call s':>12} {'median s':>9} {'tokens/s':>9}")
    for row in rows:
        for name in ("keel", "transformers"):
            r = row[name]
            print(
                f"{row['batch']:>5} {name:<13} {r['first_call_s']:>12.3f} "
                f"{r['median_s']:>9.4f} {r['tokens_per_s']:>9.1f}"
            )
        check = row["same_tokens"]
        print(
            f"      same greedy tokens: {check['identical_rows']}/{check['rows']} rows "
            f"identical over {row['new_tokens']} tokens"
            + (
                f"; first differing position per row {check['first_difference']}"
                if check["first_difference"]
                else ""
            )
        )


def print_eval(result: dict) -> None:
    print(
        f"\neval: {result['task']}, {result['documents']} documents = {result['requests']} "
        f"loglikelihood requests, batch {result['batch_size']}; window: one whole call"
    )
    print(f"{'contender':<11} {'first call s':>12} {'median s':>9} {'requests/s':>10} {'acc':>6}")
    for name in ("keel", "lm-eval hf"):
        r = result[name]
        print(
            f"{name:<11} {r['first_call_s']:>12.2f} {r['median_s']:>9.3f} "
            f"{r['requests_per_s']:>10.1f} {r['acc']:>6.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CI: a tiny configuration, seconds")
    parser.add_argument("--run", type=Path, help="an existing run directory (skips training)")
    parser.add_argument("--out", type=Path, help="keep the scratch files here")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--limit", type=int, help="documents of the multiple-choice task")
    parser.add_argument(
        "--eval-only", action="store_true", help="measure the eval part only (no generation)"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch.set_num_threads (default: torch's, one per core); on a loaded machine 1 "
        "avoids its thread pool's oversubscription",
    )
    args = parser.parse_args()
    require_peers()
    setup = SMOKE if args.smoke else FULL
    setup = Setup(
        **{
            **setup.__dict__,
            **{
                k: v
                for k, v in {
                    "repeats": args.repeats,
                    "new_tokens": args.new_tokens,
                    "limit": args.limit,
                }.items()
                if v is not None
            },
        }
    )
    for noisy in ("lm_eval", "lm-eval", "transformers", "datasets", "absl", "keel"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import torch
    import transformers

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    with scratch_directory(args.out, "sample-bench-") as scratch:
        os.environ.setdefault("HF_DATASETS_CACHE", str(scratch / "hf-datasets"))
        began = time.perf_counter()
        run = args.run or train_tiny(scratch, setup)
        trained_s = time.perf_counter() - began
        export_dir = scratch / "hf"
        trained = load_trained(str(run))
        exported = export(trained, export_dir)
        print(
            f"run {run} (step {trained.step}, trained in {trained_s:.1f} s), exported as "
            f"{exported} to {export_dir}",
            flush=True,
        )
        generation = [] if args.eval_only else bench_generation(trained, export_dir, setup)
        if generation:
            print_generation(generation)
        evaluation = bench_eval(run, export_dir, scratch, setup)
        print_eval(evaluation)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join(sys.argv),
        "versions": {
            "jax": jax.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "lm_eval": _version("lm_eval"),
        },
        "torch_threads": torch.get_num_threads(),
        "model": {
            "layers": trained.model.n_layers,
            "d_model": trained.model.d_model,
            "vocab": trained.model.vocab_size,
        },
        "generation": generation,
        "eval": evaluation,
    }
    print(json.dumps(report))


def _version(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution.replace("_", "-"))


if __name__ == "__main__":
    main()
