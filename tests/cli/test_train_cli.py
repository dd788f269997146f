"""`keel train` as a user runs it: exact resume after SIGKILL, and clear errors before compiling."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
from cli_support import error_lines
from mesh_support import SHORT_REACH_TIMEOUT, within_60_s_at_the_default_reach_timeout

CONFIG = """
model:
  vocab_size: {vocab}
  d_model: 32
  n_layers: 2
  n_heads: 2
  n_kv_heads: 1
  head_dim: 16
  ffn_dim: 64
  n_routed_experts: 4
  top_k: 2
  n_shared_experts: 1
  expert_ffn_dim: 32
data:
  - cache: {cache}
phases:
  - seq_len: 32
    schedule: {{peak_lr: 0.003, warmup_steps: 5}}
batch_size: 4
steps: {steps}
checkpoint_every: 5
eval_every: 10
eval_batches: 2
"""


def config_file(cli, cache: str, name: str = "run.yaml", vocab: int = 512, steps: int = 30):
    return cli.write(name, CONFIG.format(cache=cache, vocab=vocab, steps=steps))


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row["loss"] for row in map(json.loads, lines)}


@pytest.mark.slow
def test_sigkill_then_rerun_matches_an_uninterrupted_run_exactly(cli, cache):
    config = config_file(cli, cache)
    straight = cli.run("train", str(config), "--output", "straight", timeout=300)
    assert straight.returncode == 0, straight.stderr
    expected = losses(cli.root / "straight")
    assert sorted(expected) == list(range(1, 31))

    args = ("train", str(config), "--output", "killed")
    process = cli.popen(*args)
    metrics = cli.root / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 13:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert len(metrics.read_text().splitlines()) < 30

    resumed = cli.run(*args, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step 10" in resumed.stdout or "resumed from step 15" in resumed.stdout
    assert losses(cli.root / "killed") == expected  # every step, bit for bit


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("--set", "model.bogus=1"), "no key 'bogus'"),
        (("--set", "model.top_k=5"), "model.top_k (5) must be between 1 and"),
        (("--set", "model.vocab_size=300"), "vocabulary of 512 ids, the model has 300"),
        (("--set", "data=[{cache: /no/such/cache}]"), "/no/such/cache"),
    ],
)
def test_bad_input_fails_with_one_line_before_compiling(cli, cache, change, message):
    config = config_file(cli, cache)
    started = time.monotonic()
    result = cli.run("train", str(config), "--output", "bad", *change)
    assert result.returncode == 2, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (cli.root / "bad" / "checkpoints").exists()
    assert time.monotonic() - started < 20  # no model was compiled


def test_an_unknown_key_in_the_config_file_is_named(cli, cache):
    config = cli.write("typo.yaml", CONFIG.format(cache=cache, vocab=512, steps=5) + "batch: 8\n")
    result = cli.run("train", str(config))
    assert result.returncode == 2
    assert "batch" in error_lines(result.stderr)[0]


def test_a_preset_and_a_config_file_are_exclusive(cli, cache):
    result = cli.run("train", str(config_file(cli, cache)), "--preset", "tiny-moe")
    assert result.returncode == 2
    assert "one of them" in error_lines(result.stderr)[0]


@pytest.fixture
def cache(wikitext_cache) -> str:
    return wikitext_cache


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("--set", "mesh.data=3"), "mesh data 3 x fsdp 1 x expert 1 has 3 devices but 8 are"),
        (("--set", "mesh.data=-1", "--set", "mesh.fsdp=-1"), "at most one mesh axis may be -1"),
        (("--set", "mesh.data=1", "--set", "mesh.expert=8"), "mesh.expert (8) must divide"),
        ((), "batch_size (4) must be a multiple of mesh data x fsdp x expert = 8 x 1 x 1"),
    ],
)
def test_a_mesh_that_does_not_fit_fails_with_one_line_before_compiling(cli, cache, change, message):
    """8 simulated devices, no one-device pin: the mesh is checked against them."""
    config = config_file(cli, cache)
    started = time.monotonic()
    env = {**cli.env, "KEEL_DEVICES": ""}
    result = cli.run("train", str(config), "--output", "bad", *change, env=env)
    assert result.returncode == 2, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (cli.root / "bad").exists()  # refused before the run began
    assert time.monotonic() - started < 60


def test_an_old_config_with_expert_parallel_is_read_as_mesh_expert(cli, cache):
    config = cli.write("old.yaml", CONFIG.format(cache=cache, vocab=512, steps=5))
    config.write_text(config.read_text() + "expert_parallel: 2\n")
    result = cli.run("train", str(config), env={**cli.env, "KEEL_DEVICES": ""})
    assert result.returncode == 2, result.stderr  # 8 devices: data 4 x expert 2 for a batch of 4
    assert "expert_parallel is replaced by mesh.expert: read as mesh.expert=2" in result.stderr
    assert "mesh data x fsdp x expert = 4 x 1 x 2" in error_lines(result.stderr)[0]


@pytest.mark.slow
def test_a_gang_whose_coordinator_cannot_be_reached_fails_in_one_line(cli, cache):
    from keel.core.gang import free_port

    gang = {"KEEL_COORDINATOR": f"127.0.0.1:{free_port()}", "KEEL_REPLICA": "1"}
    gang.update(SHORT_REACH_TIMEOUT, KEEL_REPLICAS="2")
    started = time.monotonic()
    result = cli.run("train", str(config_file(cli, cache)), env={**cli.env, **gang})
    assert result.returncode == 2, result.stderr
    assert len(error_lines(result.stderr)) == 1 and "127.0.0.1" in result.stderr
    assert "within 3 s" in result.stderr
    assert within_60_s_at_the_default_reach_timeout(time.monotonic() - started)
