"""`keel train --gate N [--memory-limit BYTES]`: qualify a configuration before a long run.

The gate compiles the run's update step ahead of time (keel.train.plan: XLA's memory estimate per
device, nothing allocated), refuses it at once when that estimate is over the limit, then trains
the first N steps of the run as configured (its schedule, warmup included) in a temporary run
directory (removed afterwards; the run's own --output is never touched), and fails on a
non-finite loss or when the peak memory is over the limit. It reports the median tokens/s over
steps 2..N-1 (step 1 compiles; step N's time includes the end of the run, the loop's last
read-back) and the peak memory: the device's own peak where the platform
reports one (GPUs), else the process's peak resident memory (CPU).
"""

from __future__ import annotations

import contextlib
import math
import re
import statistics
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import jax

from keel.core.errors import KeelError, UsageError
from keel.core.process import peak_resident_bytes
from keel.train.config import TrainConfig
from keel.train.plan import format_bytes, plan_run
from keel.train.trainer import train

MIN_STEPS = 3
"""Step 1 compiles and step N ends the run: the median is over steps 2..N-1."""

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", re.IGNORECASE)


class GateFailed(KeelError):
    """The configuration did not pass the gate (exit 1): the figure reached and the limit."""


class _GateDone(Exception):
    """Raised from the trainer's step callback once the gate's N steps are done."""


@dataclass(frozen=True)
class GateResult:
    """What N gate steps measured. Bytes are per device for the estimate."""

    steps: int
    tokens_per_s: float
    """Median over steps 2..N-1."""
    peak_bytes: int
    peak_source: str
    """"device" (the accelerator's peak bytes in use) or "process" (peak resident memory)."""
    estimate_bytes: int
    """XLA's estimate for one update step: state on the device plus temporaries."""
    platform: str
    memory_limit: int | None
    final_loss: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        limit = "" if self.memory_limit is None else f", limit {format_bytes(self.memory_limit)}"
        return (
            f"gate passed: {self.steps} steps, median {self.tokens_per_s:,.0f} tokens/s (steps "
            f"2-{self.steps - 1}), peak memory {format_bytes(self.peak_bytes)} "
            f"({self.peak_source}), XLA estimate {format_bytes(self.estimate_bytes)} per device "
            f"({self.platform}){limit}, loss {self.final_loss:.3f}"
        )


def parse_memory_limit(text: str) -> int:
    """Bytes from `8000000000`, `8GB` (powers of 1000) or `8GiB` (powers of 1024)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise UsageError(f"--memory-limit {text!r}: expected bytes, e.g. 80GB or 80GiB")
    number, unit, binary = float(match[1]), match[2].lower(), bool(match[3])
    scale = 1024 ** "_kmgt".index(unit) if binary and unit else _UNITS[unit]
    return int(number * scale)


def run_gate(config: TrainConfig, steps: int, memory_limit: int | None) -> GateResult:
    """Compile, check the estimate, train the run's first `steps` steps in a temporary
    directory, check the losses and the peak memory; raise GateFailed naming the figure and
    the limit."""
    if not MIN_STEPS <= steps <= config.total_steps:
        raise UsageError(
            f"--gate {steps}: gate between {MIN_STEPS} steps (a median needs them) and the run's "
            f"{config.total_steps}"
        )
    plan = plan_run(config)
    if memory_limit is not None and plan.device_bytes > memory_limit:
        raise GateFailed(
            f"XLA's memory estimate {format_bytes(plan.device_bytes)} per device "
            f"({plan.platform}) exceeds --memory-limit {format_bytes(memory_limit)}"
        )
    lines: list[dict[str, Any]] = []

    def check(line: dict[str, Any]) -> None:
        if not math.isfinite(line["loss"]):
            raise GateFailed(f"loss is {line['loss']} at step {line['step']} of the gate")
        lines.append(line)
        if line["step"] == steps:
            raise _GateDone

    with (
        tempfile.TemporaryDirectory(prefix="keel-gate-") as run_dir,
        contextlib.suppress(_GateDone),  # raised once the N steps are done: the run stops there
    ):
        train(config, run_dir, on_step=check)
    peak, source = _peak_memory()
    if memory_limit is not None and peak > memory_limit:
        raise GateFailed(
            f"peak memory {format_bytes(peak)} ({source}) exceeds --memory-limit "
            f"{format_bytes(memory_limit)}"
        )
    timed = [line["tokens_per_s"] for line in lines if 2 <= line["step"] < steps]
    return GateResult(
        steps=steps,
        tokens_per_s=statistics.median(timed),
        peak_bytes=peak,
        peak_source=source,
        estimate_bytes=plan.device_bytes,
        platform=plan.platform,
        memory_limit=memory_limit,
        final_loss=lines[-1]["loss"],
    )


def _peak_memory() -> tuple[int, str]:
    """(bytes, "device") from the first device's own statistics where it keeps them, else
    (bytes, "process"): this process's peak resident set."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    return peak_resident_bytes(), "process"
