"""`keel run`, `keel status`, `keel gc` and `keel quickstart`: running experiment files of steps."""

from __future__ import annotations

import json
import os
import sys
from importlib import resources
from pathlib import Path

import typer
from rich.table import Table

from keel.cli.output import fail, print_json, stderr, stdout, user_errors
from keel.cluster.backend import require_ray
from keel.cluster.steps import ClusterSteps
from keel.core import paths
from keel.core.errors import UsageError
from keel.core.experiment_id import EXPERIMENT_ENV
from keel.core.stop import install_handler as install_stop_handler
from keel.flow.runner import BACKEND_ENV
from keel.records.record import ExperimentRecord, find_record, records_root
from keel.records.runs import finish_invocation, start_invocation
from keel.steps import (
    RunReport,
    Step,
    StepStore,
    all_steps,
    load_experiment,
    output_path,
    override_steps,
    plan,
    run,
)
from keel.steps.executor import Execute
from keel.steps.experiment import load_experiment_file
from keel.steps.gc import UnusedOutput, remove_output, unused_outputs
from keel.steps.record import git_commit
from keel.steps.store import StepEntry
from keel.telemetry import TelemetryStore
from keel.telemetry.sink import TARGET_ENV

DEFAULT_PREFIX = "keel-out"
NOT_RUN = "NOT RUN"
"""`keel status EXPERIMENT.py`'s state of a step with no output and no attempt."""
FLOW_BACKENDS = ("local", "ray")

PREFIX = typer.Option(
    DEFAULT_PREFIX,
    "--prefix",
    envvar="KEEL_PREFIX",
    help="Where outputs go: a directory or an fsspec URL (s3://bucket/path).",
)
FORCE = typer.Option(None, "--force", help="Re-run steps whose name matches this regex.")
MAX_PARALLEL = typer.Option(
    1, "--max-parallel", min=1, help="Run up to N independent steps at once."
)
DRY_RUN = typer.Option(False, "--dry-run", help="Print the plan (cached / to run); run nothing.")
JSON = typer.Option(False, "--json", help="Print one JSON object on stdout instead of a table.")
BACKEND = typer.Option(
    None,
    "--backend",
    help="keel/flow backend for the steps' data work: local (processes) or ray "
    "(sets $KEEL_FLOW_BACKEND; a cluster address comes from $KEEL_RAY_ADDRESS).",
)
SET = typer.Option(
    [], "--set", help="Override a step's config: STEP.key=value (repeatable), type-checked."
)
EXPERIMENT = typer.Option(
    None,
    "--experiment",
    metavar="ID",
    help="Run for this experiment record (`keel experiment new`; default: the file's "
    "EXPERIMENT): the run joins the record's runs and its steps carry the id.",
)


def register(app: typer.Typer) -> None:
    app.command("run")(run_command)
    app.command("status")(status_command)
    app.command("gc")(gc_command)
    app.command("quickstart")(quickstart_command)


@user_errors
def run_command(
    experiment: Path = typer.Argument(..., help="An experiment file: Python with STEPS = [...]."),
    prefix: str = PREFIX,
    dry_run: bool = DRY_RUN,
    force: str | None = FORCE,
    max_parallel: int = MAX_PARALLEL,
    backend: str | None = BACKEND,
    overrides: list[str] = SET,
    as_json: bool = JSON,
    cluster: str | None = typer.Option(
        None, "--cluster", help="Run each step as a job on this cluster (see `keel job`)."
    ),
    cluster_root: str = typer.Option(
        "keel-out/cluster", "--cluster-root", help="The job controller's state directory."
    ),
    cluster_config: str | None = typer.Option(
        None, "--cluster-config", help="clusters.yaml, if a controller must be started."
    ),
    forward_env: list[str] = typer.Option(
        [],
        "--forward-env",
        help="With --cluster: also pass this variable to each step's job (repeatable). KEEL_* "
        "settings are passed already, except those named like a secret (*TOKEN*, *SECRET*, "
        "*KEY*, *PASSWORD*), which go only when named here.",
    ),
    experiment_id: str | None = EXPERIMENT,
) -> None:
    """Run the steps an experiment file declares; committed steps are reused, not re-run.

    Examples:
      keel run experiments/my_exp.py --prefix /data/keel --max-parallel 4 --set train.lr=3e-4
      keel run experiments/my_exp.py --cluster local --max-parallel 2
      keel run experiments/my_exp.py --cluster gpu --forward-env KEEL_TELEMETRY_TOKEN
      keel run experiments/my_exp.py --experiment 20261202-01
    """
    _use_backend(backend)
    record = _experiment_record(experiment_id)  # an unknown id fails before the file loads
    loaded, declared = load_experiment_file(experiment)
    record = record or _experiment_record(declared)
    steps = override_steps(loaded, overrides)
    execute = None
    if cluster is not None:
        execute = ClusterSteps(
            experiment,
            prefix,
            overrides,
            cluster=cluster,
            root=Path(cluster_root),
            config=cluster_config,
            forward=forward_env,
        )
    _run_steps(
        steps,
        prefix,
        dry_run,
        force,
        max_parallel,
        as_json,
        experiment.parent,
        execute,
        _Invocation(record, str(experiment)) if record else None,
    )


