"""k-means with k-means++ seeding, in numpy: deterministic for a seed, for domain clusters.

Written by hand rather than taken from scikit-learn so that worker processes, which only assign
points to centroids, need numpy alone (scikit-learn adds seconds to every worker's start).
"""

from __future__ import annotations

import numpy as np

from keel.core.errors import UsageError

KMEANS_TOLERANCE = 0.01
"""Lloyd iterations stop once at most this fraction of the sample changes cluster."""


def nearest(x: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row of x ([n, d]): the index of its nearest centroid ([k, d]) by Euclidean
    distance (int32 [n], ties to the lowest index) and the squared distance (float64 [n])."""
    x64, c64 = x.astype(np.float64, copy=False), centroids.astype(np.float64, copy=False)
    distances = (x64 * x64).sum(1)[:, None] - 2 * x64 @ c64.T + (c64 * c64).sum(1)[None, :]
    labels = distances.argmin(1)
    return labels.astype(np.int32), np.maximum(distances[np.arange(len(x)), labels], 0.0)


def fit_kmeans(
    x: np.ndarray, k: int, seed: int, iterations: int = 100, restarts: int = 3
) -> tuple[np.ndarray, float]:
    """Lloyd's k-means on x ([n, d]) from k-means++ seeds, `restarts` times with one fixed-seed
    generator: (centroids [k, d] float32, inertia = mean squared distance). Deterministic."""
    if len(x) < k:
        raise UsageError(
            f"embed: k-means with clusters={k} needs at least {k} documents, the sample has"
            f" {len(x)}: lower EmbedConfig.clusters"
        )
    rng, x = np.random.default_rng(seed), x.astype(np.float64)
    columns = np.ascontiguousarray(x.T)  # [d, n]: bincount reads one dimension at a time
    best, best_inertia = x[:k], np.inf
    for _ in range(restarts):
        centroids, labels = _kmeans_plus_plus(x, k, rng), np.full(len(x), -1)
        for _ in range(iterations):
            previous, (labels, _) = labels, nearest(x, centroids)
            if np.count_nonzero(previous != labels) <= KMEANS_TOLERANCE * len(x):
                break
            sums = np.stack([np.bincount(labels, column, k) for column in columns], axis=1)
            sizes = np.bincount(labels, minlength=k)[:, None]
            centroids = np.where(sizes > 0, sums / np.maximum(sizes, 1), centroids)
        inertia = float(nearest(x, centroids)[1].mean())
        if inertia < best_inertia:
            best, best_inertia = centroids, inertia
    return best.astype(np.float32), best_inertia


def _kmeans_plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding: each next centroid drawn with probability proportional to its squared
    distance from the nearest chosen one."""
    chosen = [int(rng.integers(len(x)))]
    closest = ((x - x[chosen[0]]) ** 2).sum(1)
    for _ in range(1, k):
        total = closest.sum()
        pick = (
            int(rng.choice(len(x), p=closest / total)) if total > 0 else int(rng.integers(len(x)))
        )
        chosen.append(pick)
        closest = np.minimum(closest, ((x - x[pick]) ** 2).sum(1))
    return x[chosen].copy()


# -- the model file -------------------------------------------------------------------------------
