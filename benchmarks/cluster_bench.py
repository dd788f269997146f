"""Trivial jobs per second: keel's task backends against Ray's own job submission, one machine.

What it measures: how fast N trivial jobs (`true`) go from "submit" to "all finished", through
- keel-local: keel/cluster/local.py's LocalBackend (subprocesses of this machine);
- keel-controller: the same through the controller: jobs queued in SQLite, ticks until done;
- ray-cli: `ray job submit --no-wait -- true`, one CLI process per job, as a shell user would;
- ray-client: Ray's Python JobSubmissionClient, submit_job per job;
- keel-ray: keel/cluster/ray_backend.py's RayBackend (the Jobs API, plus the log copy it makes
  when a job ends).
The keel contenders use only the TaskBackend protocol (launch all, then poll until none is
running), as the controller does; neither Ray nor keel queues here, since the jobs ask 0 cpus by
default (the `ray job submit` default; --job-cpus changes it for every contender).

How:
- One Ray head for the whole run (`ray start --head`, --cpus cpus, token auth, its own temp dir
  and ports), started before timing and stopped at the end by signalling only its processes; or
  the cluster at --address.
- Per repeat the contenders run in turn (keel-local, ray-cli, ray-client, keel-ray, ...), each
  with fresh submission ids. Timed per contender: `submit s` (until the last job was accepted)
  and `total s` (until every job was seen finished, polling every POLL_SECONDS); every job must
  have succeeded. Clients are made before the clock starts; each CLI process's start-up is part
  of ray-cli's cost. The table shows medians over --repeats runs; jobs/s = N / total s.

    python benchmarks/cluster_bench.py [--jobs 50] [--repeats 3] [--cpus N] [--address URL]
    python benchmarks/cluster_bench.py --contenders keel-local,keel-controller   # no Ray at all
    python benchmarks/cluster_bench.py --smoke   # a tiny run of the keel contenders (seconds)

Without a Ray contender no Ray head is started (and Ray need not be installed).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

POLL_SECONDS = 0.1
TIMEOUT_SECONDS = 600.0
CONTENDERS = ("keel-local", "keel-controller", "ray-cli", "ray-client", "keel-ray")
KEEL_ONLY = ("keel-local", "keel-controller")
RAY_DONE = {"SUCCEEDED", "FAILED", "STOPPED"}


class Head:
    """A Ray head started for the benchmark (or an existing cluster when `address` is given)."""

    def __init__(self, cpus: int, address: str = "") -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="kbench", dir="/tmp")
        self.group = 0
        self.token = ""  # "" with --address: Ray's clients find the user's token themselves
        self.env = dict(os.environ)
        if not address:
            self.token = secrets.token_hex(32)
            token_file = Path(self.temp_dir) / "auth_token"
            token_file.write_text(self.token)
            self.env.pop("RAY_AUTH_TOKEN", None)
            self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
        self.address = address or self._start(cpus)

    def _start(self, cpus: int) -> str:
        dashboard = _free_port()
        command = [
            ray_command(), "start", "--head", "--port=0", f"--dashboard-port={dashboard}",
            f"--num-cpus={cpus}", "--include-dashboard=true", f"--temp-dir={self.temp_dir}",
            f"--ray-client-server-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats",
        ]  # fmt: skip
        with open(Path(self.temp_dir) / "ray-start.log", "wb") as output:
            starter = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,
            )  # fmt: skip
        self.group = starter.pid
        if starter.wait(timeout=120) != 0:
            raise SystemExit((Path(self.temp_dir) / "ray-start.log").read_text()[-3000:])
        address = f"http://127.0.0.1:{dashboard}"
        request = urllib.request.Request(
            f"{address}/api/jobs/", headers={"Authorization": f"Bearer {self.token}"}
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(request, timeout=5):
                    return address
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def client(self):
        from ray.job_submission import JobSubmissionClient

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        return JobSubmissionClient(self.address, headers=headers)

    def stop(self) -> None:
        """Signal the processes of the head this benchmark started (never other Ray instances)."""
        if self.group:
            pids = _tree(self.group, self.temp_dir)
            _signal(pids, signal.SIGTERM)
            deadline = time.monotonic() + 2  # then SIGKILL: some linger on SIGTERM
            while time.monotonic() < deadline and _tree(self.group, self.temp_dir):
                time.sleep(0.2)
            _signal(_tree(self.group, self.temp_dir), signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


# --- contenders: each returns (submit seconds, total seconds) ------------------------------------


def run_keel(backend, jobs: int, tag: str, cpus: float) -> tuple[float, float]:
    """The keel half: N tasks through any TaskBackend, using only the protocol."""
    from keel.cluster.backend import TaskLaunch, TaskState

    start = time.perf_counter()
    handles = [
        backend.launch(TaskLaunch(task_id=f"{tag}.{n}", attempt=1, command=("true",), cpus=cpus))
        for n in range(jobs)
    ]
    submitted = time.perf_counter() - start
    running = set(handles)
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while running:
        for handle, status in backend.poll(sorted(running)).items():
            if status.state in (TaskState.PENDING, TaskState.RUNNING):
                continue
            if status.state is not TaskState.SUCCEEDED:
                raise SystemExit(f"{tag}: task {handle} {status.state}: {status.reason}")
            running.discard(handle)
        if running:
            _pause(deadline, tag)
    return submitted, time.perf_counter() - start


def run_keel_local(head: Head, jobs: int, tag: str, cpus: float, work: Path):
    from keel.cluster.local import LocalBackend

    backend = LocalBackend(work / tag, max_cpus=os.cpu_count())
    try:
        return run_keel(backend, jobs, tag, cpus)
    finally:
        backend.close()


def run_keel_controller(head: Head, jobs: int, tag: str, cpus: float, work: Path):
    """The whole keel path: jobs submitted to the controller's SQLite queue, then ticks (no
    sleep between them) until every job has succeeded: scheduling, launch and reconcile."""
    from keel.cluster.controller import Controller
    from keel.cluster.local import LocalBackend
    from keel.cluster.spec import JobSpec, Resources
    from keel.cluster.state import submit

    control = Controller(
        work / tag, {"local": LocalBackend(work / tag / "tasks", max_cpus=os.cpu_count())}
    )
    spec = JobSpec(("true",), resources=Resources(cpus=max(cpus, 0.001)))
    try:
        start = time.perf_counter()
        for _ in range(jobs):
            submit(control.database, spec)
        submitted = time.perf_counter() - start
        deadline = time.monotonic() + TIMEOUT_SECONDS
        query = "SELECT count(*) FROM jobs WHERE state != 'succeeded'"
        while control.database.execute(query).fetchone()[0]:
            failed = control.database.execute("SELECT count(*) FROM jobs WHERE state = 'failed'")
            if failed.fetchone()[0]:
                raise SystemExit(f"{tag}: a job failed")
            control.tick()
            if time.monotonic() > deadline:
                raise SystemExit(f"{tag}: timed out")
        return submitted, time.perf_counter() - start
    finally:
        control.close()


def run_keel_ray(head: Head, jobs: int, tag: str, cpus: float, work: Path):
    from keel.cluster.ray_backend import RayBackend

    backend = RayBackend(head.address, work / tag, token=head.token or None)
    backend.capacity()  # connect before the clock starts, as the other clients do
    try:
        return run_keel(backend, jobs, tag, cpus)
    finally:
        backend.close()


def run_ray_client(head: Head, jobs: int, tag: str, cpus: float, work: Path):
    client = head.client()
    start = time.perf_counter()
    ids = [
        client.submit_job(entrypoint="true", submission_id=f"{tag}-{n}", entrypoint_num_cpus=cpus)
        for n in range(jobs)
    ]
    submitted = time.perf_counter() - start
    _wait_ray(client, ids, tag)
    return submitted, time.perf_counter() - start


def run_ray_cli(head: Head, jobs: int, tag: str, cpus: float, work: Path):
    client = head.client()
    ray = ray_command()
    start = time.perf_counter()
    ids = []
    for n in range(jobs):
        ids.append(f"{tag}-{n}")
        subprocess.run(
            [ray, "job", "submit", "--address", head.address, "--submission-id", ids[-1],
             f"--entrypoint-num-cpus={cpus}", "--no-wait", "--", "true"],
            env=head.env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    submitted = time.perf_counter() - start
    _wait_ray(client, ids, tag)
    return submitted, time.perf_counter() - start


RUNNERS: dict[str, Callable] = {
    "keel-local": run_keel_local,
    "keel-controller": run_keel_controller,
    "ray-cli": run_ray_cli,
    "ray-client": run_ray_client,
    "keel-ray": run_keel_ray,
}


def _wait_ray(client, ids: list[str], tag: str) -> None:
    running = set(ids)
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while running:
        for sid in sorted(running):
            status = str(client.get_job_status(sid))
            if status in RAY_DONE:
                if status != "SUCCEEDED":
                    raise SystemExit(f"{tag}: job {sid} {status}")
                running.discard(sid)
        if running:
            _pause(deadline, tag)


def _pause(deadline: float, tag: str) -> None:
    if time.monotonic() > deadline:
        raise SystemExit(f"{tag}: jobs still running after {TIMEOUT_SECONDS:.0f} s")
    time.sleep(POLL_SECONDS)


# --- helpers -------------------------------------------------------------------------------------


def ray_command() -> str:
    found = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if found is None:
        raise SystemExit("the `ray` command is missing: pip install 'ray[default]'")
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tree(group: int, marker: str) -> set[int]:
    """Live processes in process group `group` or naming `marker`, and their descendants."""
    parents, mine = {}, set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError):
            continue
        if fields[0] == "Z":
            continue
        parents[int(entry.name)] = int(fields[1])
        if int(fields[2]) == group or marker in cmdline:
            mine.add(int(entry.name))
    while more := {pid for pid, parent in parents.items() if parent in mine} - mine:
        mine |= more
    return mine - {os.getpid()}


def _signal(pids: set[int], number: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            continue


def machine(with_ray: bool) -> str:
    ray = ""
    if with_ray:
        import ray as ray_module

        ray = f", ray {ray_module.__version__}"
    return (
        f"{os.cpu_count()} cores, Python {platform.python_version()}{ray}, "
        f"{platform.system()} {platform.release()}"
    )


def report(results: dict[str, list[tuple[float, float]]], jobs: int, repeats: int, head: str):
    lines = [
        machine(with_ray=bool(set(results) - set(KEEL_ONLY))),
        "",
        f"{jobs} trivial jobs (`true`) per run, median of {repeats} runs; Ray: {head}",
        "",
        "| contender | submit s | total s | jobs/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        submit = statistics.median(run[0] for run in runs)
        total = statistics.median(run[1] for run in runs)
        lines.append(f"| {name} | {submit:.2f} | {total:.2f} | {jobs / total:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50, help="trivial jobs per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="the head's cpus")
    parser.add_argument("--job-cpus", type=float, default=0.0, help="cpus each job asks")
    parser.add_argument("--address", default="", help="an existing cluster's dashboard URL")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated")
    parser.add_argument(
        "--smoke", action="store_true", help="5 jobs, 1 run, keel contenders only: seconds"
    )
    arguments = parser.parse_args()
    if arguments.smoke:
        arguments.jobs, arguments.repeats, arguments.contenders = 5, 1, ",".join(KEEL_ONLY)
    names = [name for name in arguments.contenders.split(",") if name]
    unknown = set(names) - set(CONTENDERS)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}: use some of {CONTENDERS}")
    run_id = datetime.datetime.now().strftime("%H%M%S")
    work = Path(tempfile.mkdtemp(prefix="keel-cluster-bench-", dir="/tmp"))
    needs_ray = bool(set(names) - set(KEEL_ONLY))
    head = Head(arguments.cpus, arguments.address) if needs_ray else None
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    try:
        for repeat in range(arguments.repeats):
            for name in names:
                tag = f"bench-{run_id}-{name}-{repeat}"
                seconds = RUNNERS[name](head, arguments.jobs, tag, arguments.job_cpus, work)
                results[name].append(seconds)
                print(f"{tag}: submit {seconds[0]:.2f} s, total {seconds[1]:.2f} s", flush=True)
    finally:
        if head is not None:
            head.stop()
        shutil.rmtree(work, ignore_errors=True)
    where = arguments.address or f"a local head started here, {arguments.cpus} cpus"
    if head is None:
        where = "not used"
    print()
    print(report(results, arguments.jobs, arguments.repeats, where))


if __name__ == "__main__":
    main()
