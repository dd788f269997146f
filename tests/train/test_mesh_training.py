"""Training on a (data, fsdp, expert) mesh computes what one device computes (see
tests/mesh_support.py for the runs): in one process on 8 simulated devices in two mesh shapes,
on 2 processes x 4 devices, after resuming a checkpoint on fewer devices, with the optimizer
state offloaded; and fsdp shards the state."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from mesh_support import GANG_MESH, assert_same_losses, made_once, run, tiny_moe

from keel.model.sharding import MeshConfig
from keel.train.layout import HOST_MEMORY, initial_state, shard_bytes
from keel.train.schedule import piecewise_lr
from keel.train.step import build_step_functions


@pytest.fixture(scope="module")
def eight_device_run(wikitext_cache, tmp_path_factory):
    """fsdp 2 x expert 4 on 8 devices: (its run directory, its metrics), made once for all
    pytest-xdist workers (this file's tests may run on both; the directory is only read)."""

    def make() -> tuple[str, list[dict]]:
        output = tmp_path_factory.mktemp("eight-devices") / "run"
        return str(output), run(tiny_moe(wikitext_cache, GANG_MESH), output, 8)

    output, metrics = made_once(tmp_path_factory, "eight-device-run", make)
    return Path(output), metrics


@pytest.mark.slow
@pytest.mark.timeout(900)  # the session's reference runs may be made here
def test_one_process_meshes_match_one_device(
    one_device_run, eight_device_run, wikitext_cache, tmp_path
):
    assert all(row["drop_rate"] == 0.0 for row in one_device_run)
    assert_same_losses(eight_device_run[1], one_device_run)
    mixed = run(tiny_moe(wikitext_cache, MeshConfig(2, 2, 2)), tmp_path, 8)
    assert_same_losses(mixed, one_device_run)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the session's reference runs may be made here
def test_two_processes_of_four_devices_match_one_device(gang_run, one_device_run):
    gang_metrics, stdout, stderr = gang_run
    assert_same_losses(gang_metrics, one_device_run)
    assert stdout.count("trained") == 1  # process 0 reports; process 1 only trains
    # On a cold cache the gang compiled each program once: process 0 compiled and shared it,
    # process 1 ran what it loaded (keel.train.gang_programs), and the losses above are theirs.
    for program in ("init", "update", "evaluate"):
        assert re.search(rf"^(?!\[process 1\]).*\b{program}: compiled and shared", stderr, re.M)
        assert re.search(rf"^\[process 1\].*\b{program}: loaded process 0's program", stderr, re.M)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the session's reference runs may be made here
@pytest.mark.parametrize("devices,mesh", [(4, MeshConfig(1, 2, 2)), (1, MeshConfig())])
def test_a_checkpoint_from_8_devices_resumes_on_fewer(
    eight_device_run, wikitext_cache, tmp_path, devices, mesh
):
    source, uninterrupted = eight_device_run
    resumed = tmp_path / "run"
    shutil.copytree(source, resumed)
    shutil.rmtree(resumed / "checkpoints" / "20")
    (resumed / "result.json").unlink()
    after = run(tiny_moe(wikitext_cache, mesh), resumed, devices)
    assert after[:10] == uninterrupted[:10]  # kept from the first run, not recomputed
    assert_same_losses(after[10:], uninterrupted[10:])


@pytest.mark.slow
@pytest.mark.timeout(900)  # the session's reference runs may be made here
def test_fsdp_4_holds_under_0_3x_of_the_replicated_bytes_per_device(wikitext_cache):
    def per_device(mesh: MeshConfig) -> int:
        config = tiny_moe(wikitext_cache, mesh)
        state, _, _ = initial_state(config, piecewise_lr(config.segments()), jax.devices()[:4])
        return shard_bytes((state.params, state.opt_state))

    replicated, sharded = per_device(MeshConfig(data=4)), per_device(MeshConfig(1, 4, 1))
    assert sharded <= 0.3 * replicated, (sharded, replicated)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the session's reference runs may be made here
def test_offloaded_optimizer_state_lives_in_host_memory_and_changes_nothing(
    one_device_run, wikitext_cache, tmp_path
):
    config = tiny_moe(wikitext_cache)
    offloaded = replace(config, optimizer=replace(config.optimizer, offload_state=True))
    state, optimizer, layout = initial_state(
        offloaded, piecewise_lr(config.segments()), jax.devices()[:1]
    )

    def kinds(opt_state) -> set[str]:
        return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(opt_state) if leaf.ndim}

    assert kinds(state.opt_state) == {HOST_MEMORY} and layout.offloaded
    learning_rate = piecewise_lr(config.segments())
    update = build_step_functions(
        offloaded, optimizer, learning_rate, jnp.ones(512, jnp.int32), 0, layout
    ).update
    window = jnp.zeros((config.batch_size, config.phases[0].seq_len + 1), jnp.int32)
    state, _ = update(state, window)
    assert kinds(state.opt_state) == {HOST_MEMORY}  # back in host memory after the step
    got = run(offloaded, tmp_path, 1)
    assert [row["loss"] for row in got] == [row["loss"] for row in one_device_run]  # bit for bit
