"""The controller over the local backend: jobs run, retry, fail with a reason, preempt, and survive
a controller killed mid-run."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from keel.cluster.checkpoint import BACKSTOP_PAGES
from keel.cluster.controller import Controller
from keel.cluster.listing import list_jobs
from keel.cluster.local import LocalBackend
from keel.cluster.spec import JobSpec, Priority, Resources, entry_point_command
from keel.cluster.state import connect, job_events, job_status, request_cancel, submit
from keel.core.errors import UsageError
from keel.telemetry import TelemetryStore


def controller(root: Path, cpus: float = 2) -> Controller:
    return Controller(root, {"local": LocalBackend(root / "tasks", max_cpus=cpus)})


def run_until(control: Controller, done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        control.tick()
        time.sleep(0.05)


def states(control: Controller, *jobs: str) -> list[str]:
    return [job_status(control.database, job)["state"] for job in jobs]


def shell(script: str, **changes) -> JobSpec:
    return JobSpec(("sh", "-c", script), **changes)


def test_jobs_succeed_fail_and_retry_with_their_reason(tmp_path):
    control = controller(tmp_path)
    ok = submit(control.database, shell("echo hello"))
    gang = submit(control.database, shell('echo "replica $KEEL_REPLICA"', replicas=2))
    flaky = submit(
        control.database,
        shell(f"test -e {tmp_path}/again || (touch {tmp_path}/again; exit 3)", max_retries=1),
    )
    broken = submit(control.database, shell("exit 4", max_retries=1))
    python = submit(control.database, JobSpec(entry_point_command("this")))
    jobs = (ok, gang, flaky, broken, python)
    run_until(control, lambda: all(s in ("succeeded", "failed") for s in states(control, *jobs)))
    assert states(control, *jobs) == ["succeeded", "succeeded", "succeeded", "failed", "succeeded"]
    status = job_status(control.database, broken)
    assert status["failures"] == 2 and status["reason"] == "replica 0: exited with code 4"
    assert job_status(control.database, flaky)["failures"] == 1
    outputs = sorted(
        Path(control.backends["local"].log_files(task["handle"])[0]).read_text()
        for task in job_status(control.database, gang)["tasks"]
    )
    assert outputs == ["replica 0\n", "replica 1\n"]
    zen = job_status(control.database, python)["tasks"][0]["handle"]
    assert "Beautiful is better than ugly." in Path(zen, "stdout").read_text()


def test_a_gang_that_cannot_fit_any_cluster_is_rejected_and_bad_specs_are_refused(tmp_path):
    control = controller(tmp_path, cpus=2)
    big = submit(control.database, shell("true", replicas=3))
    gpu = submit(
        control.database, shell("true", resources=Resources(device_type="h100", device_count=1))
    )
    control.tick()
    assert states(control, big, gpu) == ["failed", "failed"]
    assert (
        "needs 3 cpu on one cluster; the largest has 2"
        in job_status(control.database, big)["reason"]
    )
    assert "no cluster has device type 'h100'" in job_status(control.database, gpu)["reason"]
    with pytest.raises(UsageError, match="must be positive"):
        shell("true", resources=Resources(cpus=-1)).validate()
    with pytest.raises(UsageError, match="not found"):
        JobSpec(("no-such-command-xyz",)).validate()
    with pytest.raises(UsageError, match="no job 'j-999999'"):
        job_status(control.database, "j-999999")


def test_every_queued_job_says_why_it_waits_also_the_end_of_the_queue_left_by_shape(tmp_path):
    control = controller(tmp_path, cpus=2)
    busy = [submit(control.database, shell("sleep 30")) for _ in range(2)]
    head = submit(control.database, shell("true"))
    wide = submit(control.database, shell("true", resources=Resources(cpus=2)))
    tail = [submit(control.database, shell("true")) for _ in range(4)]
    control.tick()  # both cpus taken; `head` and `wide` block their shapes, `tail` is not looked at
    try:
        assert states(control, *busy) == ["running", "running"]
        one_cpu = "waiting for capacity: needs 1 cpu, most free is 0 on local"
        shown = {job: job_status(control.database, job)["reason"] for job in [head, wide, *tail]}
        assert shown == {
            head: one_cpu,
            wide: "waiting for capacity: needs 2 cpu, most free is 0 on local",
            **dict.fromkeys(tail, one_cpu),
        }
        listed = {row["id"]: row["reason"] for row in list_jobs(tmp_path / "state.db")}
        assert {job: listed[job] for job in shown} == shown
        # The tail's reason is its shape's (the waiting table): the tick wrote no row for it.
        query = "SELECT id FROM jobs WHERE state = 'pending' AND reason = ''"
        rows = control.database.execute(query)
        assert sorted(row["id"] for row in rows) == sorted(tail)
    finally:
        for job in busy:
            request_cancel(control.database, job)
        run_until(control, lambda: states(control, *busy) == ["cancelled", "cancelled"])
    run_until(control, lambda: set(states(control, head, wide, *tail)) == {"succeeded"})
    assert all(job_status(control.database, job)["reason"] == "" for job in tail)


def test_production_work_preempts_batch_work_which_is_requeued_and_completes(tmp_path):
    control = controller(tmp_path, cpus=2)
    marker = tmp_path / "preempted-once"
    script = f"if [ ! -e {marker} ]; then touch {marker}; sleep 30; fi; echo finished"
    batch = submit(control.database, shell(script, resources=Resources(cpus=2)))
    run_until(control, lambda: states(control, batch) == ["running"] and marker.exists())
    urgent = submit(
        control.database,
        shell("sleep 0.2", resources=Resources(cpus=2), priority=Priority.PRODUCTION),
    )
    run_until(control, lambda: states(control, urgent, batch) == ["succeeded", "succeeded"])
    status = job_status(control.database, batch)
    assert status["preemptions"] == 1 and status["tasks"][0]["attempt"] == 2


CONTROLLER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from keel.cluster.controller import Controller
    from keel.cluster.local import LocalBackend

    root = Path(sys.argv[1])
    Controller(root, {"local": LocalBackend(root / "tasks", max_cpus=2)}).run(tick_seconds=0.05)
    """
)


