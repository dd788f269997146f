"""`keel cluster start|status|stop` and `keel job run|list|status|logs|cancel`.

Job commands work on the controller state under --root (default keel-out/cluster): they write to
its SQLite database and a running controller picks the work up at its next tick. When no controller
runs for that root, `keel job run` starts an embedded one in the background that exits once idle.
"""

from __future__ import annotations

import shlex
import signal
import sqlite3
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import orjson
import typer
from rich.markup import escape
from rich.table import Table

from keel.cli.output import print_json, stderr, stdout, user_errors
from keel.cluster import state
from keel.cluster.config import load_federation
from keel.cluster.spec import (
    JobSpec,
    Priority,
    Resources,
    entry_point_command,
    parse_device,
)
from keel.core.errors import UsageError

if TYPE_CHECKING:
    from keel.cluster.api import ControllerClient

# The controller (keel.cluster.daemon), its HTTP client and the log follower pull in the
# telemetry store, starlette and DuckDB: they are imported by the commands that use them, so
# `keel job --help` and `keel job status` start without them.

DEFAULT_ROOT = "keel-out/cluster"
cluster_app = typer.Typer(
    name="cluster", help="Run and inspect the job controller.", no_args_is_help=True
)
job_app = typer.Typer(
    name="job", help="Submit, inspect and cancel jobs on the controller.", no_args_is_help=True
)
ROOT = typer.Option(DEFAULT_ROOT, "--root", help="The controller's state directory.")
CONTROLLER = typer.Option(
    None,
    "--controller",
    help="A controller's URL (`keel cluster start --port`), e.g. http://head:8471.",
)
TOKEN = typer.Option(
    None, "--token", envvar="KEEL_CONTROLLER_TOKEN", help="The controller's token."
)
JSON = typer.Option(False, "--json", help="Print JSON on stdout.")


def register(app: typer.Typer) -> None:
    app.add_typer(cluster_app, name="cluster")
    app.add_typer(job_app, name="job")


