"""clusters.yaml: the clusters a controller federates, each a backend with a region.

    report_every: 3          # ticks between capacity reports (the ledger covers the gap)
    tick_seconds: 0.5
    telemetry: keel-out/telemetry   # task output to cluster.task_log (optional)
    forward_env: [KEEL_HF_TOKEN]    # secret-named KEEL_* variables `keel run --cluster` forwards
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

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from keel.cluster.backend import TaskBackend
from keel.core.errors import ConfigError, UsageError


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
    # Variables `keel run --cluster` forwards to step jobs even though their names look secret
    # (keel.cluster.steps); other KEEL_* variables are forwarded without being named.
    forward_env: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendKind:
    """One kind of cluster backend: how to build it, and which options must be positive
    numbers (checked when clusters.yaml is read, so a bad value is one line at once)."""

    build: Callable[[ClusterConfig, Path], TaskBackend]  # (entry, its task directory)
    positive: tuple[str, ...] = ()


def _local(cluster: ClusterConfig, log_root: Path) -> TaskBackend:
    from keel.cluster.local import LocalBackend

    return LocalBackend(log_root, region=cluster.region, **cluster.options)


def _slurm(cluster: ClusterConfig, log_root: Path) -> TaskBackend:
    from keel.cluster.slurm import SlurmBackend

    return SlurmBackend(str(log_root), **cluster.options)


def _ray(cluster: ClusterConfig, log_root: Path) -> TaskBackend:
    from keel.cluster.ray_backend import RayBackend

    return RayBackend(log_root=str(log_root), **cluster.options)


# The backends a cluster entry may name; adding one is a module and one line here.
BACKENDS: dict[str, BackendKind] = {
    "local": BackendKind(_local, positive=("max_cpus", "min_cpus")),
    "slurm": BackendKind(_slurm),
    "ray": BackendKind(_ray),
}


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
    unknown = set(data) - {"clusters", "report_every", "tick_seconds", "telemetry", "forward_env"}
    if unknown:
        raise ConfigError(f"{path}: unknown key {sorted(unknown)[0]!r}")
    clusters = []
    for index, entry in enumerate(data.get("clusters") or [{"name": "local"}]):
        if not isinstance(entry, dict) or not entry.get("name"):
            raise ConfigError(f"{path}: clusters[{index}] needs a name")
        entry = dict(entry)
        name, backend = str(entry.pop("name")), str(entry.pop("backend", "local"))
        kind = _kind(backend, f"{path}: cluster {name}")
        for option in kind.positive:
            if option in entry:
                _positive(entry[option], f"{path}: cluster {name}: {option}")
        region = str(entry.pop("region", ""))
        clusters.append(ClusterConfig(name, backend, region, entry))
    names = [c.name for c in clusters]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: cluster names repeat: {names}")
    report_every = _positive(data.get("report_every", 1), f"{path}: report_every")
    if not isinstance(report_every, int):
        raise ConfigError(f"{path}: report_every must be a whole number of ticks")
    return FederationConfig(
        tuple(clusters),
        report_every,
        float(_positive(data.get("tick_seconds", 0.5), f"{path}: tick_seconds")),
        str(data.get("telemetry", "")),
        _names(data.get("forward_env", []), f"{path}: forward_env"),
    )


def _names(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where} must be a list of variable names, got {value!r}")
    return tuple(value)


def _kind(backend: str, where: str) -> BackendKind:
    kind = BACKENDS.get(backend)
    if kind is None:
        known = ", ".join(sorted(BACKENDS))
        raise ConfigError(f"{where}: unknown backend {backend!r}; known backends: {known}")
    return kind


def _positive(value: Any, where: str) -> float:
    """`value` if it is a number above 0, else ConfigError saying so."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{where} must be a positive number, got {value!r}")
    return value


def make_backend(cluster: ClusterConfig, root: Path) -> TaskBackend:
    """The backend a cluster entry names, with its task files under `root`/tasks/<cluster>."""
    kind = _kind(cluster.backend, f"cluster {cluster.name}")
    try:
        return kind.build(cluster, root / "tasks" / cluster.name)
    except (TypeError, UsageError) as error:
        raise ConfigError(f"cluster {cluster.name} ({cluster.backend}): {error}") from None
