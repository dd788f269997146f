"""`keel train --plan`: what one update step of a run needs per device, without allocating it.

`plan_run` lays the run out on its mesh (keel.train.layout), then compiles the real update step
(keel.train.step) ahead of time on abstract arrays: every input a jax.ShapeDtypeStruct carrying
its layout's sharding, so nothing is initialised or allocated, and a 535B-parameter model plans
on a laptop's CPU. It reports, per device (the largest device where shards differ):

- parameters, gradients, optimizer state and the rest of the state (router bias, step, RNG key):
  each leaf's shard shape x itemsize, read from the shardings. Gradients are float32 in the
  parameters' layout, so they are counted as the parameters' bytes (XLA holds them as
  temporaries; see below).
- temporaries: XLA's memory analysis of the compiled executable (temp_size_in_bytes: buffers live
  inside the step, activations saved for the backward pass and gradients among them), for the
  platform it was compiled for ("cpu" when simulated: XLA:CPU's fusion and scheduling differ from a
  GPU's, so this is an estimate of the order, not the GPU's number).
- FLOPs per token (keel.model.size: 6 x active matmul parameters + attention), and per step.
- all-to-all bytes per step from the expert exchange's pool shapes (see `AllToAll`).

The compiled step goes into keel's compilation cache (keel.train.compile_cache), so planning the
same config again, or a `--gate` of it, loads the program from disk (compile_s is then the
load's seconds).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keel.model.dispatch import exchange_capacities
from keel.model.sharding import ALL_AXES, EXPERT_AXIS, SEQUENCE_AXIS
from keel.model.size import flops_per_token, model_size
from keel.model.transformer import init_params, init_router_bias, param_labels
from keel.train.checkpoint import TrainState
from keel.train.compile_cache import enable_compilation_cache
from keel.train.config import TrainConfig
from keel.train.layout import (
    HOST_MEMORY,
    RunLayout,
    fresh_balance_state,
    param_shapes,
    plan_layout,
    run_devices,
)
from keel.train.optim import build_optimizer
from keel.train.schedule import piecewise_lr
from keel.train.step import build_step_functions

logger = logging.getLogger(__name__)

ID_BYTES = 4
"""The exchange's expert ids are int32."""
FLAG_BYTES = 1
"""Its kept flags travel as bool."""


@dataclass(frozen=True)
class AllToAll:
    """The expert exchange of one device and one step (dispatch.dispatch_expert_parallel).

    Per MoE layer, each device hands every all-to-all a buffer of n x C_send rows (n devices on
    the expert axis, C_send rows per destination): forward, the token rows [n, C_send, d_e] in
    the compute dtype and their expert ids [n, C_send] int32 go out, and the results
    [n, C_send, d_e] and kept flags [n, C_send] bool come back; backward, the two row exchanges
    run again transposed (cotangents of the results and of the rows, compute dtype; the id and
    flag exchanges have no cotangent). With dispatch_waves W the same bytes move in W exchanges
    of 1/W each. With remat the forward exchanges also run a second time in the
    backward pass. Of each buffer, the block addressed to the device itself stays on it: bytes
    leaving a device are the buffer's (n - 1) / n. These are the program's bytes (bfloat16 rows
    with bfloat16 compute, as a GPU moves them); XLA:CPU compiles bfloat16 all-to-alls as
    float32, so simulated devices move twice the row bytes.
    """

    devices: int
    """n: devices on the expert axis."""
    tokens_per_device: int
    """Tokens each device routes per MoE layer: batch x seq / all devices."""
    send_rows: int
    """C_send: rows a device may send to each destination."""
    receive_rows: int
    """C_recv: received rows a device computes."""
    row_bytes: int
    """One row: d_e x the compute dtype's bytes."""
    layer_forward_bytes: int
    """Bytes one device hands the forward pass's four all-to-alls of one layer (rows, ids,
    results, kept flags)."""
    layer_backward_bytes: int
    """Bytes it hands the backward pass's all-to-alls of one layer (two row cotangents, plus the
    recomputed forward with remat)."""
    moe_layers: int
    step_bytes: int
    """Buffer bytes per device per step: (forward + backward) x MoE layers."""
    step_bytes_sent: int
    """What leaves each device per step: step_bytes x (n - 1) / n."""


