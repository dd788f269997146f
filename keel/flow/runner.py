"""The coordinator: runs a plan's stages one after another on a backend and gathers counters.

Stage k's tasks are its source shards (first stage) or the partitions of stage k-1's shuffle. A
stage starts when the previous one has finished, and its tasks go to whichever worker is free.
File outputs are renamed, in task order, to `part-00000-of-00008.parquet` style names in a staging
directory that is then committed atomically (core.commit.staged_output), with a `_SUCCESS` marker.
The output path is checked before the first stage runs (never an input, never a directory of
someone else's files), and the staging directory is removed when the run fails.

Shuffle files go to a work directory, `keel-flow-{pid}-{start}-*` in the system's temporary
directory unless RunOptions.work_dir names one; each run removes those whose process is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from keel.core import paths
from keel.core.commit import staged_output
from keel.core.owned import owner_tag, remove_abandoned
from keel.core.progress import QUIET, STAGES, ProgressDisplay, ProgressStyle
from keel.flow import memory, sources
from keel.flow.backends import Backend, make_backend
from keel.flow.ops import GroupBy, Repartition, WideOp
from keel.flow.plan import StagePlan
from keel.flow.readers import SkipLog
from keel.flow.shuffle import Segment, concat_batches, read_segments
from keel.flow.sources import FileSource, Source
from keel.flow.tasks import (
    CollectOutput,
    FileOutput,
    Output,
    Settings,
    ShuffleInput,
    ShuffleOutput,
    SourceInput,
    Task,
    TaskResult,
    stage_dir,
)
from keel.telemetry import sink

logger = logging.getLogger(__name__)

SUCCESS_MARKER = sources.SUCCESS_MARKER
OUTPUT_KIND = "keel/flow output"
WORK_DIR_PREFIX = "keel-flow-"
BACKEND_ENV = "KEEL_FLOW_BACKEND"
RAY_ADDRESS_ENV = "KEEL_RAY_ADDRESS"


@dataclass
class StageCounters:
    """What one stage did: tasks, rows in and out, bytes spilled to its shuffle, retries."""

    stage: int
    name: str
    tasks: int
    rows_in: int = 0
    rows_out: int = 0
    bytes_spilled: int = 0
    retries: int = 0
    peak_worker_rss: int = 0
    """The largest peak resident memory (bytes) of a worker that ran a task of this stage, since
    that worker started (workers are reused, so it includes earlier stages of the same pool)."""
    seconds: float = 0.0
    """Wall-clock time of the stage."""


@dataclass
class FlowResult:
    """The outcome of a run: output files (in order), per-stage counters, skipped records."""

    files: list[str] = field(default_factory=list)
    stages: list[StageCounters] = field(default_factory=list)
    skipped: SkipLog = field(default_factory=lambda: SkipLog({}, []))
    rows: int = 0
    table: pa.Table | None = None
    aside: pa.Table | None = None
    """The rows set aside by a FileOutput with `aside` columns, in input order; None when none."""

    @property
    def retries(self) -> int:
        return sum(stage.retries for stage in self.stages)


@dataclass(frozen=True)
class RunOptions:
    """How to run: backend and its workers, retries per task, memory settings, progress bar."""

    backend: str | Backend = field(default_factory=lambda: os.environ.get(BACKEND_ENV, "local"))
    """"local", "ray", or a Backend object to reuse; default from $KEEL_FLOW_BACKEND."""
    workers: int | None = None
    retries: int = 2
    settings: Settings = field(default_factory=Settings)
    progress: bool | ProgressStyle | None = None
    """None: a bar when stderr is a terminal, else a line every 30 s of a long stage (done/total
    tasks, elapsed, ETA); True: the bar; False: nothing; or a ProgressStyle."""
    work_dir: str | None = None
    """Where shuffle files go (default: a temporary directory, removed after the run)."""
    ray_address: str | None = field(default_factory=lambda: os.environ.get(RAY_ADDRESS_ENV))
    telemetry: str | None = field(default_factory=lambda: os.environ.get(sink.TARGET_ENV))
    """A telemetry store directory or server URL: each stage's counters become a row of its
    flow.stage namespace. Default from $KEEL_TELEMETRY; None: not reported."""


AsideHandler = Callable[[pa.Table], None]
"""Takes one task's set-aside rows (FileOutput.aside) on the coordinator, tasks in input order."""


