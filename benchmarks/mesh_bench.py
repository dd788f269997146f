"""Step time and per-device state bytes of MoE presets on CPU meshes: today's replicated layout
(every device a data-parallel replica holding all parameters and optimizer state) against fsdp
and expert layouts, on 1, 4 and 8 simulated devices in one process and on 2 processes x 4.

Per (preset, devices, mesh), in a fresh process whose CPU backend simulates the devices:
- compile s: lowering and compiling the trainer's update for the layout (once).
- step ms: the median of --steps timed updates after one untimed, each timed from the call to
  `jax.block_until_ready` of its outputs; the batches are synthetic token ids, made per process
  for its own rows (keel.train.layout.place_batch), so no cache is read.
- state MB/device: parameters + optimizer state held by the fullest device, read from the live
  arrays' shards (keel.train.layout.shard_bytes).
The 2 x 4 gang is two copies of this script joined by jax.distributed over gloo
(keel.core.gang.run_local_gang); process 0 reports. float32 throughout; 100m-moe runs at a
CPU-sized batch (--batch, --seq-len) so a step takes seconds, not minutes.

    python benchmarks/mesh_bench.py [--presets tiny-moe,100m-moe] [--devices 1,4,8,2x4]
        [--steps 5] [--repeats 1] [--skip replicated]
    python benchmarks/mesh_bench.py --smoke     # CI: tiny-moe, fsdp 2 x expert 2, 1 step

The table goes to stdout, then one JSON line with every number; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import replace

LAYOUTS: dict[int, list[tuple[str, tuple[int, int, int]]]] = {
    1: [("one device", (1, 1, 1))],
    4: [
        ("replicated (data 4)", (4, 1, 1)),
        ("fsdp 4", (1, 4, 1)),
        ("fsdp 2 x expert 2", (1, 2, 2)),
    ],
    8: [
        ("replicated (data 8)", (8, 1, 1)),
        ("fsdp 2 x expert 4", (1, 2, 4)),
        ("data 2 x fsdp 2 x expert 2", (2, 2, 2)),
    ],
}
GANG = ("2 processes x 4: fsdp 2 x expert 4", (1, 2, 4))


def _config(name: str, mesh: tuple[int, int, int], batch: int, seq_len: int):
    from keel.core.config import apply_overrides
    from keel.model.sharding import MeshConfig
    from keel.train.presets import preset

    config = apply_overrides(
        preset(name),
        [f"phases.0.seq_len={seq_len}", "phases.0.schedule.warmup_steps=1", "remat=false"],
    )
    return replace(
        config, batch_size=batch, steps=100, compute_dtype="float32", mesh=MeshConfig(*mesh)
    ).validate()


def measure(name: str, mesh: tuple[int, int, int], batch: int, seq_len: int, steps: int) -> dict:
    """One layout in this process (all of its gang's devices): compile s, step ms, bytes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from keel.train.layout import initial_state, place_batch, shard_bytes
    from keel.train.schedule import piecewise_lr
    from keel.train.step import build_step_functions

    config = _config(name, mesh, batch, seq_len)
    learning_rate = piecewise_lr(config.segments())
    state, optimizer, layout = initial_state(config, learning_rate)
    vocab = config.model.vocab_size
    functions = build_step_functions(
        config, optimizer, learning_rate, jnp.ones(vocab, jnp.int32), 0, layout
    )
    shape = (batch, seq_len + 1)
    windows = [
        np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int32)
        for seed in range(steps + 1)
    ]
    batches = [place_batch(layout, window.__getitem__, shape) for window in windows]
    started = time.perf_counter()
    update = functions.update.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - started
    state_bytes = shard_bytes((state.params, state.opt_state))
    seconds = []
    for index, window in enumerate(batches):
        started = time.perf_counter()
        state, metrics = jax.block_until_ready(update(state, window))
        if index:
            seconds.append(time.perf_counter() - started)
    return {
        "compile_s": compile_s,
        "step_ms": 1000 * statistics.median(seconds),
        "state_mb_per_device": state_bytes / 2**20,
        "loss": float(metrics["loss"]),
    }