@dataclass(frozen=True)
class RunPlan:
    """One update step of a run on its mesh; bytes are per device, the largest device."""

    devices: int
    mesh: dict[str, int]
    """Devices per axis: data, fsdp, expert, and sequence when it splits sequences (> 1)."""
    platform: str
    """What XLA compiled for ("cpu" when simulated)."""
    batch_size: int
    seq_len: int
    """The longest phase's sequence length (the step that needs the most)."""
    compute_dtype: str
    remat: bool
    total_params: int
    active_params: int
    param_bytes: int
    grad_bytes: int
    """Gradients: float32 in the parameters' layout, so equal to param_bytes."""
    opt_state_bytes: int
    opt_state_memory: str
    """"device", or "pinned_host" when optimizer.offload_state keeps it in host memory."""
    other_state_bytes: int
    """Router bias, step and RNG key (replicated)."""
    temp_bytes: int
    """XLA's temporaries of the compiled step (activations, gradients, the update's buffers)."""
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    """Output bytes that reuse donated argument buffers (the state is donated)."""
    flops_per_token: float
    """Training FLOPs (forward + backward) per token at seq_len, without remat's recompute."""
    flops_per_step_per_device: float
    alltoall: AllToAll | None
    """None without expert parallelism (expert axis of size 1 or a dense model)."""
    compile_s: float

    @property
    def device_bytes(self) -> int:
        """State on the device plus XLA's temporaries: what the step needs of device memory
        (gradients are inside the temporaries)."""
        on_device = self.param_bytes + self.other_state_bytes
        if self.opt_state_memory != HOST_MEMORY:
            on_device += self.opt_state_bytes
        return on_device + self.temp_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: every field, device_bytes, and the all-to-all's fields (or None)."""
        out = asdict(self)
        out["device_bytes"] = self.device_bytes
        return out

    def lines(self) -> list[str]:
        """A human-readable table, one line per figure."""
        mesh = " x ".join(f"{axis} {size}" for axis, size in self.mesh.items())
        state_where = "host" if self.opt_state_memory == HOST_MEMORY else "device"
        rows = [
            ("mesh", f"{mesh} = {self.devices} devices ({self.platform})"),
            (
                "step",
                f"batch {self.batch_size} x seq {self.seq_len}, {self.compute_dtype}"
                f"{', remat' if self.remat else ''}",
            ),
            (
                "parameters",
                f"{_count(self.total_params)} total, {_count(self.active_params)} active per token",
            ),
            ("per device", ""),
            ("  parameters", format_bytes(self.param_bytes)),
            ("  gradients", format_bytes(self.grad_bytes)),
            (f"  optimizer state ({state_where})", format_bytes(self.opt_state_bytes)),
            ("  other state", format_bytes(self.other_state_bytes)),
            (f"  temporaries (XLA:{self.platform})", format_bytes(self.temp_bytes)),
            (
                "  device total",
                f"{format_bytes(self.device_bytes)} (state on device + temporaries)",
            ),
            ("FLOPs per token", f"{self.flops_per_token:.3e}"),
            ("FLOPs per step per device", f"{self.flops_per_step_per_device:.3e}"),
        ]
        if self.alltoall is None:
            rows.append(("all-to-all per step", "none (no expert parallelism)"))
        else:
            a = self.alltoall
            rows += [
                (
                    "all-to-all per step",
                    f"{format_bytes(a.step_bytes)} per device, "
                    f"{format_bytes(a.step_bytes_sent)} leaving it "
                    f"({a.moe_layers} MoE layers over {a.devices} devices)",
                ),
                (
                    "  pools",
                    f"{a.tokens_per_device} tokens per device, C_send {a.send_rows} rows per "
                    f"destination, C_recv {a.receive_rows}",
                ),
            ]
        rows.append(("compile", f"{self.compile_s:.1f} s"))
        width = max(len(name) for name, _ in rows)
        return [f"{name:<{width}}  {value}".rstrip() for name, value in rows]


@dataclass(frozen=True)
class CompiledStep:
    """The update step compiled ahead of time for a run's layout, with what it was compiled on."""

    config: TrainConfig
    devices: list
    layout: RunLayout
    state: TrainState
    """The TrainState as ShapeDtypeStructs in the layout's shardings."""
    seq_len: int
    batch: int
    """Sequences per step of the phase compiled for (the longest one's)."""
    executable: jax.stages.Compiled
    compile_s: float


def plan_run(config: TrainConfig, devices: list | None = None) -> RunPlan:
    """Compile one update step of `config` ahead of time on abstract arrays for its mesh over
    `devices` (default: `layout.run_devices()`) and report what it needs per device."""
    return describe(compile_step(config, devices))


def compile_step(config: TrainConfig, devices: list | None = None) -> CompiledStep:
    """`jax.jit(update).lower(...).compile()` on ShapeDtypeStructs: nothing is initialised or
        allocated. The window is the longest phase's: [its sequences per step, its seq_len + 1]
    (batch_tokens keeps tokens per step level across phases, so the longest phase holds the most
    activations per sequence); token_bytes an abstract
        [vocab] int32 (only evaluation reads it)."""
    config = config.validate()
    devices = run_devices(devices)
    longest = max(config.phases, key=lambda phase: phase.seq_len)
    seq_len, batch = longest.seq_len, longest.sequences_per_step(config.batch_size)
    learning_rate = piecewise_lr(config.segments())
    shapes = param_shapes(config)
    optimizer = build_optimizer(config.optimizer, learning_rate, param_labels(shapes))
    layout = plan_layout(config, optimizer, devices, shapes)
    state = _abstract_state(config, optimizer, layout.state)
    window_shape = (batch, seq_len + 1)
    window = jax.ShapeDtypeStruct(window_shape, jnp.int32, sharding=layout.batch)
    token_bytes = jax.ShapeDtypeStruct((config.model.vocab_size,), jnp.int32)
    functions = build_step_functions(config, optimizer, learning_rate, token_bytes, 0, layout)
    enable_compilation_cache()  # planning the same step again loads it from disk
    started = time.perf_counter()
    executable = functions.update.lower(state, window).compile()
    compile_s = time.perf_counter() - started
    logger.info("compiled the update step for %d devices in %.1f s", len(devices), compile_s)
    return CompiledStep(config, devices, layout, state, seq_len, batch, executable, compile_s)


