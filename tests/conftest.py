"""Simulate 8 CPU devices for the expert-parallel tests. XLA reads the flag when JAX starts its
CPU backend, so it is set here, before any test module imports jax; single-device code still
runs on device 0."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
