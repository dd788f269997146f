"""Optimizers: both minimise a small least-squares problem; labels, Muon slices and clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from keel.core.errors import ConfigError
from keel.train.optim import OptimizerConfig, build_optimizer
from keel.train.schedule import ScheduleConfig, segment_lr

LABELS = {"w2": "matrix", "w3": "matrix", "emb": "embedding", "b": "vector"}


def shapes() -> dict[str, tuple[int, ...]]:
    return {"w2": (8, 6), "w3": (3, 8, 8), "emb": (10, 4), "b": (8,)}


def random_tree(key: jax.Array, scale: float = 1.0) -> dict[str, jax.Array]:
    keys = dict(zip(shapes(), jax.random.split(key, len(shapes())), strict=True))
    return {name: scale * jax.random.normal(keys[name], shape) for name, shape in shapes().items()}


def least_squares_loss(params: dict, x: jax.Array, targets: dict) -> jax.Array:
    """Each leaf fits its own linear target: x @ w2, x @ w3[l], a row lookup, and b itself."""
    loss = jnp.mean((x @ params["w2"] - x @ targets["w2"]) ** 2)
    loss += jnp.mean((jnp.einsum("nd,lde->lne", x, params["w3"] - targets["w3"])) ** 2)
    loss += jnp.mean((params["emb"] - targets["emb"]) ** 2)
    return loss + jnp.mean((params["b"] - targets["b"]) ** 2)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_both_optimizers_minimise_least_squares(name: str):
    schedule = ScheduleConfig(kind="cosine", peak_lr=0.05, warmup_steps=20, final_fraction=0.1)
    optimizer = build_optimizer(
        OptimizerConfig(name=name), lambda step: segment_lr(step, 300, schedule), LABELS
    )
    x = jax.random.normal(jax.random.key(1), (32, 8))
    targets = random_tree(jax.random.key(2), scale=0.5)
    params = jax.tree.map(jnp.zeros_like, targets)

    @jax.jit
    def train(params):
        def step(carry, _):
            params, state = carry
            loss, grads = jax.value_and_grad(least_squares_loss)(params, x, targets)
            updates, state = optimizer.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), loss

        (params, _), losses = jax.lax.scan(step, (params, optimizer.init(params)), length=300)
        return params, losses

    params, losses = train(params)
    final = least_squares_loss(params, x, targets)
    assert final < losses[0] / 10, (float(losses[0]), float(final))


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_weight_decay_follows_the_labels(name: str):
    """With zero gradients the update is pure weight decay: -lr * wd * p, none on vectors."""
    lr, decay = 0.01, 0.1
    optimizer = build_optimizer(OptimizerConfig(name=name, weight_decay=decay), lr, LABELS)
    params = random_tree(jax.random.key(0))
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(optimizer.update)(zeros, optimizer.init(params), params)
    np.testing.assert_array_equal(updates["b"], 0.0)
    for leaf in ("w2", "w3", "emb"):
        np.testing.assert_allclose(updates[leaf], -lr * decay * params[leaf], rtol=1e-5)


def ill_conditioned(rng: np.random.Generator, batch: tuple[int, ...], rows: int, cols: int):
    """[*batch, rows, cols] gradient slices with condition number 20, scaled 100x..1x."""
    count = int(np.prod(batch, dtype=int))
    slices = []
    for scale in np.geomspace(100.0, 1.0, count):
        u = np.linalg.qr(rng.normal(size=(rows, rows)))[0][:, :4]
        v = np.linalg.qr(rng.normal(size=(cols, cols)))[0][:, :4]
        slices.append(scale * (u * np.geomspace(1.0, 0.05, 4)) @ v.T)
    return jnp.asarray(np.stack(slices).reshape(*batch, rows, cols), jnp.float32)


def test_muon_orthogonalises_each_stacked_slice_on_its_own():
    """At step 0 every [d_in, d_out] slice of a matrix update has near-equal singular values,
    of the same size across slices, though the gradient slices differ in scale by 100x."""
    labels = {"w2": "matrix", "w3": "matrix", "w4": "matrix", "b": "vector"}
    config = OptimizerConfig(name="muon", weight_decay=0.0, clip_norm=0.0)
    optimizer = build_optimizer(config, 0.01, labels)
    rng = np.random.default_rng(3)
    grads = {
        "w2": ill_conditioned(rng, (), 4, 6),
        "w3": ill_conditioned(rng, (3,), 6, 4),
        "w4": ill_conditioned(rng, (2, 2), 4, 4),
        "b": jnp.ones(8),
    }
    params = jax.tree.map(jnp.zeros_like, grads)
    updates, _ = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
    for leaf in ("w2", "w3", "w4"):
        singular = np.linalg.svd(np.asarray(updates[leaf]), compute_uv=False)
        assert singular.max() / singular.min() < 2.0, (leaf, singular)


def run_with_spike(config: OptimizerConfig) -> tuple[jax.Array, jax.Array]:
    """Updates before and after one gradient spike (a huge gradient in another direction):
    5 steps of gradient g, one of 1e6 * h, then 10 more of g."""
    labels = {"w": "matrix", "b": "vector"}
    optimizer = build_optimizer(config, 0.01, labels)
    params = {"w": jnp.zeros((6, 8)), "b": jnp.zeros(8)}
    g_key, h_key = jax.random.split(jax.random.key(4))
    g = {"w": 0.05 * jax.random.normal(g_key, (6, 8)), "b": jnp.full(8, 0.05)}
    h = {"w": 1e6 * jax.random.normal(h_key, (6, 8)), "b": jnp.full(8, -1e6)}
    update = jax.jit(optimizer.update)
    state = optimizer.init(params)
    seen = []
    for grads in [g] * 5 + [h] + [g] * 10:
        updates, state = update(grads, state, params)
        seen.append(updates)
    return seen[4], seen[-1]


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_clipping_keeps_a_gradient_spike_from_taking_over_the_updates(name: str):
    """Clipped, a spike enters the optimizer's momentum at norm clip_norm and the updates soon
    point where the ordinary gradients do; unclipped, it dominates them for many steps."""

    def cosine(a: dict, b: dict) -> float:
        a, b = (jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)]) for t in (a, b))
        return float(a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))

    before, after = run_with_spike(OptimizerConfig(name=name, weight_decay=0.0, clip_norm=1.0))
    assert cosine(before, after) > 0.9
    before, after = run_with_spike(OptimizerConfig(name=name, weight_decay=0.0, clip_norm=0.0))
    assert cosine(before, after) < 0.5


@pytest.mark.parametrize(
    "labels, params",
    [
        pytest.param({"w": "matrx", "b": "vector"}, None, id="unknown-label"),
        pytest.param({"w": "matrix", "b": 3}, None, id="not-a-string"),
        pytest.param(
            {"w": "matrix", "b": "matrix"},
            {"w": jnp.ones((2, 2)), "b": jnp.ones(2)},
            id="1d-matrix",
        ),
        pytest.param({"w": "matrix"}, {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}, id="structure"),
    ],
)
def test_bad_labels_raise_config_error(labels: dict, params: dict | None):
    with pytest.raises(ConfigError):
        optimizer = build_optimizer(OptimizerConfig(name="muon"), 1e-3, labels)
        optimizer.init(params)


def test_bad_optimizer_config_raises_config_error():
    with pytest.raises(ConfigError, match=r"optimizer\.name"):
        build_optimizer(OptimizerConfig(name="sgd"), 1e-3, {"w": "matrix"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="b2"):
        build_optimizer(OptimizerConfig(b2=1.0), 1e-3, {"w": "matrix"})
