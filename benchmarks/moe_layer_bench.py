"""One MoE layer against the dense SwiGLU of matched active parameters: forward and forward +
backward, jitted, on one device.

    python benchmarks/moe_layer_bench.py [--preset tiny-moe] [--batch 16] [--seq 128]
        [--rounds 7] [--calls 10] [--kinds auto] [--pieces]
    python benchmarks/moe_layer_bench.py --smoke   # batch 2 x 32 tokens, 1 round of 2 calls (CI)

The MoE layer is `keel.model.moe.moe_forward` without a mesh (router, dispatch to the routed
experts, gate-weighted combine, shared experts) with the preset's model config; the dense peer is
`keel.model.layers.swiglu` with hidden (top_k + n_shared_experts) x expert_ffn_dim, the same
matmul parameters per token (the router's d_model x E aside). Both take x [batch x seq, d_model]
of standard normal float32 and the loss sum(y^2) / tokens; forward + backward is its gradient with
respect to the parameters and x. Each round times every contender in turn (interleaved): --calls
calls, each to `jax.block_until_ready`, after one untimed call; a contender's time is the median
over calls, then over rounds. `--kinds` lists model.grouped_matmul values to time ("auto" picks the
backend's path); `--pieces` also times the MoE layer's parts alone (the router; dispatch, routed
experts and combine on a fixed routing; the shared experts). Prints a table, the MoE / dense ratio
per kind, and one JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import jax
import jax.numpy as jnp

from keel.model.config import ModelConfig
from keel.model.dispatch import dispatch_dropless
from keel.model.grouped import expert_swiglu_for
from keel.model.layers import init_mlp, swiglu
from keel.model.moe import MoeParams, init_moe, moe_forward
from keel.model.router import route
from keel.train.presets import preset

GROUPED_KINDS = ("auto", "ragged", "blocks")


def _timed(fn: Callable, args: tuple, calls: int) -> float:
    """Median seconds of `calls` calls of the compiled `fn` (one untimed call first)."""
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _pair(loss: Callable, args: tuple, wrt: int = 2) -> dict[str, tuple[Callable, tuple]]:
    """The jitted forward (the loss) and forward + backward (its gradient over the first `wrt`
    arguments: the parameters and x)."""
    argnums = tuple(range(wrt))
    return {
        "forward": (jax.jit(loss), args),
        "forward+backward": (jax.jit(jax.grad(loss, argnums=argnums)), args),
    }


def contenders(model: ModelConfig, tokens: int, kinds: list[str], pieces: bool) -> dict:
    """{name: {"forward" | "forward+backward": (jitted function, arguments)}}."""
    x = jax.random.normal(jax.random.key(1), (tokens, model.d_model), jnp.float32)
    bias = jnp.zeros((model.n_routed_experts,), jnp.float32)
    hidden = (model.top_k + model.n_shared_experts) * model.expert_ffn_dim
    dense = init_mlp(jax.random.key(2), model.d_model, hidden, model.init_std, model.n_layers)
    moe = init_moe(jax.random.key(0), model)
    out = {"dense SwiGLU": _pair(lambda p, x: jnp.sum(swiglu(p, x) ** 2) / tokens, (dense, x))}
    for kind in kinds:
        config = replace(model, grouped_matmul=kind)

        def moe_loss(params: MoeParams, x: jax.Array, config: ModelConfig = config) -> jax.Array:
            return jnp.sum(moe_forward(params, x, bias, config, None)[0] ** 2) / tokens

        out[f"MoE layer ({kind})"] = _pair(moe_loss, (moe, x))
    if pieces:
        routing = route(x, moe.router, bias, model.router, model.top_k)
        out["  router"] = _pair(
            lambda w, x: jnp.sum(route(x, w, bias, model.router, model.top_k).gates ** 2),
            (moe.router, x),
        )
        for kind in kinds:
            expert_fn = expert_swiglu_for(kind)
            out[f"  dispatch + experts + combine ({kind})"] = _pair(
                lambda e, x, routing, fn=expert_fn: (
                    jnp.sum(dispatch_dropless(x, routing, e, fn) ** 2) / tokens
                ),
                (moe.experts, x, routing),  # an argument: XLA would fold a constant routing
            )
        if moe.shared is not None:
            out["  shared experts"] = _pair(
                lambda p, x: jnp.sum(swiglu(p, x) ** 2) / tokens, (moe.shared, x)
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-moe", help="the MoE model's preset")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10, help="timed calls per round")
    parser.add_argument("--kinds", default="auto", help="comma-separated model.grouped_matmul")
    parser.add_argument("--pieces", action="store_true", help="also time the layer's parts")
    parser.add_argument("--smoke", action="store_true", help="2 x 32 tokens, 1 round of 2 calls")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.seq, args.rounds, args.calls, args.pieces = 2, 32, 1, 2, True
    kinds = list(dict.fromkeys(args.kinds.split(",")))
    unknown = [kind for kind in kinds if kind not in GROUPED_KINDS]
    if unknown:
        parser.error(f"--kinds {','.join(unknown)}: each must be one of {GROUPED_KINDS}")
    if min(args.batch, args.seq, args.rounds, args.calls) < 1:
        parser.error("--batch, --seq, --rounds and --calls must be >= 1")
    model = preset(args.preset).model
    if not model.n_routed_experts:
        parser.error(f"--preset {args.preset}: not an MoE model")
    tokens = args.batch * args.seq
    runs = contenders(model, tokens, kinds, args.pieces)
    rounds: dict[str, dict[str, list[float]]] = {
        name: {mode: [] for mode in pair} for name, pair in runs.items()
    }
    for _ in range(args.rounds):
        for name, pair in runs.items():
            for mode, (fn, fn_args) in pair.items():
                rounds[name][mode].append(_timed(fn, fn_args, args.calls))
    ms = {
        name: {mode: 1e3 * statistics.median(values) for mode, values in modes.items()}
        for name, modes in rounds.items()
    }
    dense = ms["dense SwiGLU"]
    print(f"{tokens} tokens, {args.preset}, {jax.default_backend()}, medians of {args.rounds}")
    print(f"{'':44s} {'forward ms':>11s} {'fwd+bwd ms':>11s}")
    for name, times in ms.items():
        print(f"{name:44s} {times['forward']:11.2f} {times['forward+backward']:11.2f}")
    ratios = {}
    for kind in kinds:
        layer = ms[f"MoE layer ({kind})"]
        ratios[kind] = {mode: layer[mode] / dense[mode] for mode in layer}
        print(
            f"MoE ({kind}) / dense: forward {ratios[kind]['forward']:.2f}x, "
            f"forward + backward {ratios[kind]['forward+backward']:.2f}x"
        )
    report = {
        "preset": args.preset,
        "tokens": tokens,
        "backend": jax.default_backend(),
        "ms": ms,
        "rounds_ms": {
            name: {mode: [round(1e3 * v, 3) for v in values] for mode, values in modes.items()}
            for name, modes in rounds.items()
        },
        "ratio": ratios,
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