@user_errors
def quickstart_command(
    prefix: str = PREFIX,
    dry_run: bool = DRY_RUN,
    force: str | None = FORCE,
    max_parallel: int = typer.Option(2, "--max-parallel", min=1, help="Steps run at once."),
    backend: str | None = BACKEND,
    overrides: list[str] = SET,
    as_json: bool = JSON,
    experiment_id: str | None = EXPERIMENT,
) -> None:
    """Run the main job end to end on the bundled sample (keel/experiments/quickstart.py).

    Examples:
      keel quickstart --prefix /tmp/keel-demo
      keel quickstart --experiment 20261202-01 --set train.optimizer.name=muon
    """
    _use_backend(backend)
    record = _experiment_record(experiment_id)
    telemetry = _report_to_telemetry(prefix, dry_run)
    source = resources.files("keel.experiments") / "quickstart.py"
    with resources.as_file(source) as experiment:
        steps = override_steps(load_experiment(experiment), overrides)
        invocation = _Invocation(record, "keel quickstart") if record else None
        report = _run_steps(
            steps,
            prefix,
            dry_run,
            force,
            max_parallel,
            as_json,
            experiment.parent,
            None,
            invocation,
        )
    if report is not None and not as_json:
        _show_quickstart_summary(prefix, steps, telemetry)


@user_errors
def status_command(
    experiment: Path | None = typer.Argument(
        None, help="Show only this experiment file's steps (with NOT RUN for those never run)."
    ),
    prefix: str = PREFIX,
    overrides: list[str] = SET,
    as_json: bool = JSON,
) -> None:
    """List the steps under a prefix (or one experiment's steps): state, age and output path.

    Examples:
      keel status --prefix keel-out --json
      keel status experiments/my_exp.py --set train.lr=3e-4
    """
    store = StepStore(prefix)
    entries: list[StepEntry | Step] = list(store.entries())
    if experiment is not None:
        by_dir = {entry.dir_name: entry for entry in entries if isinstance(entry, StepEntry)}
        steps = all_steps(override_steps(load_experiment(experiment), overrides))
        entries = [by_dir.get(step.dir_name, step) for step in steps]  # a Step: never run here
    elif overrides:
        raise UsageError("--set needs an experiment file: keel status EXPERIMENT.py --set ...")
    if as_json:
        rows = [_status_row(entry, store) for entry in entries]
        print_json({"prefix": paths.normalize(prefix), "steps": rows})
        return
    if not entries:
        stderr.print(f"no steps under {paths.normalize(prefix)}")
        return
    table = Table("step", "state", "age", "output")
    colors = {"SUCCESS": "green", "FAILED": "red", "RUNNING": "yellow", "INTERRUPTED": "magenta"}
    for entry in entries:
        if isinstance(entry, Step):
            table.add_row(entry.dir_name, f"[dim]{NOT_RUN}[/]", "-", "-")
            continue
        state = f"[{colors.get(entry.state, 'white')}]{entry.state}[/]"
        table.add_row(
            entry.dir_name,
            state,
            _age(entry.record.age_seconds()),
            store.output_dir(entry.dir_name),
        )
    stdout.print(table)


def _status_row(entry: StepEntry | Step, store: StepStore) -> dict:
    """One step of `keel status --json`; a Step stands for one never run under the prefix."""
    if isinstance(entry, Step):
        return {
            "name": entry.name,
            "hash": entry.identity[:8],
            "state": NOT_RUN,
            "age_seconds": None,
            "output": store.output(entry),
            "error": None,
        }
    return {
        "name": entry.record.name,
        "hash": entry.record.identity[:8],
        "state": entry.state,
        "age_seconds": round(entry.record.age_seconds(), 3),
        "output": store.output_dir(entry.dir_name),
        "error": entry.record.error,
    }


