"""Balancing rules as a registry: a rule defined here (its statistic, cross-device reduction and
update in one object) trains under expert parallelism, and an unknown rule is one error line
naming the known ones."""

import subprocess
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from mesh_support import KEEL, run, tiny_moe

from keel.model.balance import register_balance_rule
from keel.model.config import ModelConfig, RouterConfig
from keel.model.moe import init_moe, moe_forward
from keel.model.sharding import MeshConfig, expert_mesh


@dataclass(frozen=True)
class TopOneShare:
    """Pushes each expert's bias down by its excess share of first choices over all devices."""

    name: str = "test_top_one_share"

    def observe(self, scores: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
        first = jnp.argmax(scores + bias, axis=-1)
        return jnp.zeros(scores.shape[-1], jnp.float32).at[first].add(1.0)

    def reduce(self, statistic: jax.Array, axes) -> jax.Array:
        return jax.lax.psum(statistic, tuple(axes))

    def update(self, bias, load, statistic, config) -> jax.Array:
        share = statistic / jnp.maximum(jnp.sum(statistic), 1.0)
        return bias - config.bias_rate * (share - 1.0 / share.shape[0])


register_balance_rule(TopOneShare())
RULE = RouterConfig(balance="test_top_one_share", bias_rate=0.5)


def test_the_rule_reduces_its_statistic_over_every_device():
    config = ModelConfig(d_model=16, n_routed_experts=8, expert_ffn_dim=8, router=RULE)
    params = init_moe(jax.random.key(0), config.validate())
    x = jax.random.normal(jax.random.key(1), (4 * 32, 16))
    forward = jax.jit(moe_forward, static_argnums=(3, 4))
    _, stats = forward(params, x, jnp.zeros(8), config, expert_mesh(4))
    _, whole = forward(params, x, jnp.zeros(8), config, None)
    np.testing.assert_array_equal(stats.bias_target, whole.bias_target)
    assert float(jnp.sum(stats.bias_target)) == x.shape[0]  # first choices of all 4 devices


def test_a_rule_registered_here_trains_under_expert_parallelism(wikitext_cache, tmp_path):
    config = tiny_moe(wikitext_cache, MeshConfig(data=1, fsdp=1, expert=4))
    config = replace(
        config,
        steps=5,  # tiny_moe warms up over 4
        eval_every=5,
        checkpoint_every=5,
        model=replace(config.model, router=RULE),
    )
    rows = run(config, tmp_path / "run", 4)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert all(np.isfinite(row["loss"]) for row in rows)
    # Send and receive drops are logged apart (tiny_moe's capacities drop nothing).
    assert all(row["drop_rate_send"] == row["drop_rate_recv"] == 0.0 for row in rows)
    # Step 1 logs the initial zero bias; the rule has moved it by step 2.
    assert max(rows[0]["router"]["bias_std"]) == 0.0
    assert min(rows[1]["router"]["bias_std"]) > 0.0


def test_an_unknown_rule_is_one_error_line_naming_the_known_ones():
    command = [*KEEL, "train", "--preset", "tiny-moe", "--set", "model.router.balance=bogus"]
    done = subprocess.run([*command, "--print-config"], capture_output=True, text=True)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert "'bogus'" in lines[0] and "none, quantile, sign" in lines[0]