def execute(
    source: Source,
    stages: Sequence[StagePlan],
    output: Output,
    options: RunOptions,
    on_aside: AsideHandler | None = None,
) -> FlowResult:
    """Run `stages` over `source` into `output`. A file output that commits itself is staged
    (and its path checked) before the first stage starts. `on_aside`: each task's set-aside rows
    go to it as soon as the tasks before it are done, instead of into FlowResult.aside."""
    memory.use_in_this_process()
    if not isinstance(output, FileOutput) or not output.commit:
        return _execute(source, stages, output, options, on_aside)
    inputs = source.files if isinstance(source, FileSource) else ()
    with staged_output(
        output.destination, marker=SUCCESS_MARKER, kind=OUTPUT_KIND, inputs=inputs
    ) as staging:
        staged = dataclasses.replace(output, destination=staging)
        result = _execute(source, stages, staged, options, on_aside)
        paths.write_text(paths.join(staging, SUCCESS_MARKER), "")
    final = paths.normalize(output.destination)
    result.files = [paths.join(final, _name(path)) for path in result.files]
    return result


def _execute(
    source: Source,
    stages: Sequence[StagePlan],
    output: Output,
    options: RunOptions,
    on_aside: AsideHandler | None,
) -> FlowResult:
    owned = isinstance(options.backend, str)
    backend = (
        make_backend(options.backend, options.workers, options.ray_address)
        if isinstance(options.backend, str)
        else options.backend
    )
    work_dir = options.work_dir or _new_work_dir()
    run_dir = paths.join(work_dir, f"run-{uuid.uuid4().hex[:12]}")
    result = FlowResult()
    try:
        with ProgressDisplay(_progress_style(options.progress)) as progress:
            inputs: list[SourceInput | ShuffleInput] = [
                SourceInput(source, shard) for shard in range(source.num_shards)
            ]
            for stage in stages:
                stage_output = output if stage.shuffle is None else _shuffle_output(stage.shuffle)
                tasks = [
                    Task(
                        stage.index,
                        index,
                        stage.name,
                        task_input,
                        stage.ops,
                        stage.shard_op,
                        stage.after,
                        stage_output,
                        options.settings,
                        run_dir,
                    )
                    for index, task_input in enumerate(inputs)
                ]
                handed = on_aside if stage.shuffle is None else None
                counters, results = _run_stage(
                    backend, stage, tasks, options.retries, progress, handed
                )
                result.stages.append(counters)
                if options.telemetry:
                    sink.write_record(
                        options.telemetry,
                        sink.FLOW_NAMESPACE,
                        {"run": os.path.basename(run_dir), **dataclasses.asdict(counters)},
                    )
                for task_result in results:
                    result.skipped.merge(task_result.skipped)
                if stage.reduce is not None:  # its input, the previous shuffle, is spent
                    paths.remove_tree(stage_dir(run_dir, stage.index - 1))
                if stage.shuffle is not None:
                    inputs = _partitions(results, stage.shuffle)
                else:
                    result.rows = counters.rows_out
                    _finish(output, results, result, handed_aside=on_aside is not None)
    finally:
        if owned:
            backend.close()
        if options.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            paths.remove_tree(run_dir)
    return result


@contextlib.contextmanager
def pooled(options: RunOptions | None = None) -> Iterator[RunOptions]:
    """`options` with its backend started once, for a job of several runs (a stage with more
    than one pass): worker processes start once instead of once per run. A backend object the
    caller passed is used as it is and left open."""
    options = options or RunOptions()
    if not isinstance(options.backend, str):
        yield options
        return
    backend = make_backend(options.backend, options.workers, options.ray_address)
    try:
        yield dataclasses.replace(options, backend=backend)
    finally:
        backend.close()


def place_parts(files: Sequence[str], directory: str) -> list[str]:
    """Move `files` into `directory` (a staging directory) as part-NNNNN-of-NNNNN.ext, in order;
    returns their new paths."""
    placed: list[str] = []
    for number, source in enumerate(files):
        extension = source.rsplit(".", 1)[-1]
        target = paths.join(directory, f"part-{number:05d}-of-{len(files):05d}.{extension}")
        paths.move_file(source, target)
        placed.append(target)
    return placed