@user_errors
def gc_command(
    keep: list[Path] = typer.Option(
        [], "--keep", help="An experiment file whose steps' outputs stay (repeatable)."
    ),
    more: list[Path] = typer.Argument(
        None, metavar="EXPERIMENT.py", help="More experiment files to keep, as --keep."
    ),
    prefix: str = PREFIX,
    yes: bool = typer.Option(False, "--yes", help="Remove the listed outputs (default: list)."),
    as_json: bool = JSON,
) -> None:
    """List (with --yes remove) the step outputs under a prefix that no kept experiment uses.

    Only committed step outputs (`NAME-HASH8/` with its step record) are ever listed or removed;
    anything else under the prefix is left alone. Without --yes nothing is removed.

    Examples:
      keel gc --keep experiments/main.py --keep experiments/ablation.py
      keel gc --keep experiments/main.py --prefix /data/keel --yes
    """
    experiments = [*keep, *(more or [])]
    if not experiments:
        raise UsageError(
            "name the experiments whose outputs to keep: keel gc --keep EXPERIMENT.py ..."
        )
    kept = {step.dir_name for file in experiments for step in all_steps(load_experiment(file))}
    store = StepStore(prefix)
    unused = unused_outputs(store, kept)
    if yes:
        for output in unused:
            remove_output(store, output)
    if as_json:
        print_json(
            {
                "prefix": store.prefix,
                "removed": yes,
                "outputs": [
                    {"name": u.record.name, "output": u.output, "bytes": u.bytes} for u in unused
                ],
            }
        )
        return
    _show_unused(unused, store.prefix, yes)


def _show_unused(unused: list[UnusedOutput], prefix: str, removed: bool) -> None:
    total = sum(output.bytes for output in unused)
    if not unused:
        stderr.print(f"nothing to remove: every step output under {prefix} is kept")
        return
    table = Table("step output", "age", "size", title="removed" if removed else "unused (dry run)")
    for output in unused:
        table.add_row(output.output, _age(output.record.age_seconds()), _size(output.bytes))
    stdout.print(table)
    if removed:
        stderr.print(f"removed {len(unused)} step outputs ({_size(total)})")
    else:
        stderr.print(
            f"{len(unused)} step outputs ({_size(total)}) are used by no kept experiment; "
            "nothing removed: add --yes to remove them"
        )


def _use_backend(backend: str | None) -> None:
    """Make `backend` the default flow backend of this process's steps."""
    if backend is None:
        return
    if backend not in FLOW_BACKENDS:
        raise UsageError(f"--backend {backend!r}: use one of {', '.join(FLOW_BACKENDS)}")
    if backend == "ray":
        require_ray("--backend ray")
        from keel.flow.backends.ray import keep_ray_until_exit

        keep_ray_until_exit()  # one Ray for all the steps, started by the first that runs
    os.environ[BACKEND_ENV] = backend


class _Invocation:
    """A run made for an experiment record: KEEL_EXPERIMENT set for the steps (and the jobs and
    training runs they start), the run's `started` and `finished` lines in its runs.jsonl."""

    def __init__(self, record: ExperimentRecord, experiment_file: str) -> None:
        self.record = record
        self.experiment_file = experiment_file

    def run(
        self, steps: list[Step], prefix: str, commit: str | None, **options: object
    ) -> RunReport:
        os.environ[EXPERIMENT_ENV] = self.record.id
        command = ["keel", *sys.argv[1:]]
        started = start_invocation(
            self.record, self.experiment_file, _absolute(prefix), command, commit
        )
        report = None
        try:
            report = run(steps, prefix, git_commit=commit, experiment=self.record.id, **options)
        finally:  # a run ended by an exception (Ctrl-C) is recorded as stopped
            finish_invocation(self.record, started, steps, report)
        return report


def _experiment_record(experiment_id: str | None) -> ExperimentRecord | None:
    """The record `--experiment` (or the file's EXPERIMENT) names; UsageError if unknown."""
    return None if experiment_id is None else find_record(records_root(), experiment_id)


def _absolute(prefix: str) -> str:
    """`prefix` as a path a record can find again from anywhere (URLs unchanged)."""
    if paths.is_local(prefix):
        return str(paths.local_path(prefix).resolve())
    return paths.normalize(prefix)


def _run_steps(
    steps: list[Step],
    prefix: str,
    dry_run: bool,
    force: str | None,
    max_parallel: int,
    as_json: bool,
    experiment_dir: Path,
    execute: Execute | None = None,
    invocation: _Invocation | None = None,
) -> RunReport | None:
    all_steps(steps)  # computes every identity now: an unhashable config fails before any work
    if dry_run:
        _show_plan(steps, prefix, force, as_json)
        return None
    install_stop_handler()  # SIGTERM: a training step checkpoints and stops (keel.core.stop)
    options = {"force": force, "max_parallel": max_parallel, "execute": execute}
    commit = git_commit(experiment_dir)
    if invocation is not None:
        report = invocation.run(steps, prefix, commit, **options)
    else:
        report = run(steps, prefix, git_commit=commit, **options)
    if as_json:
        print_json(report.summary())
    else:
        _show_report(report)
    if not report.ok:
        raise _failure(report, prefix)
    return report


