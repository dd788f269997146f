"""Hardening of the controller: one line for bad specs and configs, assignment that re-checks
each job, the controller's lock, private files and hidden secrets (issue 20)."""

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from keel.cli.cluster_commands import cluster_app, job_app
from keel.cluster import state
from keel.cluster.config import ClusterConfig, load_federation, make_backend
from keel.cluster.controller import Controller
from keel.cluster.launch import JobInfo, record_assignments
from keel.cluster.local import LocalBackend
from keel.cluster.scheduler import PendingJob
from keel.cluster.spec import JobSpec, Priority, Resources
from keel.core.errors import ConfigError, UsageError
from keel.telemetry import TelemetryStore

GOOD = {"command": ["true"], "resources": {"cpus": 1}}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"name": "x"}, "job spec key 'command' is missing"),
        ({"command": "true"}, "job spec key 'command': expected a list of strings"),
        ({**GOOD, "resources": {"cpus": "abc"}}, "'resources.cpus': expected a number, got 'abc'"),
        ({**GOOD, "resources": {"gpus": 2}}, "unknown job spec key 'resources.gpus'"),
        ({**GOOD, "colour": "red"}, "unknown job spec key 'colour'"),
        ({**GOOD, "replicas": 1.5}, "'replicas': expected a whole number, got 1.5"),
        ({**GOOD, "env": {"A": 1}}, "'env.A': expected a string"),
        ({**GOOD, "priority": "urgent"}, "unknown priority 'urgent'"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_a_bad_spec_is_one_usage_error_naming_the_key(spec, message):
    with pytest.raises(UsageError) as caught:
        state.decode_spec(json.dumps(spec))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_spec_round_trips_and_missing_optional_keys_take_their_defaults():
    spec = JobSpec(("echo", "hi"), name="n", env={"A": "b"}, max_retries=2)
    assert state.decode_spec(state.encode_spec(spec)) == spec
    assert state.decode_spec(json.dumps({"command": ["echo", "hi"]})) == JobSpec(("echo", "hi"))


def test_nonsense_in_clusters_yaml_and_unknown_backends_are_refused(tmp_path):
    cases = [
        ("clusters: [{name: a, max_cpus: -3}]", "cluster a: max_cpus must be a positive number"),
        ("clusters: [{name: a, min_cpus: abc}]", "min_cpus must be a positive number, got 'abc'"),
        ("tick_seconds: 0", "tick_seconds must be a positive number"),
        ("report_every: 1.5", "report_every must be a whole number"),
        ("clusters: [{name: a, backend: k8s}]", "unknown backend 'k8s'; known backends: local, "),
        ("forward_env: KEEL_X", "forward_env must be a list of variable names"),
    ]
    for text, message in cases:
        config = tmp_path / "clusters.yaml"
        config.write_text(text)
        with pytest.raises(ConfigError) as caught:
            load_federation(config)
        assert message in str(caught.value), (text, str(caught.value))
    with pytest.raises(
        ConfigError, match="unknown backend 'k8s'; known backends: local, ray, slurm"
    ):
        make_backend(ClusterConfig("a", "k8s"), tmp_path)
    with pytest.raises(ConfigError, match="max_cpus must be a positive number of cpus"):
        make_backend(ClusterConfig("a", "local", options={"max_cpus": -3}), tmp_path)


def test_assignment_takes_only_jobs_still_pending_inside_its_transaction(tmp_path):
    database = state.connect(tmp_path / "state.db")
    spec = JobSpec(("true",))
    ids = [state.submit(database, spec) for _ in range(3)]
    jobs = {
        job_id: JobInfo(spec, PendingJob(job_id, spec.priority, n, spec.demand()))
        for n, job_id in enumerate(ids)
    }
    state.request_cancel(database, ids[1])  # another process cancels it
    with state.transaction(database):  # another controller took it first
        database.execute("UPDATE jobs SET state = 'running' WHERE id = ?", (ids[2],))
    with state.transaction(database):
        launches, taken = record_assignments(database, [(i, "local") for i in ids], jobs)
    assert taken == [(ids[0], "local")] and [a["job_id"] for a, _ in launches] == [ids[0]]
    states = dict(database.execute("SELECT id, state FROM jobs").fetchall())
    assert states == {ids[0]: "running", ids[1]: "cancelled", ids[2]: "running"}
    assert database.execute("SELECT count(*) FROM attempts").fetchone()[0] == 1


def _open_state(path: str, go, errors) -> None:
    """In a child process: open the state database when `go` is set; put any error on `errors`."""
    go.wait()
    try:
        state.connect(path).execute("SELECT count(*) FROM jobs").fetchall()
    except Exception as error:  # the test reports what went wrong in which process
        errors.put(f"{type(error).__name__}: {error}")


def test_many_processes_opening_a_new_state_database_at_once_all_succeed(tmp_path):
    """What twelve `keel job run` on a fresh root do: switching the new file to WAL mode used to
    fail "database is locked" at once in a process that asked while another switched it (before
    the fix, most runs of this test saw it)."""
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    for round in range(20):
        path = str(tmp_path / f"root-{round}" / "state.db")
        go = context.Event()
        openers = [context.Process(target=_open_state, args=(path, go, errors)) for _ in range(16)]
        for opener in openers:
            opener.start()
        go.set()  # all at once
        for opener in openers:
            opener.join(timeout=60)
        assert all(opener.exitcode == 0 for opener in openers)
    assert errors.empty(), errors.get()


def test_one_process_at_a_time_holds_a_roots_lock_and_a_kill_frees_it(tmp_path):
    from keel.cluster.daemon import run as run_controller
    from keel.cluster.lock import ControllerLock, held_by_someone

    first, second = ControllerLock(tmp_path), ControllerLock(tmp_path)
    assert not held_by_someone(tmp_path)
    assert first.acquire() and not second.acquire() and held_by_someone(tmp_path)
    first.release()
    assert second.acquire()
    second.release()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child holds the lock until killed
        ControllerLock(tmp_path).acquire()
        time.sleep(60)
        os._exit(0)
    deadline = time.monotonic() + 10
    while not held_by_someone(tmp_path):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(child, 9)
    os.waitpid(child, 0)
    assert not held_by_someone(tmp_path) and first.acquire()
    started = CliRunner().invoke(cluster_app, ["start", "--root", str(tmp_path)])
    assert started.exit_code == 2 and "a controller already runs for" in started.stderr
    with pytest.raises(UsageError, match="already runs"):  # the lock decides, not a pid file
        run_controller(tmp_path, None)
    first.release()


def test_secrets_are_private_on_disk_and_hidden_wherever_the_job_is_shown(tmp_path):
    secret = "s3cret-value-123"
    root, telemetry = tmp_path / "cluster", tmp_path / "telemetry"
    control = Controller(
        root, {"local": LocalBackend(root / "tasks", max_cpus=1)}, telemetry=str(telemetry)
    )
    job = state.submit(
        control.database,
        JobSpec(
            ("sh", "-c", 'echo "token=$API_TOKEN $GREETING"', f"DB_PASSWORD={secret}"),
            env={"API_TOKEN": secret, "GREETING": "hi"},
        ),
    )
    deadline = time.monotonic() + 30
    while state.job_status(control.database, job)["state"] != "succeeded":
        assert time.monotonic() < deadline
        control.tick()
        time.sleep(0.05)
    control.tick()  # the last output goes to telemetry
    status = state.job_status(control.database, job)
    assert status["spec"]["env"] == {"API_TOKEN": "***", "GREETING": "hi"}
    assert status["spec"]["command"][-1] == "DB_PASSWORD=***"
    events = control.database.execute("SELECT detail FROM events").fetchall()
    assert not [e for e in events if secret in e[0]] and secret not in json.dumps(status)
    control.logs.close()
    rows = TelemetryStore(telemetry).query('SELECT line FROM "cluster.task_log"').to_pylist()
    assert rows == [{"line": "token=*** hi"}]
    handle = Path(status["tasks"][0]["handle"])
    assert secret in (handle / "stdout").read_text()  # the job itself got the real value
    runner = CliRunner()
    shown = runner.invoke(job_app, ["status", job, "--root", str(root)])
    assert "API_TOKEN=***" in shown.stdout and secret not in shown.stdout, shown.stdout
    shown = runner.invoke(job_app, ["status", job, "--root", str(root), "--json"])
    assert json.loads(shown.stdout)["spec"]["env"]["API_TOKEN"] == "***"
    shown = runner.invoke(job_app, ["logs", job, "--root", str(root)])
    assert shown.stdout == "token=*** hi\n"
    for path in [root / "state.db", *root.glob("state.db-*")]:
        assert path.stat().st_mode & 0o777 == 0o600, path
    for directory in [root, root / "tasks", handle.parent.parent, handle.parent, handle]:
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    assert (handle / "stdout").stat().st_mode & 0o777 == 0o600
    control.close()


def test_step_jobs_get_secret_looking_variables_only_when_named():
    from keel.cluster.steps import forwarded_env

    environ = {
        "KEEL_PREFIX": "/data",
        "KEEL_HF_TOKEN": "t0ken",
        "KEEL_DB_PASSWORD": "pw",
        "PYTHONPATH": "/src",
        "HOME": "/root",
    }
    assert forwarded_env(environ) == {"KEEL_PREFIX": "/data", "PYTHONPATH": "/src"}
    assert forwarded_env(environ, ["KEEL_HF_TOKEN", "NOT_SET"]) == {
        "KEEL_PREFIX": "/data",
        "PYTHONPATH": "/src",
        "KEEL_HF_TOKEN": "t0ken",
    }


def test_the_in_memory_queue_follows_other_processes_and_keeps_queue_order(tmp_path):
    from keel.cluster.pending import PendingQueue

    control = Controller(tmp_path, {"local": LocalBackend(tmp_path / "tasks", max_cpus=1)})
    other = state.connect(tmp_path / "state.db")  # a job command in another process
    first = state.submit(other, JobSpec(("sleep", "0.5")))
    control.tick()
    cancelled = state.submit(other, JobSpec(("true",)))
    control.tick()  # queued behind the running job
    state.request_cancel(other, cancelled)
    last = state.submit(other, JobSpec(("true",)))
    deadline = time.monotonic() + 30
    while state.job_status(other, last)["state"] != "succeeded":
        assert time.monotonic() < deadline, state.job_status(other, last)
        control.tick()
        time.sleep(0.05)
    assert state.job_status(other, first)["state"] == "succeeded"
    assert state.job_status(other, cancelled)["tasks"] == []  # never started
    queue = PendingQueue()
    jobs = [PendingJob(f"j{n}", JobSpec(()).priority, n, {"cpu": 1.0}) for n in range(4)]
    for job in (jobs[1], jobs[3], jobs[0], jobs[2]):  # a requeued job comes back out of order
        queue.add(job)
    queue.remove("j3")
    assert [j.job_id for j in queue.ordered()] == ["j0", "j1", "j2"] and queue.shapes == 1
    control.close()


def test_a_task_started_by_a_controller_killed_before_it_wrote_the_pid_is_adopted(tmp_path):
    import signal
    import subprocess

    from keel.cluster.backend import TaskLaunch, TaskState

    directory = tmp_path / "tasks" / "j-000001" / "0" / "1"
    directory.mkdir(parents=True)
    with open(directory / "stdout", "ab") as output:  # what launch had done when it was killed
        orphan = subprocess.Popen(["sleep", "30"], stdout=output, start_new_session=True)
    backend = LocalBackend(tmp_path / "tasks", max_cpus=2)
    task = TaskLaunch("j-000001.0", 1, ("sleep", "30"), log_dir=str(directory))
    try:
        handle = backend.launch(task)  # the restarted controller launches the attempt again
        assert (directory / "pid").read_text().split()[0] == str(orphan.pid)
        assert backend.poll([handle])[handle].state is TaskState.RUNNING
        assert not (directory / "exit_code").exists()  # no second task was started
    finally:
        os.killpg(orphan.pid, signal.SIGKILL)
        orphan.wait()
    assert backend.poll([handle])[handle].state is TaskState.LOST


def memory_and_database(control: Controller) -> tuple[dict, dict]:
    """What the controller keeps in memory of its running jobs, their latest attempts and the
    active attempts, and the same read from the database (with the handles it has yet to
    write)."""
    from keel.cluster.feed import ATTEMPT_COLUMNS, JOB_COLUMNS

    database = control.database
    running = "state IN ('running', 'preempted')"
    jobs = {
        row["id"]: dict(row)
        for row in database.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE {running}")
    }
    active = {
        (row["job_id"], row["replica"], row["attempt"]): dict(row)
        for row in database.execute(
            f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE state IN {state.ACTIVE_ATTEMPT_STATES}"
        )
    }
    latest: dict[str, dict] = {}
    for row in database.execute(
        f"SELECT {ATTEMPT_COLUMNS} FROM tasks WHERE job_id IN (SELECT id FROM jobs WHERE {running})"
    ):
        latest.setdefault(row["job_id"], {})[row["replica"]] = dict(row)
    # Handles of the last launches are written in the next tick's transaction (launch.py).
    for handle, *key in control.launcher.unrecorded:
        for row in (active.get(tuple(key)), latest.get(key[0], {}).get(key[1])):
            if row is not None and row["attempt"] == key[2]:
                row.update(handle=handle, state="running")
    memory = {"jobs": control._running, "active": control._attempts, "latest": control._latest}
    return memory, {"jobs": jobs, "active": active, "latest": latest}


def test_the_controllers_memory_follows_the_database_through_every_transition(tmp_path):
    """Successes, retries, a gang with a failing replica, a refused launch, a preemption and a
    cancel request by another process: after every tick the running jobs and attempts the
    controller keeps in memory are those in the database."""
    control = Controller(tmp_path, {"local": LocalBackend(tmp_path / "tasks", max_cpus=2)})
    other = state.connect(tmp_path / "state.db")  # job commands in another process
    marker = tmp_path / "preempted-once"
    jobs = [
        state.submit(other, JobSpec(("true",))),
        state.submit(other, JobSpec(("sh", "-c", "exit 3"), max_retries=1)),
        state.submit(other, JobSpec(("sh", "-c", 'exit "$KEEL_REPLICA"'), replicas=2)),
        state.submit(other, JobSpec(("true",), workdir=str(tmp_path / "missing"))),
        state.submit(
            other,
            JobSpec(
                ("sh", "-c", f"if [ ! -e {marker} ]; then touch {marker}; sleep 30; fi"),
                resources=Resources(cpus=2),
            ),
        ),
    ]
    cancelled = state.submit(other, JobSpec(("sleep", "30")))
    deadline = time.monotonic() + 60
    while True:
        control.tick()
        memory, stored = memory_and_database(control)
        assert memory == stored
        if marker.exists() and len(jobs) == 5:
            jobs.append(state.submit(other, JobSpec(("true",), priority=Priority.PRODUCTION)))
        if state.job_status(other, cancelled)["state"] == "running":
            state.request_cancel(other, cancelled)
        ended = [state.job_status(other, job)["state"] in state.FINAL_JOB_STATES for job in jobs]
        if all(ended) and state.job_status(other, cancelled)["state"] == "cancelled":
            break
        assert time.monotonic() < deadline, memory
        time.sleep(0.05)
    final = [state.job_status(other, job)["state"] for job in jobs]
    assert final == ["succeeded", "failed", "failed", "failed", "succeeded", "succeeded"]
    assert state.job_status(other, jobs[4])["preemptions"] == 1
    assert memory_and_database(control)[0] == {"jobs": {}, "active": {}, "latest": {}}
    control.close()