def test_a_controller_killed_mid_run_loses_no_job_and_runs_none_twice(tmp_path):
    journal = tmp_path / "journal"
    control = controller(tmp_path)  # only to submit and read; the subprocess ticks
    jobs = [
        submit(
            control.database,
            shell(
                f'echo "start $KEEL_JOB_ID" >> {journal}; sleep 0.6; '
                f'echo "end $KEEL_JOB_ID" >> {journal}',
                resources=Resources(cpus=1),
            ),
        )
        for _ in range(6)
    ]
    first = subprocess.Popen([sys.executable, "-c", CONTROLLER, str(tmp_path)])
    deadline = time.monotonic() + 30
    while "start" not in (journal.read_text() if journal.exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    second = subprocess.Popen([sys.executable, "-c", CONTROLLER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not all(s == "succeeded" for s in states(control, *jobs)):
            assert time.monotonic() < deadline, states(control, *jobs)
            time.sleep(0.1)
    finally:
        second.kill()
        second.wait()
    lines = journal.read_text().split("\n")
    for job in jobs:
        assert lines.count(f"start {job}") == 1 and lines.count(f"end {job}") == 1
    running = 0
    for line in lines:  # at most 2 cpus' worth of 1-cpu jobs at once, across both controllers
        running += line.startswith("start") - line.startswith("end")
        assert running <= 2


def test_task_output_streams_to_telemetry_and_the_local_pool_follows_the_queue(tmp_path):
    telemetry = tmp_path / "telemetry"
    pool = LocalBackend(tmp_path / "tasks", max_cpus=2)
    control = Controller(tmp_path, {"local": pool}, telemetry=str(telemetry))
    job = submit(control.database, shell("echo one; echo two >&2; printf three"))
    run_until(control, lambda: states(control, job) == ["succeeded"])
    control.tick()  # the last lines of an ended attempt go out on the next tick
    pair = [submit(control.database, shell("sleep 0.3")) for _ in range(2)]
    run_until(control, lambda: states(control, *pair) == ["succeeded", "succeeded"])
    control.logs.close()
    lines = (
        TelemetryStore(telemetry)
        .query(
            f"SELECT stream, line FROM \"cluster.task_log\" WHERE job_id = '{job}' ORDER BY line"
        )
        .to_pylist()
    )
    assert lines == [
        {"stream": "stdout", "line": "one"},
        {"stream": "stdout", "line": "three"},
        {"stream": "stderr", "line": "two"},
    ]
    scaled = [
        row[0]
        for row in control.database.execute("SELECT detail FROM events WHERE kind = 'scaled'")
    ]
    assert "local: 2 -> 1 cpus" in scaled and "local: 1 -> 2 cpus" in scaled


def test_a_jobs_events_tell_its_story_in_order(tmp_path):
    """Assignments and successes are read from the attempts' and jobs' rows (not written twice
    as events); the job_events view puts them with the other events, oldest first."""
    control = controller(tmp_path)
    flaky = submit(
        control.database,
        shell(f"test -e {tmp_path}/again || (touch {tmp_path}/again; exit 3)", max_retries=1),
    )
    run_until(control, lambda: states(control, flaky) == ["succeeded"])
    events = job_events(control.database, flaky)
    kinds = [event["kind"] for event in events]
    assert kinds == ["submitted", "assigned", "requeued", "assigned", "succeeded"]
    assert events[1]["detail"] == "local" and "exited with code 3" in events[2]["detail"]
    assert [event["at"] for event in events] == sorted(event["at"] for event in events)
    kinds = control.database.execute("SELECT DISTINCT kind FROM events").fetchall()
    assert not {"assigned", "succeeded"} & {row[0] for row in kinds}


def test_the_write_ahead_log_is_checkpointed_by_a_thread_not_by_a_ticks_commit(tmp_path):
    control = controller(tmp_path)
    assert control.database.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == BACKSTOP_PAGES
    control.checkpointer.every_rows = 5  # a checkpoint is due after a few rows
    job = submit(control.database, shell("true"))
    run_until(control, lambda: states(control, job) == ["succeeded"])
    deadline = time.monotonic() + 10
    while control.checkpointer.done == 0:
        assert time.monotonic() < deadline, "no checkpoint ran"
        time.sleep(0.01)
    assert control.checkpointer.failures == 0
    control.close()
    assert not control.checkpointer.running


def test_a_stored_spec_decodes_to_the_spec_submitted(tmp_path):
    from keel.cluster.state import decode_stored_spec, encode_spec, job

    spec = JobSpec(
        ("python", "train.py"),
        name="train",
        resources=Resources(cpus=2.5, memory_mb=512, device_type="h100", device_count=2),
        replicas=3,
        env={"A": "1"},
        region="eu",
        cluster="big",
        priority=Priority.PRODUCTION,
        max_retries=2,
        max_preemptions=4,
        workdir="/work",
    )
    control = controller(tmp_path)
    stored = job(control.database, submit(control.database, spec))["spec"]
    decoded = decode_stored_spec(stored)
    assert decoded == spec and decoded.demand() == {"cpu": 7.5, "h100": 6.0}
    assert isinstance(decoded.command, tuple) and decoded.priority is Priority.PRODUCTION
    older = encode_spec(JobSpec(("true",))).replace(',"cluster":""', "")  # keel before 2026-11
    assert decode_stored_spec(older) == JobSpec(("true",))
    control.close()


def test_a_launch_is_the_task_launch_its_init_would_make(tmp_path):
    """Launcher.task builds TaskLaunch without its __init__ (keel.cluster.state.unchecked):
    the same fields and values, a gang's coordinator included."""
    from keel.cluster.backend import TaskLaunch
    from keel.cluster.launch import Launcher

    spec = JobSpec(
        ("python", "train.py"),
        resources=Resources(cpus=2.5, memory_mb=512, device_type="h100", device_count=2),
        replicas=2,
        env={"A": "1"},
        workdir="/work",
    )
    attempt = {"job_id": "j-000007", "replica": 1, "attempt": 3}
    built = Launcher(None, {}, str(tmp_path)).task(spec, attempt)  # type: ignore[arg-type]
    gang_dir = f"{tmp_path}/j-000007/gang/3"
    expected = TaskLaunch(
        task_id="j-000007.1",
        attempt=3,
        command=("python", "train.py"),
        env={
            "A": "1",
            "KEEL_JOB_ID": "j-000007",
            "KEEL_REPLICA": "1",
            "KEEL_REPLICAS": "2",
            "KEEL_COORDINATOR": (Path(gang_dir) / "coordinator").read_text().strip(),
        },
        cpus=2.5,
        memory_mb=512,
        device_type="h100",
        device_count=2,
        log_dir=f"{tmp_path}/j-000007/1/3",
        workdir="/work",
        gang_dir=gang_dir,
    )
    assert built == expected and vars(built) == vars(expected)
    with pytest.raises(AttributeError):  # still frozen
        built.attempt = 4  # type: ignore[misc]


def test_a_requeued_job_restarts_with_its_next_attempt_after_a_controller_restart(tmp_path):
    """A queued job with an earlier attempt (requeued, then the controller stopped) gets attempt
    2 from the restarted controller, which learns at start which queued jobs have attempts."""
    first = controller(tmp_path)
    retried = submit(first.database, shell("exit 0", max_retries=1))
    fresh = submit(first.database, shell("exit 0"))
    with first.database:  # what a controller stopped right after requeueing it left behind
        first.database.execute(
            "INSERT INTO attempts (job_id, replica, attempt, cluster, handle, state, reason, "
            "started_at, ended_at) VALUES (?, 0, 1, 'local', 'gone', 'failed', 'exit 3', 1, 2)",
            (retried,),
        )
        first.database.execute("UPDATE jobs SET failures = 1 WHERE id = ?", (retried,))
    first.close()
    control = controller(tmp_path)
    run_until(control, lambda: states(control, retried, fresh) == ["succeeded", "succeeded"])
    assert [t["attempt"] for t in job_status(control.database, retried)["tasks"]] == [2]
    assert [t["attempt"] for t in job_status(control.database, fresh)["tasks"]] == [1]
    control.close()


def test_the_controller_freezes_its_loaded_heap_and_collects_the_young_rarely(tmp_path):
    import gc

    from keel.cluster import heap

    control = controller(tmp_path)
    submit(control.database, shell("exit 0"))
    control.tick()
    assert gc.get_threshold()[0] >= heap.YOUNG and gc.get_freeze_count() > 0
    control.close()


def test_an_older_databases_state_indexes_are_dropped_and_its_queue_still_runs(tmp_path):
    database = connect(tmp_path / "state.db")
    job = submit(database, shell("true"))
    database.execute("CREATE INDEX jobs_by_state ON jobs (state, priority, seq, id)")  # an
    database.execute("CREATE INDEX attempts_by_state ON attempts (state)")  # older keel's
    database.close()
    control = controller(tmp_path)
    indexes = control.database.execute(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND name LIKE '%by_state'"
    ).fetchall()
    assert indexes == []  # each start and end of a job no longer rewrites index entries
    control.tick()
    assert control.active_jobs() == 1
    run_until(control, lambda: states(control, job) == ["succeeded"])
    assert control.active_jobs() == 0
    control.close()
    assert sqlite3.connect(tmp_path / "state.db").execute("PRAGMA integrity_check").fetchone() == (
        "ok",
    )
