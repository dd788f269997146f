"""The Ray backend: each task is a Ray job, submitted through the Jobs API of a Ray cluster.

The handle is the job's submission id, `keel-<task_id>-<attempt>`, so a restarted controller finds
its tasks again and a repeated launch of the same attempt adopts the job it started before. The
backend talks only HTTP to the cluster's dashboard (`address`, e.g. http://head:8265); it never
joins the cluster with `ray.init`.

- launch: `submit_job` with the argv as a shell entrypoint (after `cd WORKDIR &&` when a workdir
  is given: the directory must exist on the node that runs the driver, nothing is uploaded), the
  env as `runtime_env.env_vars`, cpus as `entrypoint_num_cpus`, memory as `entrypoint_memory`.
  Device type "gpu" asks `entrypoint_num_gpus`; an accelerator model a node advertises
  ("h100" for `accelerator_type:H100`) asks that node's GPUs (or TPUs, ...) on such a node; any
  other type is a custom resource of that name, matched case-insensitively ("tpu" -> "TPU").
- poll: one `GET /api/jobs/<id>` per handle. A job that failed because its supervisor died (its
  node went away) is LOST, not FAILED; a job stopped through Ray is CANCELLED.
- cancel: `stop_job`. Ray queues the stop of a job still waiting for resources until it is
  scheduled; a cancelled job that then ends in any failure reads CANCELLED.
- logs: Ray keeps stdout and stderr of a job as one stream. `log_files` (and `poll`, once, when a
  job ends) copies it to `log_root/<handle>/stdout`; the stderr path never exists.
- capacity: the dashboard's `/api/cluster_status` (what the autoscaler monitor last wrote, a few
  seconds old: used and total per node, every workload counted). Where it holds nothing
  (autoscaler v2, a cluster just started) it falls back to the state API's node totals
  (`/api/v0/nodes`) minus what running keel jobs reserve (recorded in their metadata).
- auth: the token given as `token=`; else, once a cluster asks for one, the token Ray's own
  clients use ($RAY_AUTH_TOKEN, else the file at $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any

from keel.cluster.backend import Capacity, TaskLaunch, TaskState, TaskStatus
from keel.cluster.secrets import private_dir
from keel.core.errors import KeelError, UsageError


class RayUnreachableError(KeelError):
    """The Ray dashboard did not answer (after retries): the engine is down or unreachable, its
    tasks are not known to be lost; the controller skips the cluster for the tick."""


log = logging.getLogger(__name__)

HTTP_TIMEOUT_SECONDS = 10.0
RETRY_DELAYS_SECONDS = (0.5, 1.5)  # between attempts of a request that could not connect
ACCELERATOR_PREFIX = "accelerator_type:"
ACCELERATOR_FRACTION = 0.001  # how Ray asks for "a node of this GPU model"
RESERVES = "keel_reserves"  # job metadata: what the task holds, in keel's device names
ACCELERATOR_RESOURCES = ("GPU", "TPU", "neuron_cores", "HPU", "NPU")  # what Ray counts them in
NOT_DEVICES = ("memory", "object_store_memory")
SUPERVISOR_GONE = {"JOB_SUPERVISOR_ACTOR_DIED", "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE"}
SAFE_HANDLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
STATES = {name: TaskState[name] for name in ("PENDING", "RUNNING", "SUCCEEDED", "FAILED")}
STATES["STOPPED"] = TaskState.CANCELLED


class RayBackend:
    """Runs tasks as Ray jobs on the cluster whose dashboard is at `address` (module docstring)."""

    name = "ray"

    def __init__(
        self,
        address: str,
        log_root: str | os.PathLike[str],
        *,
        region: str = "",
        token: str | None = None,
    ) -> None:
        self.address = address if "://" in address else f"http://{address}"
        self.log_root = Path(log_root)
        self.region = region
        self._token = token
        self._client: Any = None  # a JobSubmissionClient, made on first use
        self._catalog: dict[str, tuple[str, str]] = {}  # device type -> Ray's names, last seen

    # --- the TaskBackend protocol ----------------------------------------------------------

    def launch(self, task: TaskLaunch) -> str:
        handle = f"keel-{task.task_id}-{task.attempt}"
        _check_handle(handle)
        entrypoint = shlex.join(task.command)
        if task.workdir:
            entrypoint = f"cd {shlex.quote(task.workdir)} && {entrypoint}"
        env = {**task.env, "KEEL_TASK_ID": task.task_id, "KEEL_ATTEMPT": str(task.attempt)}
        asks: dict[str, Any] = {"entrypoint_num_cpus": task.cpus}
        reserves = {"cpu": task.cpus}  # in keel's names, for capacity's fallback
        if task.memory_mb:
            asks["entrypoint_memory"] = task.memory_mb * 1024 * 1024
        if task.device_type != "cpu" and task.device_count:
            devices, generic = self._device_asks(task.device_type, task.device_count)
            asks.update(devices)
            reserves[task.device_type] = float(task.device_count)
            if generic:
                reserves[generic] = float(task.device_count)
        metadata = {
            "keel_task_id": task.task_id,
            "keel_attempt": str(task.attempt),
            RESERVES: json.dumps(reserves, sort_keys=True),
        }
        try:
            self._call(
                "submit_job",
                entrypoint=entrypoint,
                submission_id=handle,
                runtime_env={"env_vars": {key: str(value) for key, value in env.items()}},
                metadata=metadata,
                **asks,
            )
        except OSError as error:
            raise RayUnreachableError(
                f"cannot reach ray at {self.address} ({_one_line(error)}): check the address "
                "and that the cluster is up"
            ) from None
        except RuntimeError as error:
            info = self._info(handle)
            if info is not None and info.entrypoint == entrypoint and info.metadata == metadata:
                return handle  # launched before (the controller died before recording it)
            raise UsageError(
                f"ray at {self.address} refused task {task.task_id}: {_one_line(error)}"
            ) from None
        return handle

    def poll(self, handles: list[str]) -> dict[str, TaskStatus]:
        return {handle: self._status(handle) for handle in handles}

    def cancel(self, handle: str) -> None:
        _check_handle(handle)
        info = self._info(handle)
        if info is None or str(info.status) not in ("PENDING", "RUNNING"):
            return
        directory = private_dir(self.log_root / handle)
        (directory / "cancelled").touch()  # survives a controller restart
        self._call("stop_job", handle)

    def log_files(self, handle: str) -> tuple[str, str]:
        _check_handle(handle)
        directory = self.log_root / handle
        if not (directory / "complete").exists():
            info = self._info(handle)
            if info is not None:
                self._save_logs(handle, finished=str(info.status) in _TERMINAL)
        return str(directory / "stdout"), str(directory / "stderr")

    def capacity(self) -> Capacity:
        try:
            nodes = self._usage_by_node()
            if nodes is None:
                total, used = self._totals_and_job_usage()
            else:
                total, used = _capacity_of(nodes), _capacity_of(nodes, used=True)
        except (OSError, RuntimeError) as error:
            raise RayUnreachableError(
                f"ray at {self.address} reported no capacity: {_one_line(error)}"
            ) from None
        free = {kind: max(0.0, amount - used.get(kind, 0.0)) for kind, amount in total.items()}
        return Capacity(total=total, free=free, region=self.region)

    def close(self) -> None:
        """Forget the HTTP client; the jobs keep running and a new backend finds them by handle."""
        self._client = None

    # --- status and logs --------------------------------------------------------------------

    def _status(self, handle: str) -> TaskStatus:
        try:
            info = self._info(handle)
        except OSError as error:  # the dashboard did not answer, even after retries
            raise RayUnreachableError(f"ray at {self.address} did not answer: {error}") from None
        if info is None:
            return TaskStatus(handle, TaskState.LOST, reason=f"ray at {self.address} has no job")
        status = str(info.status)
        state = STATES.get(status, TaskState.LOST)
        if state is TaskState.FAILED and str(info.error_type or "") in SUPERVISOR_GONE:
            state = TaskState.LOST
        if state in (TaskState.FAILED, TaskState.LOST) and self._cancelled(handle):
            state = TaskState.CANCELLED
        code = getattr(info, "driver_exit_code", None)
        if state is TaskState.SUCCEEDED:
            code = 0 if code is None else code
        reason = ""
        if state in (TaskState.FAILED, TaskState.LOST):
            reason = _job_message(info.message) or f"ray job status {status}"
        elif state is TaskState.CANCELLED:
            reason = "cancelled" if self._cancelled(handle) else "stopped through ray"
        if status in _TERMINAL and not (self.log_root / handle / "complete").exists():
            try:
                self._save_logs(handle, finished=True)
            except (OSError, RuntimeError) as error:  # log_files() tries again later
                log.warning("ray job %s: logs not saved (%s)", handle, _one_line(error))
        return TaskStatus(handle, state, code, reason)

    def _cancelled(self, handle: str) -> bool:
        return (self.log_root / handle / "cancelled").exists()

    def _info(self, handle: str) -> Any:
        """The job's JobDetails, or None when Ray does not know the handle."""
        try:
            return self._call("get_job_info", handle)
        except RuntimeError as error:
            if "status code 404" in str(error):
                return None
            raise

    def _save_logs(self, handle: str, *, finished: bool) -> None:
        """Copy the job's log to log_root/<handle>/stdout; mark it complete once the job ended."""
        _check_handle(handle)
        text = self._call("get_job_logs", handle)
        directory = private_dir(self.log_root / handle)
        partial = directory / "stdout.part"
        partial.write_text(text)
        partial.replace(directory / "stdout")
        if finished:
            (directory / "complete").touch()

    # --- resources ---------------------------------------------------------------------------

    def _device_asks(self, device_type: str, count: int) -> tuple[dict[str, Any], str]:
        """Ray's asks for `count` devices of `device_type`, and the generic kind they also take
        ("gpu" for an H100 ask, "tpu" for a TPU-V4 ask; "" for none)."""
        found = self._catalog.get(device_type)
        if found is None:
            self._load_catalog()  # a node may have joined since
            found = self._catalog.get(device_type, ("GPU" if device_type == "gpu" else "", ""))
        resource, label = found
        if resource == "GPU":
            asks: dict[str, Any] = {"entrypoint_num_gpus": count}
        else:
            asks = {"entrypoint_resources": {resource or device_type: float(count)}}
        if label:
            asks.setdefault("entrypoint_resources", {})[label] = ACCELERATOR_FRACTION
        return asks, (resource.lower() if label else "")

    def _load_catalog(self) -> None:
        try:
            if self._usage_by_node() is None:  # which sets the catalog when it has nodes
                self._catalog = _catalog(self._node_totals())
        except (OSError, RuntimeError) as error:
            log.warning("ray at %s: resources unknown (%s)", self.address, _one_line(error))

    def _usage_by_node(self) -> Nodes | None:
        """(used, total) per resource per node from the autoscaler's report; None if absent.

        The dashboard camel-cases dict keys (object_store_memory -> objectStoreMemory) but not
        keys inside lists, so Ray's own names are recovered from the `nodeTypes` list.
        """
        data = self._get("/api/cluster_status")
        report = ((data.get("clusterStatus") or {}).get("loadMetricsReport")) or {}
        by_node = report.get("usageByNode") or {}
        if not by_node:
            return None
        exact = {
            _camel(name): name
            for node_type, _count in report.get("nodeTypes") or []
            for name in node_type
        }
        nodes = [
            {exact.get(key, key): (float(u), float(t)) for key, (u, t) in usage.items()}
            for usage in by_node.values()
        ]
        self._catalog = _catalog(nodes)
        return nodes

    def _node_totals(self) -> Nodes:
        """Each live node's resources from the state API, as (0 used, total)."""
        rows = self._get("/api/v0/nodes?detail=1").get("result", {}).get("result", [])
        return [
            {name: (0.0, float(amount)) for name, amount in row["resources_total"].items()}
            for row in rows
            if row.get("state") == "ALIVE"
        ]

    def _totals_and_job_usage(self) -> tuple[dict[str, float], dict[str, float]]:
        """Fallback: node totals, and what running keel jobs reserve (in keel's names; jobs
        submitted by others are not counted: the Jobs API does not report their asks)."""
        nodes = self._node_totals()
        self._catalog = _catalog(nodes)
        used: dict[str, float] = {}
        for job in self._call("list_jobs"):
            if str(job.status) != "RUNNING":
                continue
            for kind, amount in json.loads((job.metadata or {}).get(RESERVES, "{}")).items():
                used[kind] = used.get(kind, 0.0) + float(amount)
        return _capacity_of(nodes), used

    # --- HTTP ----------------------------------------------------------------------------------

    def _get(self, path: str) -> dict[str, Any]:
        response = self._call("_do_request", "GET", path, timeout=HTTP_TIMEOUT_SECONDS)
        if response.status_code != 200:
            raise RuntimeError(f"GET {path} answered {response.status_code}")
        return response.json().get("data") or {}

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call the JobSubmissionClient, retrying requests that could not connect."""
        for delay in (*RETRY_DELAYS_SECONDS, None):
            try:
                return getattr(self._connect(), method)(*args, **kwargs)
            except OSError as error:  # requests' errors and Ray's ConnectionError are OSErrors
                if delay is None:
                    raise ConnectionError(f"{self.address}: {_one_line(error)}") from None
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _connect(self) -> Any:
        if self._client is not None:
            return self._client
        try:
            from ray.job_submission import JobSubmissionClient
        except ImportError as error:
            raise UsageError(
                f"the ray backend needs ray's job client ({error}): pip install 'ray[default]'"
            ) from None
        from ray import exceptions

        auth_error = getattr(exceptions, "AuthenticationError", ())
        if not self._token:
            try:
                self._client = JobSubmissionClient(self.address)
                return self._client
            except auth_error:
                self._token = _default_token()
            if not self._token:
                raise UsageError(
                    f"ray at {self.address} requires a token: set RAY_AUTH_TOKEN or "
                    "RAY_AUTH_TOKEN_PATH (see `ray get-auth-token`)"
                ) from None
        try:
            self._client = JobSubmissionClient(
                self.address, headers={"Authorization": f"Bearer {self._token}"}
            )
        except auth_error:
            raise UsageError(f"ray at {self.address} refused the token: check it") from None
        return self._client


_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


Nodes = list[dict[str, tuple[float, float]]]  # per node: Ray resource name -> (used, total)


def _capacity_of(nodes: Nodes, *, used: bool = False) -> dict[str, float]:
    """Keel's view of Ray resources: cpu, gpu, custom resources (lower case) and one entry per
    accelerator model a node advertises (accelerator_type:H100 -> "h100": that node's GPUs)."""
    result: dict[str, float] = {"cpu": 0.0}
    pick = 0 if used else 1
    for node in nodes:
        devices = _accelerator_resource(node)
        for name, amounts in node.items():
            if name.startswith(ACCELERATOR_PREFIX):
                kind = name[len(ACCELERATOR_PREFIX) :].lower()
                amount = node[devices][pick] if devices else 0.0
            else:
                kind, amount = _keel_name(name), amounts[pick]
            if kind:
                result[kind] = result.get(kind, 0.0) + amount
    return result


def _catalog(nodes: Nodes) -> dict[str, tuple[str, str]]:
    """keel device type -> (the Ray resource to ask, the accelerator label to ask or "")."""
    catalog: dict[str, tuple[str, str]] = {}
    for node in nodes:
        devices = _accelerator_resource(node)
        for name in node:
            if name.startswith(ACCELERATOR_PREFIX) and devices:
                catalog[name[len(ACCELERATOR_PREFIX) :].lower()] = (devices, name)
            elif _keel_name(name):
                catalog[_keel_name(name)] = (name, "")
    return catalog


def _accelerator_resource(node: dict[str, tuple[float, float]]) -> str:
    """The resource that counts a node's accelerators (GPU, TPU, ...); "" if it has none."""
    return next((name for name in ACCELERATOR_RESOURCES if node.get(name, (0, 0))[1] > 0), "")


def _keel_name(name: str) -> str:
    """cpu / gpu / a custom resource, lower case; "" for what is not a device (memory, nodes)."""
    if name in NOT_DEVICES or name.startswith(("node:", ACCELERATOR_PREFIX)):
        return ""
    return name.lower()


def _camel(name: str) -> str:
    """What the dashboard's to_camel_case makes of a key."""
    first, *rest = name.split("_")
    return first + "".join(part.title() for part in rest)


def _default_token() -> str:
    """The token Ray's clients use: $RAY_AUTH_TOKEN, else the file at $RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token ("" when there is none)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip() if path.is_file() else ""


def _job_message(message: str | None) -> str:
    """Ray's job message as one line, without the log tail it appends to failures."""
    lines = (message or "").strip().splitlines()
    return lines[0].split(", last available logs")[0].rstrip(":") if lines else ""


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _check_handle(handle: str) -> None:
    if not SAFE_HANDLE.fullmatch(handle):
        raise UsageError(
            f"ray task handle {handle!r} is not a plain name: task ids may hold letters, "
            "digits, '.', '_' and '-'"
        )
