"""Memory and time of the expert-parallel transport on simulated CPU devices: 1 vs 3 waves, and
capacity 1.15 vs dropless pools, for one MoE block's forward and backward.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/moe_transport_bench.py
    python benchmarks/moe_transport_bench.py --smoke   # 4 of the devices, 64 tokens, 1 repeat

Prints one JSON line per variant: XLA's temporary bytes of the compiled forward and of the
forward + backward, the median seconds of forward + backward over --repeats calls, and the drop
rate under a router skewed toward two experts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import jax
import jax.numpy as jnp

from keel.model.config import ModelConfig
from keel.model.moe import init_moe, moe_forward
from keel.model.sharding import expert_mesh

VARIANTS = {
    "capacity 1.15, 1 wave": {"receive_capacity": 1.15, "dispatch_waves": 1},
    "capacity 1.15, 3 waves": {"receive_capacity": 1.15, "dispatch_waves": 3},
    "dropless pools, 1 wave": {"dropless": "pools", "dispatch_waves": 1},
    "dropless pools, 3 waves": {"dropless": "pools", "dispatch_waves": 3},
}


def measure(config: ModelConfig, devices: int, tokens: int, repeats: int, skew: float) -> dict:
    mesh = expert_mesh(devices)
    params = init_moe(jax.random.key(0), config)
    params = replace(params, router=params.router.at[0, :2].add(skew))
    x = jax.random.normal(jax.random.key(1), (devices * tokens, config.d_model)).at[:, 0].set(1)
    bias = jnp.zeros(config.n_routed_experts)

    def loss(params, x):
        y, stats = moe_forward(params, x, bias, config, mesh)
        return jnp.mean(y**2), stats

    forward = jax.jit(loss)
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    forward_bytes = forward.lower(params, x).compile().memory_analysis().temp_size_in_bytes
    step_bytes = step.lower(params, x).compile().memory_analysis().temp_size_in_bytes
    (_, stats), _ = jax.block_until_ready(step(params, x))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(params, x))
        seconds.append(time.perf_counter() - start)
    return {
        "forward_temp_mib": round(forward_bytes / 2**20, 2),
        "step_temp_mib": round(step_bytes / 2**20, 2),
        "step_ms_median": round(1e3 * statistics.median(seconds), 1),
        "drop_rate": round(float(stats.dropped / stats.assignments), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per device")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skew", type=float, default=0.5, help="router logit push, experts 0-1")
    parser.add_argument("--smoke", action="store_true", help="4 devices, 64 tokens, 1 repeat")
    args = parser.parse_args()
    if args.smoke:
        args.devices, args.tokens, args.repeats = 4, 64, 1
    if len(jax.devices()) < args.devices:
        parser.error(
            f"--devices {args.devices}: JAX sees {len(jax.devices())}; run with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={args.devices}"
        )
    base = ModelConfig(
        d_model=128, n_routed_experts=16, top_k=2, expert_ffn_dim=256, n_layers=2
    ).validate()
    for name, changes in VARIANTS.items():
        config = replace(base, **changes).validate()
        row = measure(config, args.devices, args.tokens, args.repeats, args.skew)
        print(json.dumps({"variant": name, "tokens_per_device": args.tokens, **row}), flush=True)


if __name__ == "__main__":
    main()
