"""keel.train.distributed: real gangs of JAX processes over gloo (tests/train/gang_probe.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mesh_support import SHORT_REACH_TIMEOUT, within_60_s_at_the_default_reach_timeout

from keel.core.gang import free_port, gang_env, run_local_gang
from keel.train import distributed
from keel.train.distributed import GangError, gang_from_env

PROBE = str(Path(__file__).with_name("gang_probe.py"))
FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
GANG_OF_2 = {"KEEL_REPLICAS": "2", "KEEL_REPLICA": "0", "KEEL_COORDINATOR": "h:1"}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **FOUR_DEVICES, **extra}


def test_no_gang_without_replicas_and_what_a_process_alone_is(monkeypatch):
    for name in ("KEEL_REPLICAS", "KEEL_REPLICA", "KEEL_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    assert gang_from_env({}) is None
    assert gang_from_env({"KEEL_REPLICAS": "1", "KEEL_REPLICA": "0"}) is None
    assert distributed.initialize_from_env() is None
    assert distributed.is_primary() and distributed.process_label() == "process 0/1"


def test_the_environment_names_the_process_in_its_gang(monkeypatch):
    monkeypatch.setenv("KEEL_REPLICAS", "2")
    monkeypatch.setenv("KEEL_REPLICA", "1")
    monkeypatch.setenv("KEEL_COORDINATOR", "10.0.0.5:4242")
    monkeypatch.delenv("KEEL_COORDINATOR_TIMEOUT", raising=False)
    gang = gang_from_env()
    assert gang == distributed.GangInfo("10.0.0.5:4242", process=1, processes=2)
    assert gang.reach_timeout_s == distributed.REACH_TIMEOUT_SECONDS == 30
    assert not distributed.is_primary() and distributed.process_label() == "process 1/2"
    monkeypatch.setenv("KEEL_COORDINATOR_TIMEOUT", "2.5")
    assert gang_from_env().reach_timeout_s == 2.5


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KEEL_REPLICAS": "two"}, "not a number of processes"),
        ({"KEEL_REPLICAS": "0"}, "at least 1"),
        ({"KEEL_REPLICAS": "2", "KEEL_COORDINATOR": "h:1"}, "process index in 0..1"),
        ({"KEEL_REPLICAS": "2", "KEEL_REPLICA": "2", "KEEL_COORDINATOR": "h:1"}, "0..1"),
        ({"KEEL_REPLICAS": "2", "KEEL_REPLICA": "0"}, "must be host:port"),
        ({"KEEL_REPLICAS": "2", "KEEL_REPLICA": "0", "KEEL_COORDINATOR": "h:99999"}, "host:port"),
        ({**GANG_OF_2, "KEEL_COORDINATOR_TIMEOUT": "soon"}, "positive number of seconds"),
        ({**GANG_OF_2, "KEEL_COORDINATOR_TIMEOUT": "0"}, "positive number of seconds"),
        ({**GANG_OF_2, "KEEL_COORDINATOR_TIMEOUT": "nan"}, "positive number of seconds"),
    ],
)
def test_variables_that_make_no_gang_are_usage_errors(env, message):
    with pytest.raises(GangError, match=message) as caught:
        gang_from_env(env)
    assert caught.value.exit_code == 2


@pytest.mark.slow
def test_two_processes_of_four_devices_sum_over_all_eight(tmp_path):
    out = tmp_path / "out"
    shared = tmp_path / "run"
    argv = [sys.executable, PROBE, str(out), "--check-shared", str(shared)]
    assert run_local_gang(argv, 2, env=_env()) == 0
    seen = [json.loads((out / f"{i}.json").read_text()) for i in range(2)]
    assert [s["sum"] for s in seen] == [36.0, 36.0]  # 1 + 2 + ... + 8
    assert [(s["devices"], s["local_devices"], s["processes"]) for s in seen] == [(8, 4, 2)] * 2
    assert [(s["label"], s["primary"]) for s in seen] == [
        ("process 0/2", True),
        ("process 1/2", False),
    ]
    assert not (shared / distributed.SHARED_TOKEN).exists()  # the check leaves nothing behind


@pytest.mark.slow
def test_a_run_directory_the_processes_do_not_share_is_refused(tmp_path, capfd):
    argv = [
        sys.executable,
        PROBE,
        str(tmp_path / "out"),
        "--check-shared",
        str(tmp_path / "{replica}"),
    ]
    assert run_local_gang(argv, 2, env=_env()) == 2
    err = capfd.readouterr().err
    for replica, prefix in ((0, ""), (1, "[process 1] ")):  # each says so; none hangs
        directory = tmp_path / str(replica)
        assert f"{prefix}error: {directory} is not shared by the gang: process 1 of 2 did" in err


@pytest.mark.slow
def test_an_unreachable_coordinator_is_one_error_line_and_exit_2_within_60_s(tmp_path):
    env = _env(**gang_env(f"127.0.0.1:{free_port()}", 1, 2), **SHORT_REACH_TIMEOUT)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, PROBE, str(tmp_path)], env=env, capture_output=True, text=True, timeout=90
    )
    assert within_60_s_at_the_default_reach_timeout(time.monotonic() - started)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: process 1/2 cannot reach"), lines
    assert "within 3 s" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_when_one_member_is_killed_the_other_exits_within_60_s(tmp_path, victim):
    coordinator = f"127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    members = [
        subprocess.Popen(
            [sys.executable, PROBE, str(out), "--sleep", "300"],
            env=_env(**gang_env(coordinator, replica, 2)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for replica in range(2)
    ]
    try:
        deadline = time.monotonic() + 90
        while not all((out / f"{i}.json").exists() for i in range(2)):
            assert time.monotonic() < deadline, "the gang did not form"
            assert all(m.poll() is None for m in members), "a member ended early"
            time.sleep(0.1)
        members[victim].kill()
        killed = time.monotonic()
        survivor = members[1 - victim]
        survivor.wait(timeout=60)
        assert survivor.returncode != 0  # it failed: the gang is broken, not finished
        assert time.monotonic() - killed < 60
    finally:
        for member in members:
            member.kill()
            member.wait()