class _Terminated(Exception):
    """SIGTERM: stop like Ctrl-C."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


@cluster_app.command("start")
@user_errors
def start_command(
    config: str | None = typer.Option(
        None, "--config", help="clusters.yaml (default: one local cluster)."
    ),
    root: str = ROOT,
    port: int | None = typer.Option(None, "--port", help="Also serve the HTTP API on this port."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address of the HTTP API."),
    token: str | None = TOKEN,
) -> None:
    """Run the controller in the foreground until Ctrl-C, SIGTERM or `keel cluster stop`.

    Examples:
      keel cluster start
      keel cluster start --config clusters.yaml --root /shared/keel-cluster --port 8471
    """
    from keel.cluster import daemon

    load_federation(config)  # a bad config fails here, as one line
    if daemon.running_controller(Path(root)) is not None:  # else the lock in daemon.run decides
        raise daemon.ControllerRunning(
            f"a controller already runs for {root}: stop it first with `keel cluster stop`"
        )
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    stderr.print(f"controller for {root} running; Ctrl-C to stop")
    try:
        daemon.run(Path(root), config, serve=None if port is None else (host, port, token))
    except (KeyboardInterrupt, _Terminated):
        stderr.print("controller stopped")
    finally:
        signal.signal(signal.SIGTERM, previous)


@cluster_app.command("stop")
@user_errors
def stop_command(root: str = ROOT) -> None:
    """Stop the controller running for --root (its jobs keep running and are found again).

    Example: keel cluster stop
    """
    from keel.cluster import daemon

    running = daemon.running_controller(Path(root))
    if running is None:
        stderr.print(f"no controller runs for {root}")
        return
    database = state.connect(Path(root) / "state.db")
    state.set_value(database, "stop", "1")
    deadline = time.monotonic() + 15
    while daemon.running_controller(Path(root)) is not None:
        if time.monotonic() > deadline:
            raise UsageError(f"the controller (pid {running['pid']}) did not stop within 15 s")
        time.sleep(0.1)
    stdout.print(f"stopped the controller for {root}")


@cluster_app.command("status")
@user_errors
def status_command(root: str = ROOT, as_json: bool = JSON) -> None:
    """The clusters' last reported capacity and the jobs by state.

    Example: keel cluster status --json
    """
    from keel.cluster import daemon

    database = state.connect(Path(root) / "state.db")
    clusters = [dict(row) for row in database.execute("SELECT * FROM clusters ORDER BY name")]
    for cluster in clusters:
        cluster["total"], cluster["free"] = (
            orjson.loads(cluster["total"]),
            orjson.loads(cluster["free"]),
        )
    counts = dict(database.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())
    running = daemon.running_controller(Path(root))
    if as_json:
        print_json({"controller": running, "clusters": clusters, "jobs": counts})
        return
    stdout.print(f"controller: {'pid ' + str(running['pid']) if running else 'not running'}")
    table = Table("cluster", "backend", "region", "total", "free")
    for cluster in clusters:
        table.add_row(
            cluster["name"],
            cluster["backend"],
            cluster["region"] or "-",
            _amounts(cluster["total"]),
            _amounts(cluster["free"]),
        )
    stdout.print(table)
    stdout.print("jobs: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"))


@job_app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@user_errors
def run_command(
    context: typer.Context,
    cpus: float = typer.Option(1.0, "--cpus", help="CPUs per replica."),
    memory: int = typer.Option(0, "--memory", help="MiB per replica (0: unspecified)."),
    device: str | None = typer.Option(
        None, "--device", help="TYPE:COUNT per replica, e.g. h100:8."
    ),
    replicas: int = typer.Option(1, "--replicas", help="Replicas, started together (a gang)."),
    priority: str = typer.Option("batch", "--priority", help="production, interactive or batch."),
    region: str = typer.Option("", "--region", help="Run only on clusters of this region."),
    retries: int = typer.Option(0, "--retries", help="Attempts after a failure."),
    name: str = typer.Option("", "--name", help="A label for the job."),
    env: list[str] = typer.Option([], "--env", help="KEY=VALUE for the command (repeatable)."),
    entry: str | None = typer.Option(
        None, "--entry", help="Run a Python entry point: pkg.module or pkg.module:function."
    ),
    config: str | None = typer.Option(
        None, "--config", help="clusters.yaml for an embedded controller."
    ),
    root: str = ROOT,
    controller: str | None = CONTROLLER,
    token: str | None = TOKEN,
) -> None:
    """Submit a command as a job; print its id. Everything after `--` is the command.

    Examples:
      keel job run -- python train.py --steps 100
      keel job run --entry mypackage.train:main
      keel job run --cpus 4 --replicas 2 --priority production -- ./eval.sh
      keel job run --device h100:8 --region us -- python -m keel train run.yaml
    """
    from keel.cluster import daemon

    command = tuple(context.args)
    if entry is not None:
        command = entry_point_command(entry, command)
    device_type, device_count = parse_device(device) if device else ("cpu", 0)
    variables = {}
    for item in env:
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise UsageError(f"--env {item!r}: write KEY=VALUE")
        variables[key] = value
    spec = JobSpec(
        command=command,
        name=name,
        resources=Resources(cpus, memory, device_type, device_count),
        replicas=replicas,
        env=variables,
        region=region,
        priority=Priority.parse(priority),
        max_retries=retries,
        workdir=str(Path.cwd()),
    ).validate(check_command=controller is None)
    if controller is not None:
        typer.echo(_client(controller, token).submit(spec))
        return
    database = state.connect(Path(root) / "state.db")
    _check_known_devices(database, spec, config)
    job_id = state.submit(database, spec)
    daemon.ensure_controller(Path(root), config)
    typer.echo(job_id)


@job_app.command("list")
@user_errors
def list_command(
    job_state: str | None = typer.Option(
        None,
        "--state",
        help="Only jobs in this state: pending, running, preempted, succeeded, failed or "
        "cancelled.",
    ),
    limit: int | None = typer.Option(None, "--limit", help="At most this many (newest first)."),
    root: str = ROOT,
    as_json: bool = JSON,
) -> None:
    """The submitted jobs, newest first: id, name, state, cluster and when.

    Examples:
      keel job list
      keel job list --state running --json
    """
    from keel.cluster.listing import list_jobs

    jobs = list_jobs(Path(root) / "state.db", job_state, limit)
    if as_json:
        print_json({"jobs": jobs})
        return
    if not jobs:
        which = f" {job_state}" if job_state else ""
        stderr.print(f"no{which} jobs under {root}")
        return
    table = Table("job", "name", "state", "cluster", "submitted", "ran")
    colors = {"succeeded": "green", "failed": "red", "running": "yellow", "cancelled": "magenta"}
    now = time.time()
    for job in jobs:
        ran = (job["ended_at"] or now) - job["started_at"] if job["started_at"] else None
        table.add_row(
            job["id"],
            escape(job["name"]),
            f"[{colors.get(job['state'], 'white')}]{job['state']}[/]",
            job["cluster"] or "-",
            f"{_duration(now - job['submitted_at'])} ago",
            "-" if ran is None else _duration(ran),
        )
    stdout.print(table)


@job_app.command("status")
@user_errors
def job_status_command(
    job_id: str,
    root: str = ROOT,
    controller: str | None = CONTROLLER,
    token: str | None = TOKEN,
    as_json: bool = JSON,
) -> None:
    """A job's state (pending, running, succeeded, failed, cancelled, preempted) and tasks.

    Example: keel job status j-000001 --json
    """
    status = _status(job_id, root, controller, token)
    if as_json:
        print_json(status)
        return
    reason = f" ({status['reason']})" if status["reason"] else ""
    stdout.print(f"{status['id']} {status['name']}: {status['state']}{reason}", markup=False)
    spec = status.get("spec") or {"command": [], "env": {}}  # older servers send none
    if spec["command"]:
        stdout.print(f"  command: {shlex.join(spec['command'])}", markup=False, highlight=False)
    if spec["env"]:
        variables = " ".join(f"{key}={value}" for key, value in spec["env"].items())
        stdout.print(f"  env: {variables}", markup=False, highlight=False)
    for task in status["tasks"]:
        stdout.print(
            f"  replica {task['replica']} attempt {task['attempt']} on {task['cluster']}: "
            f"{task['state']}"
            + (f" exit {task['exit_code']}" if task["exit_code"] is not None else "")
        )


@job_app.command("logs")
@user_errors
def logs_command(
    job_id: str,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
    replica: int = typer.Option(0, "--replica", help="Which replica's output."),
    errors: bool = typer.Option(False, "--stderr", help="Its stderr instead of stdout."),
    root: str = ROOT,
    controller: str | None = CONTROLLER,
    token: str | None = TOKEN,
) -> None:
    """Print a job's output (its latest attempt); --follow waits for more until it ends.

    Example: keel job logs j-000001 --follow
    """
    from keel.cluster.logs import follow_file, output_file

    if controller is not None:
        _remote_logs(_client(controller, token), job_id, replica, errors, follow)
        return
    database = state.connect(Path(root) / "state.db")
    deadline = time.monotonic() + 30
    while True:
        status = state.job_status(database, job_id)
        task = next((t for t in status["tasks"] if t["replica"] == replica), None)
        if task is not None or not follow or status["state"] in state.FINAL_JOB_STATES:
            break
        if time.monotonic() > deadline:
            raise UsageError(
                f"job {job_id} has not started within 30 s: see `keel job status {job_id}`"
            )
        time.sleep(0.2)
    if task is None:
        stderr.print(f"job {job_id} has no output yet (state: {status['state']})")
        return
    path = output_file(Path(root), job_id, task, "stderr" if errors else "stdout")

    def ended() -> bool:
        return not follow or state.job_status(database, job_id)["state"] in state.FINAL_JOB_STATES

    hide = state.redactor(database, job_id)  # the job's secret values, as "***"
    for line in follow_file(path, done=ended):
        sys.stdout.write(hide(line) + "\n")
        sys.stdout.flush()


@job_app.command("cancel")
@user_errors
def cancel_command(
    job_id: str,
    root: str = ROOT,
    controller: str | None = CONTROLLER,
    token: str | None = TOKEN,
) -> None:
    """Cancel a job: a pending one at once, a running one at the controller's next tick.

    Example: keel job cancel j-000001
    """
    if controller is not None:
        after = _client(controller, token).cancel(job_id)
    else:
        after = state.request_cancel(state.connect(Path(root) / "state.db"), job_id)
    stdout.print(f"{job_id}: {'cancelled' if after == 'cancelled' else 'cancel requested'}")


def _status(job_id: str, root: str, controller: str | None, token: str | None) -> dict:
    if controller is not None:
        return _client(controller, token).status(job_id)
    return state.job_status(state.connect(Path(root) / "state.db"), job_id)


def _remote_logs(
    client: ControllerClient, job_id: str, replica: int, errors: bool, follow: bool
) -> None:
    offset = 0
    while True:
        chunk = client.logs(job_id, replica, "stderr" if errors else "stdout", offset)
        sys.stdout.write(chunk["text"])
        sys.stdout.flush()
        offset = chunk["offset"]
        if chunk["done"] or (not follow and not chunk["text"]):
            return
        if not chunk["text"]:
            time.sleep(0.5)


def _check_known_devices(database: sqlite3.Connection, spec: JobSpec, config: str | None) -> None:
    """Refuse at once a device type no cluster has: by the clusters' last reports, or, before any
    report, when every configured cluster is local (cpus only)."""
    kind = spec.resources.device_type
    if kind == "cpu":
        return
    totals = [orjson.loads(row[0]) for row in database.execute("SELECT total FROM clusters")]
    if not totals and all(c.backend == "local" for c in load_federation(config).clusters):
        totals = [{"cpu": 1}]
    if totals and not any(total.get(kind, 0) > 0 for total in totals):
        known = sorted({k for total in totals for k in total})
        raise UsageError(
            f"no cluster has device type {kind!r} (clusters offer: {', '.join(known)})"
        )


def _duration(seconds: float) -> str:
    """Seconds as `42s`, `7m`, `3h` or `2d`."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _amounts(amounts: dict[str, float]) -> str:
    return ", ".join(f"{kind} {value:g}" for kind, value in sorted(amounts.items())) or "-"


def _client(url: str, token: str | None) -> ControllerClient:
    from keel.cluster.api import ControllerClient

    return ControllerClient(url, token)
