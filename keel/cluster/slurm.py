"""The Slurm backend: one task is one batch job, submitted with sbatch and observed with squeue.

A handle is the Slurm job id, so a restarted controller finds its jobs again. `poll` asks squeue
(one call, all states) about everything slurmctld still holds in memory, which includes jobs that
ended less than `MinJobAge` seconds ago (300 by default); the exit code of a job that failed comes
from `scontrol show job`. Jobs slurmctld has forgotten are looked up with sacct; when accounting is
disabled (AccountingStorageType=accounting_storage/none) sacct cannot answer and they are LOST.

Log files and the batch script live in one directory per attempt, by default
`<log_root>/<task_id>/<attempt>/`; on a real cluster it must be on a file system the compute nodes
share. `<log_root>/handles/<job id>` maps a handle back to its log directory.

Gangs (a job of N > 1 replicas) are N batch jobs of one task each, not one job of N tasks: the
backend contract launches, polls, cancels and shows the logs of one replica per handle, and a
Slurm job id as the handle keeps adoption after a controller restart as it is; one job with
`--ntasks=N` would need per-task handles inside one job and every replica's log directory at
the first launch. The price: Slurm may start the N jobs at different times, so their batch
scripts meet in the gang's directory (`TaskLaunch.gang_dir`, under the controller's root, which
must be shared like the log directories) before the command starts. Replica 0 writes
`slurm-coordinator` there (its node's host name and the port the launcher chose in
KEEL_COORDINATOR), every replica touches `ready-<i>`, and once all N are there (within
`gang_start_s`, 600 s by default) each exports KEEL_COORDINATOR from that file and runs the
command. A replica whose siblings do not start in time exits 2 with one `error:` line, failing
the gang; the controller retries it as it retries any failed gang.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shlex
import shutil
import subprocess

from keel.cluster.backend import Capacity, TaskLaunch, TaskState, TaskStatus
from keel.cluster.secrets import private_dir, write_private
from keel.core.errors import KeelError, UsageError

logger = logging.getLogger(__name__)

_JOB_ID = re.compile(r"\d+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IDS_PER_CALL = 200  # job ids per squeue / sacct call, to keep command lines short

# fmt: off
_PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}
_RUNNING = {"CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING",
            "STAGE_OUT", "RESIZING", "POWER_UP_NODE", "UPDATE_DB"}
# Node state words (base state or flag) that mean the node takes no new work.
_UNUSABLE = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "FUTURE", "NOT_RESPONDING",
             "MAINTENANCE", "INVALID", "INVALID_REG", "UNKNOWN"}
# fmt: on
# Terminal states other than COMPLETED and CANCELLED: what the task becomes and why.
_FAILED_WHY = {
    "FAILED": "",  # the reason is the exit code or signal
    "TIMEOUT": "hit its Slurm time limit (TIMEOUT)",
    "OUT_OF_MEMORY": "ran out of memory (OUT_OF_MEMORY)",
    "DEADLINE": "missed its Slurm deadline (DEADLINE)",
    "SPECIAL_EXIT": "ended with a special exit (SPECIAL_EXIT)",
}
_LOST_WHY = {
    "NODE_FAIL": "its Slurm node failed (NODE_FAIL)",
    "BOOT_FAIL": "its Slurm node failed to boot (BOOT_FAIL)",
    "PREEMPTED": "Slurm preempted it (PREEMPTED)",
    "REVOKED": "Slurm revoked it (REVOKED)",
    "LAUNCH_FAILED": "Slurm could not launch it (LAUNCH_FAILED)",
}


class SlurmError(KeelError):
    """Slurm did not answer (slurmctld down, a command timed out): try again later."""


class SlurmBackend:
    """Runs each task as a Slurm batch job on `partition` (None: the cluster's default one).

    `extra_args` go to every sbatch call as they are (e.g. "--time=04:00:00", "--account=lm").
    `timeout_s` bounds each Slurm command; `gang_start_s` is how long the batch jobs of a gang
    wait for each other to start (see the module docstring).
    """

    name = "slurm"

    def __init__(
        self,
        log_root: str,
        partition: str | None = None,
        extra_args: tuple[str, ...] = (),
        timeout_s: float = 30.0,
        gang_start_s: float = 600.0,
    ) -> None:
        self.log_root = os.path.abspath(log_root)
        self.partition = partition
        self.extra_args = tuple(extra_args)
        self.timeout_s = timeout_s
        self.gang_start_s = gang_start_s
        self._gpu_types: dict[str, str] | None = None  # lower-case device type -> Slurm gres type
        self._default = ""  # the cluster's default partition, once asked

    # --- launch / cancel / logs ----------------------------------------------------------------

    def launch(self, task: TaskLaunch) -> str:
        """Submit the task with sbatch; return the Slurm job id. Launching an attempt that was
        already submitted (a controller that died before recording the handle) adopts its job."""
        if not task.command:
            raise UsageError(f"task {task.task_id}: no command to run")
        log_dir = task.log_dir or os.path.join(self.log_root, task.task_id, str(task.attempt))
        stdout, stderr = _log_paths(log_dir)
        script = os.path.join(log_dir, "job.sh")
        adopted = self._adopt(task, log_dir, script)
        if adopted:
            return adopted
        private_dir(log_dir)
        write_private(script, _batch_script(task, self.gang_start_s))  # it holds the job's env
        argv = [
            "sbatch",
            "--parsable",
            f"--job-name=keel-{task.task_id}",
            f"--comment={_comment(task)}",
            f"--output={stdout}",
            f"--error={stderr}",
            f"--chdir={os.path.abspath(task.workdir or os.getcwd())}",
            "--nodes=1",
            "--ntasks=1",
            f"--cpus-per-task={max(1, math.ceil(task.cpus))}",
            "--no-requeue",  # the controller decides about requeues, not Slurm
        ]
        if self.partition:
            argv.append(f"--partition={self.partition}")
        if task.memory_mb:
            argv.append(f"--mem={task.memory_mb}M")
        if task.device_type != "cpu" and task.device_count:
            argv.append(f"--gres={self._gres(task.device_type, task.device_count)}")
        argv += [*self.extra_args, script]
        done = self._run(argv)
        if done.returncode != 0:
            message = _one_line(done.stderr)
            if _unreachable(message):
                raise SlurmError(f"sbatch for task {task.task_id} failed: {message}")
            raise UsageError(
                f"Slurm refused task {task.task_id}: {message} (see {script}; change the "
                "task's resources or the backend's partition / extra_args)"
            )
        job_id = done.stdout.strip().split(";")[0]
        if not _JOB_ID.fullmatch(job_id):
            raise SlurmError(f"sbatch answered {done.stdout.strip()!r}, not a job id")
        self._record(job_id, log_dir)
        logger.info("task %s attempt %d is Slurm job %s", task.task_id, task.attempt, job_id)
        return job_id

    def _adopt(self, task: TaskLaunch, log_dir: str, script: str) -> str | None:
        """The job id of this attempt if it was submitted before, else None."""
        marker = os.path.join(log_dir, "slurm_job_id")
        if os.path.exists(marker):
            with open(marker) as file:
                return file.read().strip()
        if not os.path.exists(script):  # never submitted: the script is written first
            return None
        argv = ["squeue", "--noheader", "--states=all", f"--name=keel-{task.task_id}"]
        done = self._run([*argv, "--format=%i|%k"])
        if done.returncode != 0:
            raise SlurmError(f"squeue failed: {_one_line(done.stderr)}")
        for line in done.stdout.splitlines():
            job_id, _, comment = line.strip().partition("|")
            if comment == _comment(task):
                self._record(job_id, log_dir)
                logger.info(
                    "task %s attempt %d: adopted job %s", task.task_id, task.attempt, job_id
                )
                return job_id
        return None

    def _record(self, job_id: str, log_dir: str) -> None:
        """Remember the job in its attempt directory, and its log directory under the handle."""
        with open(os.path.join(log_dir, "slurm_job_id"), "w") as handle:
            handle.write(job_id + "\n")
        private_dir(os.path.join(self.log_root, "handles"))
        with open(os.path.join(self.log_root, "handles", job_id), "w") as handle:
            handle.write(log_dir + "\n")

    def cancel(self, handle: str) -> None:
        """scancel the job; a job that already ended or that Slurm forgot is left alone."""
        if not _JOB_ID.fullmatch(handle):
            return
        done = self._run(["scancel", handle])
        message = _one_line(done.stderr)
        if done.returncode != 0 and not re.search(r"Invalid job id|already complet", message):
            raise SlurmError(f"scancel {handle} failed: {message}")

    def log_files(self, handle: str) -> tuple[str, str]:
        """The job's stdout and stderr paths, from the index written at launch, else slurmctld."""
        index = os.path.join(self.log_root, "handles", handle)
        if _JOB_ID.fullmatch(handle) and os.path.exists(index):
            with open(index) as file:
                return _log_paths(file.read().strip())
        details = self._show_job(handle) if _JOB_ID.fullmatch(handle) else None
        if details and details.get("StdOut"):
            return details["StdOut"], details.get("StdErr") or details["StdOut"]
        raise UsageError(
            f"Slurm job {handle!r}: no log files known (it was not launched with log root "
            f"{self.log_root} and slurmctld no longer holds it)"
        )

    # --- poll ------------------------------------------------------------------------------------

    def poll(self, handles: list[str]) -> dict[str, TaskStatus]:
        """squeue for what slurmctld holds, scontrol for exit codes, sacct for older jobs."""
        result: dict[str, TaskStatus] = {}
        ids = []
        for handle in dict.fromkeys(handles):
            if _JOB_ID.fullmatch(handle):
                ids.append(handle)
            else:
                result[handle] = TaskStatus(handle, TaskState.LOST, reason="not a Slurm job id")
        queued = self._squeue(ids)
        forgotten = []
        for job in ids:
            status = self._from_queue(job, *queued[job]) if job in queued else None
            if status is None:
                forgotten.append(job)
            else:
                result[job] = status
        result.update(self._from_accounting(forgotten))
        return result

    def _squeue(self, ids: list[str]) -> dict[str, tuple[str, str]]:
        """Job id -> (state, reason) for the jobs slurmctld still holds."""
        found: dict[str, tuple[str, str]] = {}
        for start in range(0, len(ids), _IDS_PER_CALL):
            chunk = ",".join(ids[start : start + _IDS_PER_CALL])
            argv = ["squeue", "--noheader", "--states=all", f"--jobs={chunk}", "--format=%i|%T|%r"]
            done = self._run(argv)
            if done.returncode != 0:
                message = _one_line(done.stderr)
                if "Invalid job id" in message:  # none of the chunk's jobs is known
                    continue
                raise SlurmError(f"squeue failed: {message}")
            for line in done.stdout.splitlines():
                job, state, reason = [*line.strip().split("|"), "", ""][:3]
                found[job] = (state, reason)
        return found

    def _from_queue(self, job: str, state: str, reason: str) -> TaskStatus | None:
        """A status from squeue's state; None when slurmctld forgot the job meanwhile."""
        if state in _PENDING:
            why = "" if reason in ("", "None") else f"pending in Slurm: {reason}"
            return TaskStatus(job, TaskState.PENDING, reason=why)
        if state in _RUNNING:
            return TaskStatus(job, TaskState.RUNNING)
        if state == "COMPLETED":
            return TaskStatus(job, TaskState.SUCCEEDED, exit_code=0)
        if state == "CANCELLED":
            return TaskStatus(job, TaskState.CANCELLED, reason="cancelled in Slurm")
        details = self._show_job(job)
        if details is None:
            return None
        code, signal = _exit_code(details.get("ExitCode", ""))
        return _ended(job, details.get("JobState", state), code, signal)

    def _from_accounting(self, ids: list[str]) -> dict[str, TaskStatus]:
        """Statuses of jobs slurmctld no longer holds, from sacct (LOST where it cannot tell)."""
        result: dict[str, TaskStatus] = {}
        for start in range(0, len(ids), _IDS_PER_CALL):
            chunk = ids[start : start + _IDS_PER_CALL]
            argv = ["sacct", "--noheader", "--parsable2", "--allocations"]
            argv += [f"--jobs={','.join(chunk)}", "--format=JobIDRaw,State,ExitCode"]
            done = self._run(argv)
            message = _one_line(done.stderr)
            if done.returncode != 0 and "accounting storage is disabled" in message:
                why = "Slurm forgot the job and accounting is disabled, so sacct cannot tell"
                result.update({job: TaskStatus(job, TaskState.LOST, reason=why) for job in chunk})
                continue
            if done.returncode != 0:
                raise SlurmError(f"sacct failed: {message}")
            for line in done.stdout.splitlines():
                job, state, exit_text = [*line.strip().split("|"), "", ""][:3]
                if job in chunk:
                    code, signal = _exit_code(exit_text)
                    result[job] = _ended(job, state, code, signal)
        for job in ids:
            result.setdefault(
                job, TaskStatus(job, TaskState.LOST, reason="neither squeue nor sacct knows it")
            )
        return result

    # --- capacity --------------------------------------------------------------------------------

    def capacity(self) -> Capacity:
        """Cpus (and gpu gres, per type and as "gpu") of the partition's usable nodes. Free is
        what is idle less what this user's keel jobs still pending in Slurm asked for: a job
        launched in an earlier tick counts as taken even before Slurm starts it."""
        partition = self.partition or self._default_partition()
        total: dict[str, float] = {"cpu": 0.0}
        free: dict[str, float] = {"cpu": 0.0}
        for node in self._nodes(partition):
            if set(node.get("State", "UNKNOWN").split("+")) & _UNUSABLE:
                continue
            cpus = float(node.get("CPUEfctv") or node.get("CPUTot") or 0)
            total["cpu"] += cpus
            free["cpu"] += max(0.0, cpus - float(node.get("CPUAlloc") or 0))
            used = _gpus(node.get("GresUsed", ""))
            for kind, count in _gpus(node.get("Gres", "")).items():
                total[kind] = total.get(kind, 0.0) + count
                free[kind] = free.get(kind, 0.0) + max(0.0, count - used.get(kind, 0.0))
        for kind, amount in self._pending_demand(partition).items():
            if kind in free:
                free[kind] = max(0.0, free[kind] - amount)
        return Capacity(total=total, free=free, region="")

    def _pending_demand(self, partition: str) -> dict[str, float]:
        """Cpus and gpus asked for by this user's keel jobs pending in `partition`."""
        argv = ["squeue", "--noheader", "--states=PENDING", f"--partition={partition}"]
        argv += [f"--user={os.getuid()}", "--format=%j|%C|%b"]
        done = self._run(argv)
        if done.returncode != 0:
            raise SlurmError(f"squeue failed: {_one_line(done.stderr)}")
        demand: dict[str, float] = {"cpu": 0.0}
        for line in done.stdout.splitlines():
            name, cpus, gres = [*line.strip().split("|"), "", ""][:3]
            if not name.startswith("keel-"):
                continue
            demand["cpu"] += float(cpus) if cpus.isdigit() else 0.0
            for kind, count in _gpus(re.sub(r"^gres[:/]", "", gres)).items():
                demand[kind] = demand.get(kind, 0.0) + count
        return demand

    def close(self) -> None:
        """Nothing to release: every call is a separate Slurm command."""

    def _nodes(self, partition: str) -> list[dict[str, str]]:
        """`scontrol show node` fields of the nodes in `partition`."""
        done = self._run(["scontrol", "--details", "--oneliner", "show", "node"])
        if done.returncode != 0:
            raise SlurmError(f"scontrol show node failed: {_one_line(done.stderr)}")
        nodes = [_fields(line) for line in done.stdout.splitlines() if line.strip()]
        return [n for n in nodes if partition in n.get("Partitions", "").split(",")]

    def _default_partition(self) -> str:
        """The partition sbatch uses without --partition (asked once)."""
        if self._default:
            return self._default
        done = self._run(["scontrol", "--oneliner", "show", "partition"])
        if done.returncode != 0:
            raise SlurmError(f"scontrol show partition failed: {_one_line(done.stderr)}")
        for line in done.stdout.splitlines():
            fields = _fields(line)
            if fields.get("Default") == "YES":
                self._default = fields["PartitionName"]
                return self._default
        raise UsageError("this Slurm cluster has no default partition: give the backend one")

    def _gres(self, device_type: str, count: int) -> str:
        """The --gres value for `count` devices of `device_type`, if the partition has them."""
        if self._gpu_types is None:
            types: dict[str, str] = {}
            for node in self._nodes(self.partition or self._default_partition()):
                for entry in _gres_entries(node.get("Gres", "")):
                    if entry[0] == "gpu":
                        types["gpu"] = ""
                        if entry[1]:
                            types[entry[1].lower()] = entry[1]
            self._gpu_types = types
        kind = device_type.lower()
        if kind not in self._gpu_types:
            have = ", ".join(sorted(self._gpu_types)) or "none"
            where = self.partition or "the default partition"
            raise UsageError(
                f"Slurm {where} has no {device_type!r} gpus (it has: {have}): "
                "ask for a device type it has or use another cluster"
            )
        gres_type = self._gpu_types[kind]
        return f"gpu:{gres_type}:{count}" if gres_type else f"gpu:{count}"

    # --- commands --------------------------------------------------------------------------------

    def _show_job(self, job: str) -> dict[str, str] | None:
        """`scontrol show job` fields, or None when slurmctld does not hold the job."""
        done = self._run(["scontrol", "--oneliner", "show", "job", job])
        if done.returncode != 0:
            message = _one_line(done.stderr)
            if "Invalid job id" in message:
                return None
            raise SlurmError(f"scontrol show job {job} failed: {message}")
        return _fields(done.stdout)

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        if shutil.which(argv[0]) is None:
            raise UsageError(f"{argv[0]} not found: install Slurm or use the local backend")
        try:
            return subprocess.run(
                argv, capture_output=True, text=True, timeout=self.timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            raise SlurmError(
                f"{argv[0]} did not answer within {self.timeout_s:g} s: is slurmctld up? "
                "check with sinfo"
            ) from None


def _log_paths(log_dir: str) -> tuple[str, str]:
    return os.path.join(log_dir, "stdout.log"), os.path.join(log_dir, "stderr.log")


def _comment(task: TaskLaunch) -> str:
    """The Slurm job comment that tells which attempt a job runs (to adopt it after a crash)."""
    return f"keel {task.task_id} attempt {task.attempt}"


def _batch_script(task: TaskLaunch, gang_start_s: float) -> str:
    """A bash script that sets the task's environment and execs its command."""
    lines = ["#!/bin/bash", f"# keel task {task.task_id}, attempt {task.attempt}"]
    for key, value in task.env.items():
        if not _ENV_NAME.fullmatch(key):
            raise UsageError(f"task {task.task_id}: {key!r} is not a valid environment variable")
        lines.append(f"export {key}={shlex.quote(value)}")
    if task.gang_dir:
        lines += _gang_rendezvous(task, math.ceil(gang_start_s))
    lines.append(f"exec {shlex.join(task.command)}")
    return "\n".join(lines) + "\n"


def _gang_rendezvous(task: TaskLaunch, seconds: int) -> list[str]:
    """Bash lines that wait (up to `seconds`) until every replica of the gang has started and
    point KEEL_COORDINATOR at replica 0's node (see the module docstring)."""
    gang = shlex.quote(task.gang_dir)
    replicas = int(task.env.get("KEEL_REPLICAS", "1"))
    why = (
        f"error: keel task {task.task_id}: not all {replicas} replicas of the gang started "
        f"within {seconds} s (see squeue); the gang fails and keel retries it"
    )
    return [
        f"gang={gang}",
        'if [ "$KEEL_REPLICA" = 0 ]; then',
        '  echo "$(hostname):${KEEL_COORDINATOR##*:}" > "$gang/slurm-coordinator.$$"',
        '  mv "$gang/slurm-coordinator.$$" "$gang/slurm-coordinator"',
        "fi",
        'touch "$gang/ready-$KEEL_REPLICA"',
        f"deadline=$((SECONDS + {seconds}))",
        'until [ -e "$gang/slurm-coordinator" ] && '
        f'[ "$(ls "$gang" | grep -c "^ready-")" -ge {replicas} ]; do',
        f"  if [ $SECONDS -ge $deadline ]; then echo {shlex.quote(why)} >&2; exit 2; fi",
        "  sleep 0.5",
        "done",
        'export KEEL_COORDINATOR="$(cat "$gang/slurm-coordinator")"',
    ]


def _ended(job: str, state: str, code: int | None, signal: int) -> TaskStatus:
    """The status of a job in a Slurm state (sacct may append words: "CANCELLED by 0")."""
    state = state.split(" ")[0].rstrip("+")
    if code is not None and signal:
        code = 128 + signal
    if state in _PENDING or state in _RUNNING:
        why = f"Slurm's accounting says {state} but slurmctld no longer holds the job"
        return TaskStatus(job, TaskState.LOST, exit_code=code, reason=why)
    if state == "COMPLETED":
        return TaskStatus(job, TaskState.SUCCEEDED, exit_code=code)
    if state == "CANCELLED":
        return TaskStatus(job, TaskState.CANCELLED, reason="cancelled in Slurm")
    if state in _FAILED_WHY:
        why = _FAILED_WHY[state] or (
            f"killed by signal {signal}" if signal else f"exited with code {code}"
        )
        return TaskStatus(job, TaskState.FAILED, exit_code=code, reason=why)
    why = _LOST_WHY.get(state, f"Slurm reports an unexpected state {state!r}")
    return TaskStatus(job, TaskState.LOST, exit_code=code, reason=why)


def _exit_code(text: str) -> tuple[int | None, int]:
    """Slurm's "EXIT:SIGNAL" -> (exit code, signal); (None, 0) when absent."""
    match = re.fullmatch(r"(\d+):(\d+)", text.strip())
    return (int(match[1]), int(match[2])) if match else (None, 0)


def _fields(line: str) -> dict[str, str]:
    """`Key=Value` pairs of one `scontrol --oneliner` line (values with spaces are cut short)."""
    return dict(re.findall(r"(?:^|\s)([A-Za-z/:]+)=(\S*)", line))


def _gres_entries(text: str) -> list[tuple[str, str, float]]:
    """ "gpu:a100:4(S:0-1),gpu:2" -> [("gpu", "a100", 4), ("gpu", "", 2)]."""
    entries = []
    for item in re.sub(r"\([^)]*\)", "", text).split(","):
        parts = item.strip().split(":")
        if len(parts) < 2 or not parts[-1].isdigit():
            continue
        entries.append((parts[0], parts[1] if len(parts) > 2 else "", float(parts[-1])))
    return entries


def _gpus(text: str) -> dict[str, float]:
    """Gpu counts of a Gres / GresUsed text, per lower-case type and in all under "gpu"."""
    counts: dict[str, float] = {}
    for name, gres_type, count in _gres_entries(text):
        if name != "gpu":
            continue
        counts["gpu"] = counts.get("gpu", 0.0) + count
        if gres_type:
            counts[gres_type.lower()] = counts.get(gres_type.lower(), 0.0) + count
    return counts


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " / ".join(lines)[:300] or "no message"


def _unreachable(message: str) -> bool:
    """Whether an sbatch error means slurmctld did not answer (retry) rather than a refusal."""
    return bool(re.search(r"Unable to contact|timed out|Connection refused|Zero Bytes", message))
