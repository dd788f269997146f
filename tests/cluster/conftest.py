"""Cluster tests: the session's real Slurm cluster (see slurm_cluster.py)."""

from slurm_cluster import slurm_cluster  # noqa: F401  (a fixture, used by name)
