"""`keel job ...` and `keel cluster ...` as a user runs them: an embedded controller starts on
demand, jobs run, their output and state are there, mistakes are one line."""

import json
import sqlite3
import subprocess
import sys
import time

from cli_support import keel

from keel.cluster import state
from keel.cluster.lock import held_by_someone

KEEL = [sys.executable, "-m", "keel"]


def wait_for(cwd, job_id, states, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        status = json.loads(keel("job", "status", job_id, "--json", cwd=cwd).stdout)
        if status["state"] in states:
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.3)


def test_jobs_run_on_an_embedded_controller_and_can_be_cancelled(tmp_path):
    job = keel(
        "job",
        "run",
        "--env",
        "GREETING=hello",
        "--",
        "sh",
        "-c",
        'echo "$GREETING job"',
        cwd=tmp_path,
    ).stdout.strip()
    assert job == "j-000001"
    status = wait_for(tmp_path, job, {"succeeded", "failed"})
    assert status["state"] == "succeeded" and status["tasks"][0]["exit_code"] == 0
    assert keel("job", "logs", job, cwd=tmp_path).stdout == "hello job\n"
    slow = keel("job", "run", "--", "sleep", "60", cwd=tmp_path).stdout.strip()
    wait_for(tmp_path, slow, {"running"})
    assert "cancel requested" in keel("job", "cancel", slow, cwd=tmp_path).stdout
    assert wait_for(tmp_path, slow, {"cancelled"})["state"] == "cancelled"
    cluster = json.loads(keel("cluster", "status", "--json", cwd=tmp_path).stdout)
    assert cluster["jobs"] == {"succeeded": 1, "cancelled": 1}
    assert cluster["clusters"][0]["name"] == "local"
    keel("cluster", "stop", cwd=tmp_path)
    assert (
        json.loads(keel("cluster", "status", "--json", cwd=tmp_path).stdout)["controller"] is None
    )


def test_mistakes_are_one_line_and_exit_2(tmp_path):
    cases = [
        (["job", "run", "--device", "h100:8", "--", "true"], "no cluster has device type 'h100'"),
        (["job", "run", "--cpus", "-2", "--", "true"], "resources must be positive"),
        (["job", "run", "--", "no-such-program-here"], "not found"),
        (["job", "run", "--priority", "urgent", "--", "true"], "unknown priority"),
        (["job", "run", "--entry", "not a module!"], "write package.module"),
        (["job", "status", "j-424242"], "no job 'j-424242'"),
        (["job", "cancel", "j-424242"], "no job 'j-424242'"),
    ]
    for args, message in cases:
        result = keel(*args, cwd=tmp_path, check=False)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and result.stderr.count("error:") == 1, result.stderr
        assert "Traceback" not in result.stderr


def test_keel_run_on_a_cluster_runs_each_step_as_a_job(cli):
    experiment = cli.experiment(value_a=2)
    result = cli.run(
        "run", str(experiment), "--prefix", str(cli.prefix), "--cluster", "local",
        "--max-parallel", "2", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["executed"] == ["a", "b", "c", "d"]
    assert int(next(cli.prefix.glob("d-*/value.txt")).read_text()) == 2 + 2 + 1 + 1 + 1 + 1 - 1
    database = sqlite3.connect(cli.root / "keel-out" / "cluster" / "state.db")
    jobs = database.execute("SELECT name, state FROM jobs ORDER BY seq").fetchall()
    assert sorted(jobs) == [(f"step {s}", "succeeded") for s in "abcd"]
    failing = cli.run(
        "run", str(experiment), "--prefix", str(cli.prefix), "--cluster", "local",
        "--set", "d.value=3", "--forward-env", "KEEL_TEST_FAILING_TOKEN",
        env={"KEEL_TEST_FAILING_TOKEN": "d"},
    )  # fmt: skip  # a secret-named variable reaches the job only when named
    assert failing.returncode == 1
    assert (
        "job j-000005 on local failed" in failing.stderr and "exited with code 1" in failing.stderr
    )


def test_job_commands_reach_a_controller_by_url(tmp_path):
    root = tmp_path / "controller"
    server = subprocess.Popen(
        [*KEEL, "cluster", "start", "--root", str(root), "--port", "0"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        announcement = root / "controller.json"
        deadline = time.monotonic() + 30
        while not announcement.exists():
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()
            time.sleep(0.1)
        url = json.loads(announcement.read_text())["url"]
        client = tmp_path / "elsewhere"  # no state here: everything goes through the URL
        client.mkdir()
        job = keel("job", "run", "--controller", url, "--", "sh", "-c", "echo remote", cwd=client)
        job_id = job.stdout.strip()
        deadline = time.monotonic() + 30
        while True:
            status = keel("job", "status", job_id, "--controller", url, "--json", cwd=client)
            if json.loads(status.stdout)["state"] == "succeeded":
                break
            assert time.monotonic() < deadline, status.stdout
            time.sleep(0.2)
        logs = keel("job", "logs", job_id, "--controller", url, cwd=client)
        assert logs.stdout == "remote\n"
        missing = keel("job", "cancel", "j-999999", "--controller", url, cwd=client, check=False)
        assert missing.returncode == 2 and "no job 'j-999999'" in missing.stderr
        assert not (client / "keel-out").exists()
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_concurrent_submissions_start_one_controller_and_run_each_job_once(tmp_path):
    """Twelve `keel job run` at once with no controller: one controller takes the root's lock,
    the others only submit; each job runs once (its command appends its id to a journal)."""
    journal = tmp_path / "journal"
    script = f'echo "$KEEL_JOB_ID" >> {journal}; sleep 0.3'
    submitters = [
        subprocess.Popen(
            [*KEEL, "job", "run", "--", "sh", "-c", script],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(12)
    ]
    outputs = [submitter.communicate(timeout=300) for submitter in submitters]
    assert all(submitter.returncode == 0 for submitter in submitters), outputs
    jobs = sorted(stdout.strip() for stdout, _ in outputs)
    assert jobs == [f"j-{n:06d}" for n in range(1, 13)]
    database = sqlite3.connect(tmp_path / "keel-out" / "cluster" / "state.db")
    deadline = time.monotonic() + 60
    while database.execute("SELECT count(*) FROM jobs WHERE state != 'succeeded'").fetchone()[0]:
        assert time.monotonic() < deadline, database.execute(
            "SELECT id, state FROM jobs"
        ).fetchall()
        time.sleep(0.2)
    time.sleep(1.0)  # a second controller's duplicate launches would land in the journal by now
    ran = journal.read_text().split()
    assert sorted(ran) == jobs, f"jobs ran more than once: {sorted(ran)}"
    starts = database.execute("SELECT count(*) FROM events WHERE kind = 'controller started'")
    assert starts.fetchone()[0] == 1
    root = tmp_path / "keel-out" / "cluster"
    state.set_value(state.connect(root / "state.db"), "stop", "1")  # as `keel cluster stop` does
    while held_by_someone(root):
        assert time.monotonic() < deadline + 30, "the controller did not stop"
        time.sleep(0.1)
