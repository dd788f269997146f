"""Training step time and MFU of keel's presets: dense against MoE at matched active parameters.

What it measures, per preset (medians over --repeats rounds, all in one process):
- compile s: tracing, lowering and XLA compilation of the jitted update (once per preset).
- step ms: the median of --steps timed updates, after --warmup untimed ones. Each update is
  the trainer's: `build_step_functions(...).update` (forward, backward, optimizer, router-bias
  step) on a fresh TrainState, timed from the call to `jax.block_until_ready` of its outputs.
  The batches are synthetic token ids (uniform in [0, vocab), [batch, seq + 1]), placed on the
  device before timing, so no token cache is read and no host-to-device copy is timed.
- MFU: flops_per_token(model, seq_len) * tokens per step / step seconds / peak FLOP/s.
  flops_per_token is PaLM's count (6 x active matmul parameters + attention scores and values;
  see keel/model/size.py): remat's recomputation, norms, softmax, routing and the optimizer are
  not counted, and the routed experts count top_k of n_routed_experts.
- peak: on CPU, `measured_matmul_peak` (float32 [n, n] x [n, n], n = --matmul-size) timed in
  each round, each round's MFU against that round's peak; on a GPU the datasheet's dense bf16
  peak (`table_peak`; H200: 989 TFLOP/s), with a bf16 matmul timed beside it and reported.
- With --breakdown, also the median time of the loss alone (forward) and of its gradient
  (forward + backward) with the same model and batch, so the optimizer's share is the rest.
- memory: what XLA's compiled update needs (arguments + outputs - aliased + temporaries).

    python benchmarks/train_bench.py [--device cpu] [--presets tiny-dense,tiny-moe]
        [--steps 20] [--warmup 3] [--repeats 3] [--breakdown]
    python benchmarks/train_bench.py --device gpu      # 1b-dense, 1b-moe in bfloat16
    python benchmarks/train_bench.py --device gpu --presets 1b-moe@ragged,1b-moe@blocks
    python benchmarks/train_bench.py --smoke   # the GPU path, shrunk, on any device (CI)

--device cpu computes in float32 (the peak is a float32 matmul); --device gpu in bfloat16 with
each preset's remat, and stops at once if jax sees no GPU. --smoke is what CI runs (on a CPU,
in ~20 s): the GPU path (bfloat16, remat on, the memory fitting and its probe step) on the tiny
presets at batch 4, 1 round of 1 timed step, a [256, 256] peak matmul, the table and the JSON line;
on a CPU, where XLA's compile dominates a smoke run, the jitted functions are compiled with
XLA's cheapest backend optimization (SMOKE_CPU_COMPILER_OPTIONS: the same program, compiled
in seconds, run slower), so its step times are not comparable to a real run's. A preset named
NAME@ragged or NAME@blocks sets model.grouped_matmul (the routed experts' grouped matmul;
"auto" picks ragged on TPU, blocks elsewhere). On the GPU path a preset whose update does not
fit in memory (XLA's estimate above the device's limit, or a probe step out of memory) is
retried at half the batch, down to --min-batch; no round starts that would end past
--budget-s (default 420 s), so the default GPU run stays inside a 10-minute slot. A preset
that fails is reported and the others still run. The table goes to stdout, then one JSON line
with every number; progress goes to stderr.
"""

from __future__ import annotations

import os

# The 1B MoE's float32 parameters, AdamW state and gradients take ~55 GB before activations:
# give XLA more than its default 75% of the GPU's memory (read when jax starts its backend).
if not {"XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"} & set(os.environ):
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.92"

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np

from keel.core.errors import KeelError, UsageError
from keel.model.grouped import expert_swiglu_for
from keel.model.loss import cross_entropy, target_mask
from keel.model.size import flops_per_token, model_size
from keel.model.transformer import forward, init_params, init_router_bias, param_labels
from keel.train.checkpoint import TrainState
from keel.train.config import TrainConfig
from keel.train.layout import plan_layout
from keel.train.optim import build_optimizer
from keel.train.peak import measured_matmul_peak, table_peak
from keel.train.presets import preset
from keel.train.schedule import piecewise_lr
from keel.train.step import build_step_functions

