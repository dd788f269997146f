"""A real single-node Slurm cluster for the tests, started once per session.

What it sets up, all under a temporary directory except munge:
- munged: reused when `munge -n | unmunge` already works; otherwise /etc/munge/munge.key is
  generated if missing and munged started (and stopped at the end).
- slurm.conf for this host (`hostname -s`, as many CPUs as `nproc`, 90% of its memory, two fake
  gpus of type "fake" backed by /dev/null and /dev/zero), free ports, SelectType=select/cons_tres
  with CR_CPU (memory is checked, not consumed), ProctrackType=proctrack/linuxproc and
  TaskPlugin=task/none, so no cgroups are needed inside a container.
- Accounting: AccountingStorageType=accounting_storage/none. Without slurmdbd (and a MariaDB
  behind it) sacct cannot answer ("accounting storage is disabled"; jobcomp/filetxt does not feed
  sacct), so the backend reads finished jobs from squeue / `scontrol show job` while slurmctld
  holds them (MinJobAge=300 s) and reports jobs it forgot as LOST.
- slurmctld and slurmd run as root in the foreground (-D) as children of pytest; SLURM_CONF points
  the Slurm commands at this cluster for the session. At the end its jobs are cancelled and the
  daemons stopped.
Without Slurm installed the tests are skipped, or fail when KEEL_REQUIRE_SLURM=1 (as in CI).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

INSTALL = "apt-get install -y --no-install-recommends slurm-wlm munge"
PARTITION = "keel"
GPU_TYPE = "fake"
GPU_FILES = ("/dev/null", "/dev/zero")  # gres needs device files; nothing opens them
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_PID = Path("/run/munge/munged.pid")


@dataclass(frozen=True)
class SlurmCluster:
    conf: str  # the slurm.conf path (also in SLURM_CONF for the session)
    partition: str
    node: str
    cpus: int
    memory_mb: int
    gpus: int  # gres gpu:fake:N on the node
    root: Path  # state, spool and daemon logs

    def log_tail(self, lines: int = 20) -> str:
        """The end of the daemons' logs, for failure messages."""
        tails = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / name
            text = path.read_text(errors="replace").splitlines() if path.exists() else []
            tails.append(f"--- {name}\n" + "\n".join(text[-lines:]))
        return "\n".join(tails)


def _unavailable(reason: str) -> None:
    if os.environ.get("KEEL_REQUIRE_SLURM") == "1":
        pytest.fail(f"{reason} (KEEL_REQUIRE_SLURM=1)", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _munge_works() -> bool:
    if shutil.which("munge") is None or shutil.which("unmunge") is None:
        return False
    credential = subprocess.run(["munge", "-n"], capture_output=True, timeout=10, check=False)
    if credential.returncode != 0:
        return False
    decoded = subprocess.run(
        ["unmunge"], input=credential.stdout, capture_output=True, timeout=10, check=False
    )
    return decoded.returncode == 0


def _start_munge() -> int | None:
    """Make munge answer; the pid of the munged this started, None if one was running."""
    if _munge_works():
        return None
    munged = shutil.which("munged") or "/usr/sbin/munged"
    owner = shutil.chown  # munge's files belong to the munge user when it exists
    has_user = subprocess.run(["id", "munge"], capture_output=True, check=False).returncode == 0
    if not MUNGE_KEY.exists():
        MUNGE_KEY.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        MUNGE_KEY.write_bytes(os.urandom(1024))
        MUNGE_KEY.chmod(0o400)
        if has_user:
            owner(MUNGE_KEY.parent, "munge", "munge")
            owner(MUNGE_KEY, "munge", "munge")
    MUNGE_PID.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    if has_user:
        owner(MUNGE_PID.parent, "munge", "munge")
        command = ["runuser", "-u", "munge", "--", munged]
    else:
        command = [munged, "--force"]
    started = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    deadline = time.monotonic() + 15
    while not _munge_works():
        if time.monotonic() > deadline:
            pytest.fail(f"munged did not start: {started.stderr.strip()}", pytrace=False)
        time.sleep(0.2)
    return int(MUNGE_PID.read_text().strip()) if MUNGE_PID.exists() else None


def _write_conf(root: Path, node: str, cpus: int, memory_mb: int) -> Path:
    gres_lines = [f"NodeName={node} Name=gpu Type={GPU_TYPE} File={f}" for f in GPU_FILES]
    (root / "gres.conf").write_text("\n".join(gres_lines) + "\n")
    settings = {
        "ClusterName": "keeltest",
        "SlurmctldHost": f"{node}(127.0.0.1)",
        "SlurmctldPort": free_port(),
        "SlurmdPort": free_port(),
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "AuthType": "auth/munge",
        "StateSaveLocation": root / "state",
        "SlurmdSpoolDir": root / "spool",
        "SlurmctldPidFile": root / "slurmctld.pid",
        "SlurmdPidFile": root / "slurmd.pid",
        "SlurmctldLogFile": root / "slurmctld.log",
        "SlurmdLogFile": root / "slurmd.log",
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "JobCompType": "jobcomp/none",
        "SchedulerType": "sched/builtin",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "GresTypes": "gpu",
        "MpiDefault": "none",
        "ReturnToService": 2,
        "MinJobAge": 300,
        "KillWait": 2,
        "InactiveLimit": 0,
    }
    lines = [f"{key}={value}" for key, value in settings.items()]
    lines.append(
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} "
        f"Gres=gpu:{GPU_TYPE}:{len(GPU_FILES)} State=UNKNOWN"
    )
    lines.append(f"PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP")
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(int(line.split()[1]) / 1024 * 0.9)
    raise RuntimeError("no MemTotal in /proc/meminfo")


