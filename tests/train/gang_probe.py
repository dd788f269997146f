"""A gang member for the tests: joins its gang from KEEL_* variables, sums over all devices of
all processes, and writes what it saw to <out>/<process>.json.

Usage: python gang_probe.py OUT [--sleep SECONDS] [--check-shared DIR]
`--sleep` keeps the gang in a loop of collectives that long (a member killed meanwhile must bring
the others down). `--check-shared DIR` checks that the gang shares DIR ("{replica}"
in it is replaced by the process's index, to make a directory they do not share).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

from keel.core.errors import KeelError
from keel.train import distributed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--check-shared", default="")
    args = parser.parse_args()
    try:
        gang = distributed.initialize_from_env()
        if args.check_shared:
            replica = os.environ.get("KEEL_REPLICA", "0")
            distributed.check_shared_directory(args.check_shared.format(replica=replica))
    except KeelError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    devices = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devices, ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    # Device k of the global mesh holds the value k + 1: the total is n (n + 1) / 2.
    local = np.array(
        [list(mesh.devices.flat).index(d) + 1 for d in mesh.local_devices], dtype=np.float32
    )
    values = jax.make_array_from_process_local_data(sharding, local, (devices.size,))
    total = float(jax.jit(jnp.sum)(values))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{jax.process_index()}.json").write_text(
        json.dumps(
            {
                "process": jax.process_index(),
                "processes": jax.process_count(),
                "devices": devices.size,
                "local_devices": len(jax.local_devices()),
                "sum": total,
                "label": distributed.process_label(gang),
                "primary": distributed.is_primary(),
                "coordinator": os.environ.get("KEEL_COORDINATOR", ""),
                "pid": os.getpid(),
            }
        )
    )
    print(f"{distributed.process_label(gang)}: sum {total:g}", flush=True)
    deadline = time.monotonic() + args.sleep
    step = jax.jit(jnp.sum)
    while time.monotonic() < deadline:
        float(step(values))
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