DEFAULT_KEYS = ("presets", "steps", "warmup", "repeats", "matmul_size", "budget_s", "min_batch")
DEFAULTS = {
    "cpu": ("tiny-dense,tiny-moe", 20, 3, 3, 2048, 0.0, 0),
    "gpu": ("1b-dense,1b-moe", 10, 3, 2, 8192, 420.0, 2),
    "smoke": ("tiny-dense,tiny-moe", 1, 0, 1, 256, 0.0, 2),
}
SMOKE_BATCH = 4
SMOKE_CPU_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}
"""XLA options for a smoke run on a CPU: they cut the CPU seconds of compiling the tiny presets'
updates and initializers about 3x (~40 s to ~13 s on 2 loaded cores); the steps run slower, which
a smoke run does not measure."""
GROUPED_KINDS = ("auto", "ragged", "blocks")
GIB = 2**30


@dataclass
class Bench:
    """One preset's compiled update and what the rounds measured."""

    name: str
    config: TrainConfig
    update: jax.stages.Compiled
    init: Callable[[], TrainState]
    """A fresh state (parameters from the config's seed, zero optimizer state)."""
    state_shapes: TrainState
    """The state's shapes and dtypes (jax.ShapeDtypeStruct leaves)."""
    compile_s: float
    memory: tuple[int, int] | None
    """XLA's (held, temporary) bytes for one update; see _memory."""
    first_batch: int = 0
    """The batch size tried first (the preset's), when memory made this one smaller."""
    smoke: bool = False
    """Compiled for a smoke run (see compiler_options)."""
    breakdown: dict | None = None
    """{"forward": compiled loss, "backward": compiled gradient}"""
    rounds: list[dict] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return self.config.phases[0].seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.seq_len


def bench_config(spec: str, device: str, smoke: bool, batch_size: int = 0) -> TrainConfig:
    """The preset named by `spec` ("NAME" or "NAME@KIND", KIND a model.grouped_matmul) as this
    benchmark runs it: float32 on CPU, bfloat16 (and remat in a smoke run) on the GPU path;
    `batch_size` > 0 replaces the preset's."""
    name, _, kind = spec.partition("@")
    config = preset(name)
    if kind:
        if kind not in GROUPED_KINDS:
            raise UsageError(
                f"{spec!r}: after '@' comes a model.grouped_matmul: {', '.join(GROUPED_KINDS)}"
            )
        config = replace(config, model=replace(config.model, grouped_matmul=kind))
    if device == "cpu":
        config = replace(config, compute_dtype="float32")
    else:
        config = replace(config, compute_dtype="bfloat16")
    if smoke:
        config = replace(config, batch_size=SMOKE_BATCH, remat=True)
    return replace(config, batch_size=batch_size) if batch_size else config


def check_device(device: str, smoke: bool) -> jax.Device:
    first = jax.devices()[0]
    if device == "gpu" and not smoke and first.platform != "gpu":
        kinds = ", ".join(sorted({d.device_kind for d in jax.devices()}))
        raise SystemExit(
            f"train_bench --device gpu: jax sees no GPU (only {first.platform}: {kinds}); run it "
            "on a GPU machine with jax's CUDA build (pip install 'jax[cuda12]'), or use "
            "--device cpu, or --smoke to exercise this path on a CPU"
        )
    return first


def synthetic_windows(config: TrainConfig, count: int, seed: int) -> list[jax.Array]:
    """`count` batches of uniform token ids [batch, seq + 1] int32, already on the device."""
    rng = np.random.default_rng(seed)
    shape = (config.batch_size, config.phases[0].seq_len + 1)
    vocab = config.model.vocab_size
    return [jax.device_put(rng.integers(0, vocab, shape, dtype=np.int32)) for _ in range(count)]