def describe(step: CompiledStep) -> RunPlan:
    """The RunPlan of a compiled step: bytes from its shardings and XLA's memory analysis."""
    config, state, seq_len, devices = step.config, step.state, step.seq_len, len(step.devices)
    batch = step.batch
    platform = step.devices[0].platform
    memory = step.executable.memory_analysis()
    if memory is None:
        raise RuntimeError(f"XLA reported no memory analysis on {platform}")
    size = model_size(config.model)
    mesh_sizes = {axis: int(step.layout.mesh.shape[axis]) for axis in ALL_AXES}
    if mesh_sizes[SEQUENCE_AXIS] == 1:
        del mesh_sizes[SEQUENCE_AXIS]
    per_token = flops_per_token(config.model, seq_len)
    param_bytes = sharded_bytes(state.params)
    opt_kinds = {s.memory_kind for s in jax.tree.leaves(step.layout.state.opt_state)}
    return RunPlan(
        devices=devices,
        mesh=mesh_sizes,
        platform=platform,
        batch_size=batch,
        seq_len=seq_len,
        compute_dtype=config.compute_dtype,
        remat=config.remat,
        total_params=size.total,
        active_params=size.active,
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        opt_state_bytes=sharded_bytes(state.opt_state),
        opt_state_memory=HOST_MEMORY if HOST_MEMORY in opt_kinds else "device",
        other_state_bytes=sharded_bytes(
            (state.router_bias, state.step, state.rng, state.balance_state)
        ),
        temp_bytes=int(memory.temp_size_in_bytes),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        flops_per_token=per_token,
        flops_per_step_per_device=per_token * batch * seq_len / devices,
        alltoall=alltoall_plan(config, batch, seq_len, mesh_sizes, devices),
        compile_s=step.compile_s,
    )


def alltoall_plan(
    config: TrainConfig, batch: int, seq_len: int, mesh: dict[str, int], devices: int
) -> AllToAll | None:
    """The expert exchange's bytes per device and step (see `AllToAll`); None without one."""
    model = config.model
    n = mesh[EXPERT_AXIS]
    if not model.is_moe or n == 1:
        return None
    tokens = batch * seq_len // devices
    worst = model.dropless != "off"  # dropless pools (and ragged's receive buffer): no limit
    c_send, c_recv = exchange_capacities(
        tokens,
        model.top_k,
        n,
        None if worst else model.send_capacity,
        None if worst else model.receive_capacity,
        model.dispatch_waves,
    )
    pool = n * c_send
    dtype_bytes = jnp.dtype(jnp.bfloat16 if config.compute_dtype == "bfloat16" else jnp.float32)
    row_bytes = (model.latent_dim or model.d_model) * dtype_bytes.itemsize
    rows = pool * row_bytes
    forward = 2 * rows + pool * (ID_BYTES + FLAG_BYTES)
    backward = 2 * rows + (forward if config.remat else 0)
    step = (forward + backward) * model.n_moe_layers
    return AllToAll(
        devices=n,
        tokens_per_device=tokens,
        send_rows=c_send,
        receive_rows=c_recv,
        row_bytes=row_bytes,
        layer_forward_bytes=forward,
        layer_backward_bytes=backward,
        moe_layers=model.n_moe_layers,
        step_bytes=step,
        step_bytes_sent=step * (n - 1) // n,
    )


def sharded_bytes(tree: Any) -> int:
    """Bytes of `tree`'s abstract arrays (ShapeDtypeStructs with shardings) that one device
    holds: each leaf's slice on that device x itemsize, summed per device; the largest device."""
    per_device: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        itemsize = np.dtype(leaf.dtype).itemsize
        for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
            count = math.prod(
                len(range(*part.indices(dim))) for part, dim in zip(index, leaf.shape, strict=True)
            )
            per_device[device] = per_device.get(device, 0) + count * itemsize
    return max(per_device.values(), default=0)


def _abstract_state(config: TrainConfig, optimizer: Any, shardings: TrainState) -> TrainState:
    """The run's TrainState as ShapeDtypeStructs in `shardings` (nothing allocated)."""
    key = jax.random.key(config.seed)

    def fresh() -> TrainState:
        params = init_params(key, config.model)
        return TrainState(
            params=params,
            opt_state=optimizer.init(params),
            router_bias=init_router_bias(config.model),
            step=jnp.zeros((), jnp.int32),
            rng=jax.random.key_data(key),
            balance_state=fresh_balance_state(config.model),
        )

    return jax.tree.map(
        lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
        jax.eval_shape(fresh),
        shardings,
    )


def format_bytes(count: float) -> str:
    """Bytes in binary units: `512 B`, `1.5 KiB`, ... `2.0 TiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} TiB"


def _count(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
