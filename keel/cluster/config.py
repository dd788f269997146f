"""clusters.yaml: the clusters a controller federates, each a backend with a region.

    report_every: 3          # ticks between capacity reports (the ledger covers the gap)
    tick_seconds: 0.5
    telemetry: keel-out/telemetry   # task output to cluster.task_log (optional)
    clusters:
      - name: laptop
        backend: local
        max_cpus: 8
      - name: lab
        backend: slurm
        region: eu
        partition: gpu
      - name: cloud
        backend: ray
        region: us
        address: http://10.0.0.5:8265

Without a file the controller runs one local cluster named "local" on this machine's cpus.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from keel.cluster.backend import TaskBackend
from keel.core.errors import ConfigError

BACKENDS = ("local", "slurm", "ray")


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    backend: str = "local"
    region: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # backend-specific keys


@dataclass(frozen=True)
class FederationConfig:
    clusters: tuple[ClusterConfig, ...] = (ClusterConfig("local"),)
    report_every: int = 1
    tick_seconds: float = 0.5
    telemetry: str = ""


def load_federation(path: str | Path | None) -> FederationConfig:
    """The federation in `path`, or one local cluster when `path` is None."""
    if path is None:
        return FederationConfig()
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"cluster config {path} does not exist") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"cluster config {path} is not valid YAML: {error}") from None
    unknown = set(data) - {"clusters", "report_every", "tick_seconds", "telemetry"}
    if unknown:
        raise ConfigError(f"{path}: unknown key {sorted(unknown)[0]!r}")
    clusters = []
    for index, entry in enumerate(data.get("clusters") or [{"name": "local"}]):
        if not isinstance(entry, dict) or not entry.get("name"):
            raise ConfigError(f"{path}: clusters[{index}] needs a name")
        entry = dict(entry)
        name, backend = str(entry.pop("name")), str(entry.pop("backend", "local"))
        if backend not in BACKENDS:
            raise ConfigError(f"{path}: cluster {name}: backend {backend!r}; use one of {BACKENDS}")
        region = str(entry.pop("region", ""))
        clusters.append(ClusterConfig(name, backend, region, entry))
    names = [c.name for c in clusters]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: cluster names repeat: {names}")
    return FederationConfig(
        tuple(clusters),
        int(data.get("report_every", 1)),
        float(data.get("tick_seconds", 0.5)),
        str(data.get("telemetry", "")),
    )


def make_backend(cluster: ClusterConfig, root: Path) -> TaskBackend:
    """The backend a cluster entry names, with its task files under `root`/tasks/<cluster>."""
    log_root = root / "tasks" / cluster.name
    options = dict(cluster.options)
    try:
        if cluster.backend == "local":
            from keel.cluster.local import LocalBackend

            return LocalBackend(log_root, region=cluster.region, **options)
        if cluster.backend == "slurm":
            from keel.cluster.slurm import SlurmBackend

            return SlurmBackend(str(log_root), **options)
        from keel.cluster.ray_backend import RayBackend

        return RayBackend(log_root=str(log_root), **options)
    except TypeError as error:
        raise ConfigError(f"cluster {cluster.name} ({cluster.backend}): {error}") from None