def _memory(compiled: jax.stages.Compiled) -> tuple[int, int] | None:
    """XLA's estimate for one update: (bytes held across steps: arguments + outputs - aliased,
    temporary bytes), or None where the backend gives none."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    held = (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
    )
    return held, analysis.temp_size_in_bytes


def _loss_fn(config: TrainConfig):
    """The update's loss (cross entropy + z-losses), for the forward/backward breakdown."""
    model = config.model
    dtype = jnp.bfloat16 if config.compute_dtype == "bfloat16" else jnp.float32

    def loss(params, router_bias, window):
        inputs, targets = window[:, :-1], window[:, 1:]
        logits, stats = forward(
            params, inputs, model, router_bias, compute_dtype=dtype, remat=config.remat
        )
        parts = cross_entropy(logits, targets, target_mask(inputs, None))
        total = parts.cross_entropy + model.z_loss_weight * parts.z_loss
        if stats is not None:
            total = total + model.router.z_loss_weight * stats.z_loss.sum()
        return total

    return loss


def compiler_options(smoke: bool) -> dict | None:
    """XLA options for every function this benchmark compiles: the cheap ones for a smoke run on
    a CPU, None (XLA's defaults) otherwise."""
    if smoke and jax.devices()[0].platform == "cpu":
        return dict(SMOKE_CPU_COMPILER_OPTIONS)
    return None


def prepare(name: str, device: str, smoke: bool, batch_size: int = 0) -> Bench:
    """Build the preset's update from the trainer's public pieces and compile it."""
    config = bench_config(name, device, smoke, batch_size).validate()
    model = config.model
    options = compiler_options(smoke)
    learning_rate = piecewise_lr(config.segments())
    key = jax.random.key(config.seed)
    labels = param_labels(jax.eval_shape(lambda k: init_params(k, model), key))
    optimizer = build_optimizer(config.optimizer, learning_rate, labels)
    token_bytes = jnp.asarray(np.ones(model.vocab_size, np.int32))
    layout = plan_layout(config, optimizer, jax.devices()[:1])
    functions = build_step_functions(
        config, optimizer, learning_rate, token_bytes, eos_id=0, layout=layout
    )

    def fresh_state(key: jax.Array) -> TrainState:
        params = init_params(key, model)
        return TrainState(
            params=params,
            opt_state=optimizer.init(params),
            router_bias=init_router_bias(model),
            step=jnp.zeros((), jnp.int32),
            rng=jax.random.key_data(key),
        )

    init_state = jax.jit(fresh_state, out_shardings=layout.state, compiler_options=options)

    def init() -> TrainState:
        return init_state(jax.random.key(config.seed))  # fresh: the update donates its key data

    state = jax.eval_shape(fresh_state, key)
    window = jax.ShapeDtypeStruct((config.batch_size, config.phases[0].seq_len + 1), jnp.int32)
    started = time.perf_counter()
    update = functions.update.lower(state, window).compile(compiler_options=options)
    compile_s = time.perf_counter() - started
    return Bench(name, config, update, init, state, compile_s, _memory(update), smoke=smoke)


def compile_breakdown(bench: Bench) -> None:
    """The loss alone and its gradient, compiled for the same shapes as the update."""
    loss = _loss_fn(bench.config)
    state = bench.state_shapes
    window = jax.ShapeDtypeStruct((bench.config.batch_size, bench.seq_len + 1), jnp.int32)
    args = (state.params, state.router_bias, window)
    options = compiler_options(bench.smoke)
    bench.breakdown = {
        "forward": jax.jit(loss).lower(*args).compile(compiler_options=options),
        "backward": jax.jit(jax.grad(loss)).lower(*args).compile(compiler_options=options),
    }


def memory_limit() -> int | None:
    """Bytes XLA may allocate on the first device (None where it does not say, as on CPU)."""
    return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")


def _out_of_memory(error: Exception) -> bool:
    text = str(error)
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in text or "Out of memory" in text


