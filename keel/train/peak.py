"""Peak FLOP/s per device, the denominator of MFU: a table of accelerators' dense bfloat16
peaks (vendor datasheets, without sparsity), or a matrix product timed on this device (CPUs, and
anything the table does not know)."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

DENSE_BF16_PEAK = {
    "H100": 989e12,
    "H200": 989e12,
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "A100": 312e12,
    "L4": 121e12,
}
"""FLOP/s by a substring of jax.Device.device_kind."""


def table_peak(device: jax.Device) -> float | None:
    """The datasheet peak for this device, or None when the table has no entry."""
    kind = device.device_kind.upper()
    for name, flops in DENSE_BF16_PEAK.items():
        if name in kind:
            return flops
    return None


def measured_matmul_peak(
    size: int = 2048,
    dtype: jnp.dtype = jnp.float32,
    repeats: int = 5,
    device: jax.Device | None = None,
) -> float:
    """FLOP/s of the fastest of `repeats` [size, size] x [size, size] products (2 size^3 FLOPs
    each) on `device`, compiled and warmed up first."""
    device = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    product = jax.jit(lambda x, y: x @ y)
    product(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def device_peak(device: jax.Device | None = None, compute_dtype: jnp.dtype = jnp.float32) -> float:
    """The table's peak for a known accelerator, else a measured matmul in `compute_dtype`,
    measured once per process and device (a sweep trains many runs in one process)."""
    return _device_peak(device or jax.devices()[0], jnp.dtype(compute_dtype))


@functools.cache
def _device_peak(device: jax.Device, compute_dtype: jnp.dtype) -> float:
    return table_peak(device) or measured_matmul_peak(dtype=compute_dtype, device=device)