def _node_state(node: str) -> str:
    done = subprocess.run(
        ["sinfo", "--noheader", "--Node", f"--nodes={node}", "--format=%t"],
        capture_output=True,
        text=True,
        timeout=15,
        check=False,
    )
    return done.stdout.strip()


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def _cancel_all_jobs() -> None:
    queued = subprocess.run(
        ["squeue", "--noheader", "--format=%i"], capture_output=True, text=True, timeout=15
    )
    jobs = queued.stdout.split()
    if not jobs:
        return
    subprocess.run(["scancel", *jobs], capture_output=True, timeout=15, check=False)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = subprocess.run(
            ["squeue", "--noheader", "--format=%i"], capture_output=True, text=True, timeout=15
        )
        if not left.stdout.split():
            return
        time.sleep(0.3)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Start munged (if needed), slurmctld and slurmd; yield once the node is idle."""
    missing = [p for p in ("sbatch", "slurmctld", "slurmd", "munged") if not _which(p)]
    if missing:
        _unavailable(f"Slurm is not installed (no {', '.join(missing)}): {INSTALL}")
    if os.geteuid() != 0:
        _unavailable("the test Slurm cluster needs root: slurmd runs jobs as their user")
    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True)
    root = tmp_path_factory.mktemp("slurm")
    (root / "state").mkdir()
    (root / "spool").mkdir()
    name, cpus, memory_mb = node.stdout.strip(), len(os.sched_getaffinity(0)), _memory_mb()
    conf = _write_conf(root, name, cpus, memory_mb)
    cluster = SlurmCluster(str(conf), PARTITION, name, cpus, memory_mb, len(GPU_FILES), root)
    munged = _start_munge()
    daemons: list[subprocess.Popen] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(conf))
        try:
            for argv in (
                [_which("slurmctld"), "-D", "-c", "-f", str(conf)],
                [_which("slurmd"), "-D", "-N", cluster.node, "-f", str(conf)],
            ):
                name = Path(argv[0]).name
                with open(cluster.root / f"{name}.out", "w") as out:
                    daemons.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 60
            while (state := _node_state(cluster.node)) != "idle":
                ended = [p.args[0] for p in daemons if p.poll() is not None]
                if ended or time.monotonic() > deadline:
                    pytest.fail(
                        f"the test Slurm node is {state or 'unknown'!r}, not idle "
                        f"(exited: {ended}):\n{cluster.log_tail()}",
                        pytrace=False,
                    )
                time.sleep(0.3)
            yield cluster
        finally:
            if daemons and daemons[0].poll() is None:
                _cancel_all_jobs()
            for process in reversed(daemons):
                _stop(process)
            if munged is not None:
                os.kill(munged, signal.SIGTERM)


def _which(program: str) -> str:
    """A program on PATH or in /usr/sbin (daemons live there, often outside a user's PATH)."""
    return shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin") or ""