def prepare_fitting(name: str, device: str, smoke: bool, min_batch: int) -> Bench:
    """`prepare`, halving the batch while the update does not fit in the device's memory (XLA's
    estimate above the device's limit, or one probe update running out), down to `min_batch`
    (0: never)."""
    batch_size = first_batch = 0
    while True:
        bench = prepare(name, device, smoke, batch_size)
        batch_size = bench.config.batch_size
        first_batch = first_batch or batch_size
        bench.first_batch = first_batch
        limit = memory_limit()
        held, temp = bench.memory or (0, 0)
        try:
            if limit and held + temp > limit:
                raise MemoryError(
                    f"XLA needs {(held + temp) / GIB:.1f} GiB, the device has {limit / GIB:.1f}"
                )
            run_round(bench, steps=1, warmup=0, seed=0)
            return bench
        except Exception as error:
            if not _out_of_memory(error) or not min_batch or batch_size // 2 < max(min_batch, 1):
                raise
            # Temporaries scale with the batch, the state does not: skip halvings that the
            # estimate already rules out (keeping a tenth of the limit spare), then try.
            smaller = batch_size // 2
            while (
                limit
                and smaller // 2 >= min_batch
                and held + temp * smaller / batch_size > 0.9 * limit
            ):
                smaller //= 2
            _log(f"{name}: batch {batch_size} does not fit ({str(error)[:160]}); trying {smaller}")
            del bench
            batch_size = smaller


def _timed(fn, *args) -> tuple[float, object]:
    started = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - started, out


def run_round(bench: Bench, steps: int, warmup: int, seed: int) -> dict:
    """A fresh state, `warmup` untimed and `steps` timed updates; seconds of each timed one."""
    windows = synthetic_windows(bench.config, warmup + steps, seed)
    state = jax.block_until_ready(bench.init())
    seconds, losses = [], []
    for index, window in enumerate(windows):
        elapsed, (state, metrics) = _timed(bench.update, state, window)
        losses.append(float(metrics["loss"]))
        if index >= warmup:
            seconds.append(elapsed)
    if not all(np.isfinite(losses)):
        raise RuntimeError(f"{bench.name}: non-finite loss in the timed steps: {losses}")
    result = {"step_s": statistics.median(seconds), "all_step_s": seconds, "loss": losses}
    if bench.breakdown is not None:
        for part, compiled in bench.breakdown.items():
            times = []
            for index, window in enumerate(windows):
                elapsed, _ = _timed(compiled, state.params, state.router_bias, window)
                if index >= warmup:
                    times.append(elapsed)
            result[f"{part}_s"] = statistics.median(times)
    del state
    return result


def measure_peaks(device: str, size: int, first: jax.Device) -> dict:
    """This round's measured matmul FLOP/s, and the datasheet peak where the table has one."""
    dtype = jnp.float32 if device == "cpu" else jnp.bfloat16
    measured = measured_matmul_peak(size=size, dtype=dtype, repeats=10, device=first)
    table = None if device == "cpu" else table_peak(first)
    return {"measured": measured, "table": table, "basis": table or measured}


def grouped_kind(config: TrainConfig) -> str | None:
    """The routed experts' grouped matmul as this backend resolves it; None for a dense model."""
    if not config.model.is_moe:
        return None
    return expert_swiglu_for(config.model.grouped_matmul).name


def summarize(bench: Bench) -> dict:
    """Medians over the rounds (MFU per round against that round's peak)."""
    flops = flops_per_token(bench.config.model, bench.seq_len) * bench.tokens_per_step
    size = model_size(bench.config.model)
    rounds = bench.rounds
    out = {
        "preset": bench.name,
        "params_total": size.total,
        "params_active": size.active,
        "params_active_matmul": size.active_matmul,
        "batch_size": bench.config.batch_size,
        "first_batch_size": bench.first_batch,
        "seq_len": bench.seq_len,
        "tokens_per_step": bench.tokens_per_step,
        "flops_per_step": flops,
        "compute_dtype": bench.config.compute_dtype,
        "grouped_matmul": grouped_kind(bench.config),
        "remat": bench.config.remat,
        "compile_s": bench.compile_s,
        "xla_memory_bytes": sum(bench.memory) if bench.memory else None,
        "step_s": statistics.median(r["step_s"] for r in rounds),
        "step_s_rounds": [r["step_s"] for r in rounds],
        "mfu": statistics.median(flops / r["step_s"] / r["peak"]["basis"] for r in rounds),
        "mfu_vs_measured": statistics.median(
            flops / r["step_s"] / r["peak"]["measured"] for r in rounds
        ),
        "loss_first_last": [rounds[0]["loss"][0], rounds[0]["loss"][-1]],
    }
    out["tokens_per_s"] = bench.tokens_per_step / out["step_s"]
    for part in ("forward", "backward"):
        if f"{part}_s" in rounds[0]:
            out[f"{part}_s"] = statistics.median(r[f"{part}_s"] for r in rounds)
    return out


