"""Device meshes. Expert parallelism uses one mesh axis, EXPERT_AXIS: the batch's tokens are
split over it (data parallel everywhere outside the MoE blocks) and so are the routed experts."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

from keel.core.errors import ConfigError

EXPERT_AXIS = "expert"


def expert_mesh(devices: int) -> Mesh:
    """A 1-D mesh of the first `devices` devices along EXPERT_AXIS."""
    available = jax.device_count()
    if not 1 <= devices <= available:
        raise ConfigError(
            f"expert parallelism over {devices} devices, but {available} are visible "
            "(on CPU, simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    return jax.make_mesh(
        (devices,), (EXPERT_AXIS,), devices=jax.devices()[:devices], axis_types=(AxisType.Auto,)
    )
