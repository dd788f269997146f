"""`--plan`: one update step compiled ahead of time on abstract arrays, what it needs per device.

The 535b-a23b plan runs in a subprocess that simulates 64 CPU devices (this process sees 8);
tiny-moe's plan is checked against the live shards of a real run's state on the same mesh.
"""

import json
import math
import os
import re
import resource
import subprocess
import sys
from dataclasses import replace

import jax
import pytest

from keel.model.sharding import MeshConfig
from keel.train.layout import initial_state, shard_bytes
from keel.train.plan import compile_step, describe, plan_run
from keel.train.presets import preset
from keel.train.schedule import piecewise_lr

ALL_TO_ALL = re.compile(r"= \(?([^=]*?)\)? all-to-all\(")
SHAPE = re.compile(r"(f32|bf16|s32|pred)\[([\d,]*)\]")
ITEMSIZE = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1}


@pytest.mark.slow
def test_plan_of_535b_on_64_simulated_devices_allocates_nothing():
    env = {k: v for k, v in os.environ.items() if k != "KEEL_DEVICES"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=64"
    command = ["train", "--preset", "535b-a23b", "--plan", "--devices", "64", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "keel", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(done.stdout)
    assert abs(plan["total_params"] / 535e9 - 1) <= 0.05
    assert abs(plan["active_params"] / 23e9 - 1) <= 0.05
    assert plan["devices"] == 64 and plan["mesh"]["expert"] == 64
    assert plan["platform"] == "cpu" and plan["temp_bytes"] > 0
    # 384 experts of 3 x 3072^2 float32 in 47 layers, 6 per device: their shard alone is 24 GiB.
    assert plan["param_bytes"] > 24 * 2**30
    assert plan["opt_state_bytes"] >= 2 * plan["param_bytes"]  # AdamW: two moments
    # Nothing of the 2 TB of float32 parameters was allocated: the planning process stayed small.
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 < 16 * 2**30
    exchange = plan["alltoall"]
    assert exchange["devices"] == 64 and exchange["moe_layers"] == 47
    assert exchange["tokens_per_device"] == 4096


@pytest.fixture(scope="module")
def tiny_moe_8():
    """tiny-moe (with remat) on fsdp 2 x expert 4 over this process's 8 simulated devices."""
    devices = jax.devices()[:8]
    if len(devices) < 8:
        pytest.skip("needs 8 simulated devices (tests/conftest.py sets them)")
    mesh = MeshConfig(data=1, fsdp=2, expert=4)
    return replace(preset("tiny-moe"), mesh=mesh, remat=True), devices


@pytest.fixture(scope="module")
def tiny_moe_step(tiny_moe_8):
    config, devices = tiny_moe_8
    return compile_step(config, devices)


def test_plan_of_tiny_moe_matches_the_live_shards_of_a_real_run(tiny_moe_8, tiny_moe_step):
    config, devices = tiny_moe_8
    plan = describe(tiny_moe_step)
    state, _, _ = initial_state(config, piecewise_lr(config.segments()), devices)

    assert plan.param_bytes == shard_bytes(state.params)
    assert plan.grad_bytes == plan.param_bytes
    assert plan.opt_state_bytes == shard_bytes(state.opt_state)
    assert plan.other_state_bytes == shard_bytes((state.router_bias, state.step, state.rng))
    # fsdp 2 x expert 4 splits the parameters: a device holds well under half of them.
    assert plan.param_bytes < 0.5 * 4 * plan.total_params
    assert plan.mesh == {"data": 1, "fsdp": 2, "expert": 4}
    assert plan.temp_bytes > 0 and plan.platform == "cpu"

    exchange = plan.alltoall
    assert exchange is not None and exchange.devices == 4
    assert exchange.tokens_per_device == config.batch_size * 128 // 8
    # float32 rows of d_model = 128: the forward's rows and results, int32 ids and bool flags.
    pool = 4 * exchange.send_rows
    assert exchange.layer_forward_bytes == 2 * pool * 128 * 4 + pool * (4 + 1)

    text = "\n".join(plan.lines())
    assert "fsdp 2" in text and "temporaries (XLA:cpu)" in text
    assert json.loads(json.dumps(plan.to_dict()))["param_bytes"] == plan.param_bytes


def test_plan_all_to_all_bytes_are_those_of_the_compiled_step(tiny_moe_step):
    """Every all-to-all in the compiled step sits in a layer loop's body and runs once per MoE
    layer: their buffers, summed, times the layers are the plan's bytes per step (forward 4,
    remat's recompute 4, backward 2 per layer)."""
    plan = describe(tiny_moe_step)
    exchanges = ALL_TO_ALL.findall(tiny_moe_step.executable.as_text())
    buffer_bytes = [
        sum(
            ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in SHAPE.findall(shapes)
        )
        for shapes in exchanges
    ]
    assert len(buffer_bytes) == 10
    assert sum(buffer_bytes) * plan.alltoall.moe_layers == plan.alltoall.step_bytes


def test_plan_refuses_a_mesh_that_does_not_fit_the_devices_before_compiling(tiny_moe_8):
    from keel.core.errors import ConfigError

    config, devices = tiny_moe_8
    with pytest.raises(ConfigError, match="mesh"):
        plan_run(replace(config, mesh=MeshConfig(data=1, fsdp=3, expert=4)), devices)


def test_plan_of_dropless_pools_sizes_the_exchange_for_the_worst_case():
    from keel.train.plan import alltoall_plan

    config = preset("tiny-moe")
    mesh = {"data": 1, "fsdp": 1, "expert": 4}
    capped = alltoall_plan(config, 8, 128, mesh, 4)
    pools = alltoall_plan(
        replace(config, model=replace(config.model, dropless="pools")), 8, 128, mesh, 4
    )
    tokens = 8 * 128 // 4
    assert capped.send_rows < tokens * config.model.top_k  # capacity 1.x of the even share
    assert pools.send_rows == tokens * config.model.top_k  # every assignment to one device