def _count(count: int) -> str:
    return f"{count / 1e6:,.2f}M" if count < 1e9 else f"{count / 1e9:,.2f}B"


def table(results: list[dict], peaks: list[dict], size: int, dtype: str) -> str:
    datasheet = peaks[0]["table"]
    basis = "datasheet peak" if datasheet else "measured peak"
    columns = ["preset", "params total / active", "tokens/step", "compile s", "step ms"]
    columns += ["tokens/s", f"MFU vs {basis}"]
    columns += ["MFU vs measured matmul"] if datasheet else []
    columns += ["XLA memory GiB"]
    lines = ["| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * (len(columns) - 1)]
    notes = []
    for r in results:
        kind = r.get("grouped_matmul")
        label = r["preset"] + (f" ({kind})" if kind and "@" not in r["preset"] else "")
        if "error" in r:
            notes.append(f"{r['preset']} failed: {r['error']}")
        if r.get("first_batch_size", 0) > r.get("batch_size", 0):
            notes.append(
                f"{r['preset']}: batch {r['first_batch_size']} did not fit in memory; "
                f"measured at batch {r['batch_size']}"
            )
        if "step_s" not in r:
            lines.append(f"| {label} | failed |" + " |" * (len(columns) - 2))
            continue
        cells = [
            label,
            f"{_count(r['params_total'])} / {_count(r['params_active'])}",
            f"{r['tokens_per_step']:,}",
            f"{r['compile_s']:.1f}",
            f"{r['step_s'] * 1e3:,.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu']:.1%}",
        ]
        cells += [f"{r['mfu_vs_measured']:.1%}"] if datasheet else []
        memory = r["xla_memory_bytes"]
        cells += [f"{memory / GIB:.2f}" if memory is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    measured = [p["measured"] / 1e9 for p in peaks]
    lines.append("")
    lines += [f"- {note}" for note in notes] + ([""] if notes else [])
    lines.append(
        f"Measured peak: {dtype} [{size}, {size}] matmul, {statistics.median(measured):,.1f} "
        f"GFLOP/s (median; rounds: {', '.join(f'{m:,.1f}' for m in measured)})"
        + (f"; datasheet peak {datasheet / 1e12:,.0f} TFLOP/s." if datasheet else ".")
    )
    if any("forward_s" in r for r in results):
        lines += ["", "| preset | forward ms | forward + backward ms | full update ms |"]
        lines.append("| --- | ---: | ---: | ---: |")
        for r in results:
            if "forward_s" in r:
                lines.append(
                    f"| {r['preset']} | {r['forward_s'] * 1e3:,.1f} | "
                    f"{r['backward_s'] * 1e3:,.1f} | {r['step_s'] * 1e3:,.1f} |"
                )
    return "\n".join(lines)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _failure(error: Exception) -> str:
    traceback.print_exc()
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def run(
    benches: dict[str, Bench], device: str, size: int, began: float, args
) -> tuple[list[dict], dict[str, str]]:
    """--repeats rounds of (matmul peak, each preset); the rounds' peaks and the presets that
    failed. A round that would end more than --budget-s after `began` (time.monotonic(), the
    start of the run) is not started; the first always runs."""
    peaks, errors = [], {}
    steps, warmup = args.steps, args.warmup
    last_round_s: dict[str, float] = {}
    for repeat in range(args.repeats):
        names = [name for name in benches if name not in errors]
        if repeat and args.budget_s:
            elapsed = time.monotonic() - began
            names = [name for name in names if elapsed + last_round_s[name] <= args.budget_s]
            if not names:
                _log(f"stopping after {repeat} round(s): another would end past --budget-s")
                break
        peak = measure_peaks(device, size, jax.devices()[0])
        peaks.append(peak)
        gflops = peak["measured"] / 1e9
        _log(f"round {repeat + 1}/{args.repeats}: matmul {size}: {gflops:,.1f} GFLOP/s")
        for name in names:
            round_began = time.monotonic()
            try:
                result = run_round(benches[name], steps, warmup, seed=repeat)
            except Exception as error:
                errors[name] = _failure(error)
                continue
            last_round_s[name] = time.monotonic() - round_began
            benches[name].rounds.append({**result, "peak": peak})
            _log(f"round {repeat + 1}/{args.repeats} {name}: step {result['step_s'] * 1e3:,.1f} ms")
    return peaks, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument(
        "--smoke", action="store_true", help="the GPU path, shrunk, on any device (what CI runs)"
    )
    parser.add_argument(
        "--presets", help="comma-separated presets, each NAME or NAME@ragged / NAME@blocks"
    )
    parser.add_argument("--steps", type=int, help="timed steps per round")
    parser.add_argument("--warmup", type=int, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, help="rounds (each: peak, then every preset)")
    parser.add_argument("--matmul-size", type=int, help="n of the timed [n, n] matmul")
    parser.add_argument("--breakdown", action="store_true", help="also time forward, backward")
    parser.add_argument("--budget-s", type=float, help="start no round that would end later")
    parser.add_argument("--min-batch", type=int, help="halve a batch that does not fit down to")
    args = parser.parse_args()
    device = "gpu" if args.smoke else args.device
    defaults = DEFAULTS["smoke" if args.smoke else device]
    for key, default in zip(DEFAULT_KEYS, defaults, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, default)
    names = list(dict.fromkeys(args.presets.split(",")))
    steps, warmup, size = args.steps, args.warmup, args.matmul_size
    if steps < 1 or warmup < 0 or args.repeats < 1 or size < 1:
        raise SystemExit("--steps, --repeats and --matmul-size must be >= 1, --warmup >= 0")
    try:
        for name in names:
            bench_config(name, device, args.smoke).validate()
    except KeelError as error:
        raise SystemExit(f"train_bench: {error}") from None
    first = check_device(device, args.smoke)
    started, began = datetime.datetime.now(datetime.UTC), time.monotonic()
    _log(f"device: {first.device_kind} ({first.platform}), {jax.device_count()} visible")

    benches: dict[str, Bench] = {}
    compile_errors: dict[str, str] = {}
    for name in names:
        try:
            benches[name] = prepare_fitting(name, device, args.smoke, args.min_batch)
            if args.breakdown:
                compile_breakdown(benches[name])
        except Exception as error:  # a preset that does not fit: report it, run the others
            compile_errors[name] = _failure(error)
            continue
        _log(f"{name}: compiled in {benches[name].compile_s:.1f} s")
    peaks, errors = run(benches, device, size, began, args)
    errors = {**compile_errors, **errors}

    results = []
    for name in names:
        bench = benches.get(name)
        result = summarize(bench) if bench is not None and bench.rounds else {"preset": name}
        if name in errors:
            result["error"] = errors[name]
        results.append(result)
    dtype = "float32" if device == "cpu" else "bfloat16"
    print(table(results, peaks, size, dtype))
    report = {
        "benchmark": "train",
        "date": started.isoformat(timespec="seconds"),
        "device": device,
        "smoke": args.smoke,
        "device_kind": first.device_kind,
        "platform": first.platform,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "steps": steps,
        "warmup": warmup,
        "repeats": args.repeats,
        "rounds_run": len(peaks),
        "matmul_size": size,
        "matmul_dtype": dtype,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "compiler_options": compiler_options(args.smoke),
        "peaks": peaks,
        "results": results,
    }
    print(json.dumps(report))
    if errors:
        raise SystemExit(f"train_bench: {len(errors)} preset(s) failed: {', '.join(errors)}")


if __name__ == "__main__":
    main()
