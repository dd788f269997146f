"""`keel run` and `keel status` end to end, in real subprocesses."""

import json
import os
import shutil
import signal
import time

from cli_support import error_lines


def test_second_run_executes_nothing_and_reports_all_cached(cli):
    experiment = cli.experiment()
    first = cli.run("run", str(experiment), "--prefix", str(cli.prefix), "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout) == {
        "executed": ["a", "b", "c", "d"],
        "cached": [],
        "failed": [],
    }
    second = cli.run("run", str(experiment), "--prefix", str(cli.prefix), "--json")
    assert second.returncode == 0, second.stderr
    result = json.loads(second.stdout)
    assert result["executed"] == [] and result["failed"] == []
    assert sorted(result["cached"]) == ["a", "b", "c", "d"]
    assert cli.executions() == ["a", "b", "c", "d"]  # in DAG order, each once


def test_changed_config_reruns_that_step_and_descendants_only(cli):
    cli.run("run", str(cli.experiment(value_a=1)), "--prefix", str(cli.prefix), "--json")
    second = cli.run("run", str(cli.experiment(value_a=5)), "--prefix", str(cli.prefix), "--json")
    assert json.loads(second.stdout)["executed"] == ["a", "b", "c", "d"]  # a changed: all below it
    third = cli.run(
        "run",
        str(cli.experiment(value_a=5)),
        "--prefix",
        str(cli.prefix),
        "--json",
        "--set",
        "c.value=10",
    )
    result = json.loads(third.stdout)
    assert sorted(result["executed"]) == ["c", "d"]
    assert sorted(result["cached"]) == ["a", "b"]
    outputs = [p for p in cli.prefix.iterdir() if p.name.startswith("d-")]
    values = sorted(int((p / "value.txt").read_text()) for p in outputs)
    # d = 1 + b + c, with b = c = 1 + a, then c = 10 + a
    assert values == [1 + 2 + 2, 1 + 6 + 6, 1 + 6 + 15]


def test_same_experiment_under_two_prefixes_gets_the_same_hashes(cli):
    experiment = cli.experiment()
    for prefix in ("one", "two"):
        assert cli.run("run", str(experiment), "--prefix", str(cli.root / prefix)).returncode == 0
    names = [
        sorted(p.name for p in (cli.root / prefix).iterdir() if not p.name.startswith("."))
        for prefix in ("one", "two")
    ]
    assert names[0] == names[1] and len(names[0]) == 4


def test_two_runs_started_at_once_execute_every_step_exactly_once(cli):
    experiment = cli.experiment()
    args = ("run", str(experiment), "--prefix", str(cli.prefix), "--json", "--max-parallel", "2")
    runners = [cli.popen(*args), cli.popen(*args)]
    results = []
    for runner in runners:
        out, err = runner.communicate(timeout=120)
        assert runner.returncode == 0, err
        results.append(json.loads(out))
    assert sorted(cli.executions()) == ["a", "b", "c", "d"]
    executed = results[0]["executed"] + results[1]["executed"]
    assert sorted(executed) == ["a", "b", "c", "d"]
    for result in results:
        assert sorted(result["executed"] + result["cached"]) == ["a", "b", "c", "d"]


def test_killed_step_leaves_no_success_and_the_next_run_takes_over(cli):
    experiment = cli.experiment()
    started = cli.root / "started"
    slow = {"KEEL_TEST_SLOW_STEP": "b", "KEEL_TEST_STARTED": str(started), "KEEL_TEST_SLEEP": "60"}
    runner = cli.popen("run", str(experiment), "--prefix", str(cli.prefix), env=slow)
    deadline = time.monotonic() + 60
    while not started.exists():
        assert runner.poll() is None, runner.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(runner.pid, signal.SIGKILL)
    runner.wait()

    assert not any(p.name.startswith("b-") for p in cli.prefix.iterdir())
    status = json.loads(cli.run("status", "--prefix", str(cli.prefix), "--json").stdout)
    states = {step["name"]: step["state"] for step in status["steps"]}
    assert states["a"] == "SUCCESS" and states["b"] == "INTERRUPTED"

    rerun = cli.run("run", str(experiment), "--prefix", str(cli.prefix), "--json")
    assert rerun.returncode == 0, rerun.stderr
    result = json.loads(rerun.stdout)
    assert "b" in result["executed"] and "a" in result["cached"]
    assert cli.executions().count("b") == 2
    status = json.loads(cli.run("status", "--prefix", str(cli.prefix), "--json").stdout)
    assert {step["state"] for step in status["steps"]} == {"SUCCESS"}
    assert not list(cli.prefix.glob(".keel/steps/*/staging-*"))  # the dead attempt was cleaned up