def _name(path: str) -> str:
    """The file name of a local path or URL."""
    return path.rsplit("/", 1)[-1]


def _new_work_dir() -> str:
    """A fresh work directory in the system's temporary directory, named for this process;
    those of processes that are gone (killed runs) are removed first."""
    temporary = tempfile.gettempdir()
    remove_abandoned(temporary, WORK_DIR_PREFIX)
    return tempfile.mkdtemp(prefix=f"{WORK_DIR_PREFIX}{owner_tag()}-", dir=temporary)


def _shuffle_output(op: WideOp) -> ShuffleOutput:
    if isinstance(op, Repartition):
        return ShuffleOutput(None, op.num_shards)
    combiner = op.combiner if isinstance(op, GroupBy) else None
    return ShuffleOutput(op.key, op.num_shards, combiner)


def _partitions(results: list[TaskResult], op: WideOp) -> list:
    return [
        ShuffleInput(
            tuple(segment for r in results for segment in r.partitions.get(partition, [])),
            op,
            partition,
        )
        for partition in range(op.num_shards)
    ]


def _run_stage(
    backend, stage, tasks, retries, progress: ProgressDisplay, on_aside: AsideHandler | None
):
    counters = StageCounters(stage.index, stage.name, len(tasks))
    shown = progress.task(f"stage {stage.index}: {stage.name}", len(tasks), unit="tasks")
    in_order = _InOrder(on_aside) if on_aside is not None else None

    def done(task: Task, task_result: TaskResult, attempts: int) -> None:
        if in_order is not None:
            in_order.finished(task.index, task_result)
        counters.rows_in += task_result.rows_in
        counters.rows_out += task_result.rows_out
        counters.bytes_spilled += task_result.bytes_spilled
        counters.retries += attempts - 1
        counters.peak_worker_rss = max(counters.peak_worker_rss, task_result.peak_rss)
        shown.update(shown.done + 1, rows=f"{counters.rows_out:,} rows out")

    began = time.monotonic()
    results = backend.run(tasks, retries=retries, on_done=done) if tasks else []
    counters.seconds = time.monotonic() - began
    shown.finish()
    logger.debug(  # engine detail: commands print their own report; `keel -v` shows these
        "stage %d (%s): %d tasks, %d rows in, %d out, %d bytes spilled, %d retries",
        stage.index,
        stage.name,
        len(tasks),
        counters.rows_in,
        counters.rows_out,
        counters.bytes_spilled,
        counters.retries,
    )
    return counters, results


class _InOrder:
    """Hands each task's set-aside rows to `on_aside` in task order, as soon as every earlier
    task is done (tasks finish in any order)."""

    def __init__(self, on_aside: AsideHandler) -> None:
        self.on_aside = on_aside
        self.waiting: dict[int, TaskResult] = {}
        self.next = 0

    def finished(self, index: int, task_result: TaskResult) -> None:
        self.waiting[index] = task_result
        while self.next in self.waiting:
            table = _aside_table(self.waiting.pop(self.next))
            self.next += 1
            if table is not None:
                self.on_aside(table)


def _aside_table(*results: TaskResult) -> pa.Table | None:
    """The rows `results` set aside, in order; None when none."""
    segments = [Segment(path, 0, 0) for r in results for path in r.aside]
    batches = list(read_segments(segments))
    return concat_batches(batches) if batches else None


def _finish(
    output: Output, results: list[TaskResult], result: FlowResult, handed_aside: bool
) -> None:
    if isinstance(output, FileOutput):
        files = [path for task_result in results for path in task_result.files]
        paths.make_dirs(output.destination)
        result.files = place_parts(files, output.destination)
        if output.aside and not handed_aside:
            result.aside = _aside_table(*results)
    elif isinstance(output, CollectOutput):
        segments = [Segment(path, 0, 0) for task_result in results for path in task_result.files]
        table = concat_batches(list(read_segments(segments)))
        if output.limit is not None and output.limit < table.num_rows:
            table = table.slice(0, output.limit)  # (a table of no columns slices to `limit` rows)
        result.table = table


def _progress_style(progress: bool | ProgressStyle | None) -> ProgressStyle:
    if isinstance(progress, ProgressStyle):
        return progress
    if progress is None:
        return STAGES
    return ProgressStyle(mode="bar") if progress else QUIET
