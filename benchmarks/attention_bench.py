"""Attention implementations at growing sequence lengths: XLA's temporaries and the time of one
update step of tiny-dense (batch 1), `model.attention=xla` against `blockwise`.

Temporaries come from compiling the real update step ahead of time (keel.train.plan, nothing
allocated), so XLA's 47 GB at 16K tokens is reported without needing it. Step time is a jitted
forward + backward of the model's loss (median of --repeats after a warm-up call), run only where
the temporaries fit in --max-run-gib.

    python benchmarks/attention_bench.py --seq-lens 2048 8192 16384
    python benchmarks/attention_bench.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from keel.model.loss import cross_entropy
from keel.model.transformer import forward, init_params
from keel.train.config import apply_train_overrides
from keel.train.plan import plan_run
from keel.train.presets import preset


def config_for(attention: str, seq_len: int, layers: int | None):
    overrides = [f"phases.0.seq_len={seq_len}", "batch_size=1", f"model.attention={attention}"]
    if layers is not None:
        overrides.append(f"model.n_layers={layers}")
    return apply_train_overrides(preset("tiny-dense"), overrides)


def step_seconds(config, repeats: int) -> float:
    """Median seconds of one jitted forward + backward of the loss on [1, seq_len] tokens."""
    model, seq_len = config.model, config.phases[0].seq_len
    params = init_params(jax.random.key(0), model)
    window = jax.random.randint(jax.random.key(1), (1, seq_len + 1), 0, model.vocab_size)

    def loss(params):
        logits, _ = forward(params, window[:, :-1], model, None)
        return cross_entropy(logits, window[:, 1:], jnp.ones((1, seq_len))).cross_entropy

    grad = jax.jit(jax.grad(loss))
    jax.block_until_ready(grad(params))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(grad(params))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--attention", nargs="+", default=["xla", "blockwise"])
    parser.add_argument("--layers", type=int, default=None, help="override tiny-dense's 4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-run-gib", type=float, default=8.0)
    parser.add_argument("--smoke", action="store_true", help="128 tokens, one layer")
    args = parser.parse_args()
    if args.smoke:
        args.seq_lens, args.layers, args.repeats = [128], 1, 1
    device = jax.devices()[:1]
    rows = []
    print(f"{'attention':<10} {'tokens':>7} {'temp MiB':>10} {'step s':>8}")
    for attention in args.attention:
        for seq_len in args.seq_lens:
            config = config_for(attention, seq_len, args.layers)
            temp = plan_run(config, device).temp_bytes
            fits = temp <= args.max_run_gib * 2**30
            seconds = step_seconds(config, args.repeats) if fits else None
            rows.append({"attention": attention, "seq_len": seq_len, "temp_bytes": temp})
            rows[-1]["step_s"] = seconds
            shown = f"{seconds:8.2f}" if seconds is not None else "  (skip)"
            print(f"{attention:<10} {seq_len:>7} {temp / 2**20:>10.1f} {shown}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
