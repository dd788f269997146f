"""Device meshes: four named axes; the batch split over three of them, each sequence's tokens over
the fourth.

    data    replicas: each holds whole parameters (as the other axes leave them) and its share of
            the batch; gradients are all-reduced over it
    fsdp    fully sharded data parallel: parameters, gradients and optimizer state are split
            over it (see partition.py) and gathered by XLA where a layer uses them; it also
            takes a share of the batch
    expert  routed experts are split over it and tokens reach them by all-to-all (dispatch.py);
            it also takes a share of the batch
    sequence  context parallelism: each sequence's tokens are split over it and attention runs
            as ring attention (ring.py); everything else is token-wise (default 1)

The batch's leading axis is split over (data, fsdp, expert) (MESH_AXES), so every device computes
on batch / (data x fsdp x expert) sequences, seq_len / sequence tokens of each. Devices are laid
out in `jax.devices()` order with `sequence` fastest, then `expert`, so a ring (whose every step
moves keys and values) and an expert group are the devices of one process wherever they fit and
`data` groups span hosts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from keel.core.errors import ConfigError

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
EXPERT_AXIS = "expert"
SEQUENCE_AXIS = "sequence"
MESH_AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS)
"""The axes a batch's rows are split over."""
ALL_AXES = (*MESH_AXES, SEQUENCE_AXIS)
"""Every axis of a mesh, in device order (the last fastest)."""
BATCH_SPEC = PartitionSpec(MESH_AXES)
"""A batch's leading axis split over the batch axes (replicated over `sequence`)."""
ACTIVATION_SPEC = PartitionSpec(MESH_AXES, SEQUENCE_AXIS)
"""[batch, seq, ...] activations: rows over the batch axes, tokens over `sequence`."""


@dataclass(frozen=True)
class MeshConfig:
    """Devices per mesh axis; one axis may be -1, meaning the devices the others leave."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    sequence: int = 1
    """Devices each sequence's tokens are split over (ring attention); seq_len must be a
    multiple of 2 x sequence (the zigzag split, ring.py)."""

    def validate(self) -> MeshConfig:
        sizes = self._sizes()
        if any(size == 0 or size < -1 for size in sizes):
            raise ConfigError(f"mesh sizes must be >= 1 (or -1 for the rest), got {self._text()}")
        if sizes.count(-1) > 1:
            raise ConfigError(f"at most one mesh axis may be -1, got {self._text()}")
        return self

    def resolve(self, devices: int) -> tuple[int, int, int, int]:
        """(data, fsdp, expert, sequence) on `devices` devices; ConfigError unless they multiply
        to it."""
        self.validate()
        sizes = self._sizes()
        known = math.prod(size for size in sizes if size != -1)
        if -1 in sizes:
            if devices % known:
                raise ConfigError(
                    f"mesh {self._text()}: the {devices} devices do not divide by {known}; "
                    f"{_hint(devices)}"
                )
            sizes = tuple(devices // known if size == -1 else size for size in sizes)
        elif known != devices:
            raise ConfigError(
                f"mesh {self._text()} has {known} devices but {devices} are visible; "
                f"{_hint(devices)}"
            )
        return sizes  # type: ignore[return-value]

    def _sizes(self) -> tuple[int, int, int, int]:
        return (self.data, self.fsdp, self.expert, self.sequence)

    def _text(self) -> str:
        """ "data 2 x fsdp 1 x expert 4", with "x sequence n" when the sequence axis is set."""
        return " x ".join(
            f"{name} {size}"
            for name, size in zip(ALL_AXES, self._sizes(), strict=True)
            if name != SEQUENCE_AXIS or size != 1
        )


def _hint(devices: int) -> str:
    return (
        f"make mesh.data x mesh.fsdp x mesh.expert x mesh.sequence equal {devices} (one may be "
        "-1), or "
        "change the devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
    )


def build_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The (data, fsdp, expert, sequence) mesh over `devices` (default: every device of every
    process)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = config.resolve(len(devices))
    return jax.make_mesh(shape, ALL_AXES, devices=devices, axis_types=(AxisType.Auto,) * 4)


def expert_mesh(devices: int) -> Mesh:
    """A mesh of the first `devices` devices, all on EXPERT_AXIS (data and fsdp of size 1)."""
    available = jax.device_count()
    if not 1 <= devices <= available:
        raise ConfigError(
            f"expert parallelism over {devices} devices, but {available} are visible "
            "(on CPU, simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    return build_mesh(MeshConfig(data=1, fsdp=1, expert=devices), jax.devices()[:devices])


def axis_size(mesh: Mesh | None, axis: str) -> int:
    """Devices along `axis` (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape.get(axis, 1)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