def _show_plan(steps: list[Step], prefix: str, force: str | None, as_json: bool) -> None:
    planned = plan(steps, prefix, force)
    if as_json:
        print_json(
            {
                "dry_run": True,
                "executed": [],
                "cached": [p.step.name for p in planned if p.action == "cached"],
                "failed": [],
                "to_run": [p.step.name for p in planned if p.action == "run"],
                "why": {p.step.name: p.reason for p in planned if p.action == "run"},
                "changes": {p.step.name: p.diff.to_dict() for p in planned if p.diff},
            }
        )
        return
    table = Table("step", "plan", "why", "output", title="plan (dry run: nothing runs)")
    for item in planned:
        color = "green" if item.action == "cached" else "yellow"
        table.add_row(item.step.name, f"[{color}]{item.action}[/]", item.reason, item.output)
    stdout.print(table)


def _show_report(report: RunReport) -> None:
    table = Table("step", "outcome", "output")
    colors = {"executed": "cyan", "cached": "green", "failed": "red"}
    for outcome in ("executed", "cached", "failed"):
        for name in getattr(report, outcome):
            table.add_row(name, f"[{colors[outcome]}]{outcome}[/]", report.outputs[name])
    stdout.print(table)


def _failure(report: RunReport, prefix: str) -> typer.Exit:
    store = StepStore(prefix)
    root_causes = {k: v for k, v in report.errors.items() if not v.startswith("not run:")}
    skipped = len(report.errors) - len(root_causes)
    lines = [
        f"step {dir_name} failed: {error} (traceback: "
        f"{paths.join(store.control(dir_name), 'attempt.json')})"
        for dir_name, error in root_causes.items()
    ]
    if skipped:
        lines[-1] += f"; {skipped} downstream step{'s' * (skipped > 1)} not run"
    for line in lines[:-1]:
        fail(line, 1)
    return fail(lines[-1], 1)


def _report_to_telemetry(prefix: str, dry_run: bool) -> str | None:
    """Training metrics and flow counters go to `<prefix>/telemetry` unless $KEEL_TELEMETRY says
    elsewhere; returns the store directory to point the user at (None when not local)."""
    if dry_run:
        return None
    target = os.environ.get(TARGET_ENV)
    if target is None and paths.is_local(prefix):
        target = str(paths.local_path(paths.join(prefix, "telemetry")).resolve())
        os.environ[TARGET_ENV] = target
    return target if target and "://" not in target else None


def _show_quickstart_summary(prefix: str, steps: list[Step], telemetry: str | None) -> None:
    """The quickstart's drop accounting, stage by stage, and its token cache."""
    summary_step = next(step for step in all_steps(steps) if step.name == "summary")
    summary_file = paths.join(output_path(paths.normalize(prefix), summary_step), "summary.json")
    summary = json.loads(paths.read_text(summary_file))
    table = Table("step", "documents in", "out", "dropped (reason: count)", title="quickstart")
    for stage in summary["stages"]:
        reasons = ", ".join(f"{k}: {v}" for k, v in stage["dropped"].items() if v) or "-"
        table.add_row(
            stage["step"], f"{stage['documents_in']:,}", f"{stage['documents_out']:,}", reasons
        )
    stdout.print(table)
    stdout.print(
        f"token cache: {summary['tokens']:,} tokens, {summary['documents']:,} documents, "
        f"vocabulary {summary['vocab_size']:,} -> {summary['cache']}\n"
        f"{_trained_line(summary)}\n"
        f"{_telemetry_line(telemetry, summary['train']['output'])}"
        f"summary: {summary_file}\n"
        f"next: `keel status --prefix {prefix}`; run again and every step is cached; "
        "train on your own text: `keel train --preset cpu-speedrun --data FILE.txt "
        "--eval-data VAL.txt`."
    )


def _trained_line(summary: dict) -> str:
    train = summary["train"]
    return (
        f"trained tiny-moe for {train['step']} steps: loss {train['loss']:.2f} nats "
        f"(unigram entropy {summary['unigram_entropy']:.2f}), held-out "
        f"{train['eval_loss']:.2f} nats = {train['eval_bpb']:.3f} bits/byte -> {train['output']}"
    )


def _telemetry_line(telemetry: str | None, run: str) -> str:
    """How many metric rows the run left in the telemetry store, and the query that shows them."""
    if telemetry is None or not os.path.isdir(telemetry):
        return ""
    query = (
        'SELECT step, value AS loss FROM \\"train.metrics\\" '
        f"WHERE run = '{run}' AND name = 'loss' ORDER BY step DESC LIMIT 5"
    )
    rows = TelemetryStore(telemetry).query(
        f"SELECT count(*) AS n FROM \"train.metrics\" WHERE run = '{run}'"
    )
    return (
        f"telemetry: {rows.column('n')[0].as_py():,} metric rows of this run in {telemetry}: "
        f'keel logs query --root {telemetry} "{query}"\n'
    )


def _size(size: int) -> str:
    """Bytes as B, KiB, MiB, GiB or TiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"