def test_failing_step_is_recorded_its_descendants_skip_and_the_cli_prints_one_line(cli):
    experiment = cli.experiment()
    result = cli.run(
        "run",
        str(experiment),
        "--prefix",
        str(cli.prefix),
        "--json",
        env={"KEEL_TEST_FAILING_STEP": "b"},
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = error_lines(result.stderr)
    assert len(errors) == 1
    assert "step b-" in errors[0] and "ValueError: bad value at row 7" in errors[0]
    assert "1 downstream step not run" in errors[0]
    summary = json.loads(result.stdout)
    assert summary["failed"] == ["b", "d"]
    assert sorted(summary["executed"]) == ["a", "c"]
    assert "d" not in cli.executions()
    record_path = next(cli.prefix.glob(".keel/steps/b-*/attempt.json"))
    record = json.loads(record_path.read_text())
    assert record["status"] == "FAILED"
    assert record["error"] == "ValueError: bad value at row 7"
    assert "Traceback (most recent call last)" in record["traceback"]
    assert not any(p.name.startswith(("b-", "d-")) for p in cli.prefix.iterdir())
    status = json.loads(cli.run("status", "--prefix", str(cli.prefix), "--json").stdout)
    assert {s["name"]: s["state"] for s in status["steps"]}["b"] == "FAILED"


def test_dry_run_prints_the_plan_and_runs_nothing(cli):
    experiment = cli.experiment()
    cli.run("run", str(experiment), "--prefix", str(cli.prefix), "--set", "a.value=1")
    plan = cli.run(
        "run",
        str(experiment),
        "--prefix",
        str(cli.prefix),
        "--dry-run",
        "--json",
        "--set",
        "d.value=2",
    )
    assert plan.returncode == 0, plan.stderr
    result = json.loads(plan.stdout)
    assert result["to_run"] == ["d"] and sorted(result["cached"]) == ["a", "b", "c"]
    assert cli.executions() == ["a", "b", "c", "d"]
    table = cli.run(
        "run", str(experiment), "--prefix", str(cli.prefix), "--dry-run", "--force", "^b$"
    )
    assert "forced" in table.stdout


def test_status_lists_steps_with_state_age_and_output(cli):
    cli.run("run", str(cli.experiment()), "--prefix", str(cli.prefix))
    result = cli.run("status", "--prefix", str(cli.prefix), "--json")
    steps = json.loads(result.stdout)["steps"]
    assert [s["name"] for s in steps] == ["a", "b", "c", "d"]
    for step in steps:
        assert step["state"] == "SUCCESS"
        assert 0 <= step["age_seconds"] < 600
        assert os.path.isdir(step["output"]) and step["output"].endswith(step["hash"])
    table = cli.run("status", "--prefix", str(cli.prefix))
    assert "SUCCESS" in table.stdout and str(cli.prefix) in table.stdout


def test_status_of_a_copied_prefix_names_the_copy_and_it_stays_cached(cli, tmp_path):
    experiment = cli.experiment()
    cli.run("run", str(experiment), "--prefix", str(cli.prefix))
    copy = tmp_path / "moved"
    shutil.copytree(cli.prefix, copy)
    steps = json.loads(cli.run("status", "--prefix", str(copy), "--json").stdout)["steps"]
    assert [step["output"] for step in steps] == [
        str(copy / s["output"].rsplit("/", 1)[1]) for s in steps
    ]
    rerun = json.loads(cli.run("run", str(experiment), "--prefix", str(copy), "--json").stdout)
    assert rerun["executed"] == []  # the copy is a cache, as when a prefix is shared