def _worker(args: argparse.Namespace) -> None:
    """In a fresh process: every layout of args.devices devices (or the gang's), one JSON line."""
    import jax

    from keel.train.distributed import initialize_from_env

    gang = initialize_from_env()
    if gang is None:
        jax.config.update("jax_num_cpu_devices", args.worker)
    layouts = [GANG] if gang is not None else LAYOUTS[args.worker]
    if args.smoke:
        layouts = layouts[-1:]
    if args.skip:
        layouts = [(label, mesh) for label, mesh in layouts if args.skip not in label]
    results = []
    for preset_name in args.presets.split(","):
        batch = args.batch if preset_name != "tiny-moe" else 16
        seq_len = args.seq_len if preset_name != "tiny-moe" else (32 if args.smoke else 128)
        for label, mesh in layouts:
            row = measure(preset_name, mesh, batch, seq_len, args.steps)
            results.append(
                {
                    "preset": preset_name,
                    "layout": label,
                    "devices": 8 if gang else args.worker,
                    **row,
                }
            )
            _log(f"{preset_name} {label}: {row['step_ms']:.1f} ms/step")
    if gang is None or gang.process == 0:
        print(json.dumps(results), flush=True)


def _run_worker(args: argparse.Namespace, devices: int) -> list[dict]:
    argv = [sys.executable, __file__, "--worker", str(devices), "--presets", args.presets]
    argv += ["--steps", str(args.steps), "--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    argv += ["--smoke"] if args.smoke else []
    argv += ["--skip", args.skip] if args.skip else []
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KEEL_DEVICES")}
    if devices == 0:  # the gang: two processes of four devices
        from keel.core.gang import free_port, gang_env

        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        coordinator = f"127.0.0.1:{free_port()}"
        members = [
            subprocess.Popen(
                argv, env={**env, **gang_env(coordinator, i, 2)}, stdout=subprocess.PIPE, text=True
            )
            for i in range(2)
        ]
        outputs = [member.communicate()[0] for member in members]
        if any(member.returncode for member in members):
            raise RuntimeError(f"gang worker failed: {[m.returncode for m in members]}")
        return json.loads(outputs[0].strip().splitlines()[-1])
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _log(message: str) -> None:
    print(f"[mesh_bench] {message}", file=sys.stderr, flush=True)


def table(rows: list[dict]) -> str:
    lines = [
        "| preset | devices | layout | step ms | vs replicated | state MB/device | compile s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        base = next(
            (
                r
                for r in rows
                if r["preset"] == row["preset"]
                and r["devices"] == row["devices"]
                and r["layout"].startswith("replicated")
            ),
            None,
        )
        ratio = f"{row['step_ms'] / base['step_ms']:.2f}" if base else ""
        lines.append(
            f"| {row['preset']} | {row['devices']} | {row['layout']} | {row['step_ms']:.1f} | "
            f"{ratio} | {row['state_mb_per_device']:.2f} | {row['compile_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny-moe,100m-moe")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every layout")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (not tiny-moe)")
    parser.add_argument("--seq-len", type=int, default=256, help="(not tiny-moe)")
    parser.add_argument(
        "--devices", default="1,4,8,2x4", help="device counts to run: of 1, 4, 8 and 2x4 (the gang)"
    )
    parser.add_argument(
        "--skip", default="", help="leave out layouts whose name has this, e.g. replicated"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny-moe, one 4-device layout")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args)
        return
    device_counts = [0 if count == "2x4" else int(count) for count in args.devices.split(",")]
    if args.smoke:
        args.presets, args.steps, args.repeats, device_counts = "tiny-moe", 1, 1, [4]
    runs: list[list[dict]] = []
    for repeat in range(args.repeats):
        rows = []
        for devices in device_counts:
            _log(f"round {repeat + 1}: {devices or '2 x 4'} devices")
            rows += _run_worker(args, devices)
        runs.append(rows)
    merged = []
    for index, row in enumerate(runs[0]):
        same = [run[index] for run in runs]
        merged.append(
            {**row, **{k: statistics.median(r[k] for r in same) for k in ("step_ms", "compile_s")}}
        )
    print(table(merged))
    print(
        json.dumps(
            {
                "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                "repeats": args.repeats,
                "rows": merged,
            }
        )
    )


if __name__ == "__main__":
    main()
