"""`keel scaling sweep` and `keel scaling ladder`: isoFLOP sweeps run as cached steps, the tiny
ladder experiment (keel/experiments/ladder.py), and a run's loss curve checked against it."""

from __future__ import annotations

from dataclasses import asdict, replace
from importlib import resources

import typer
from rich.markup import escape
from rich.table import Table

from keel.cli.output import fail, print_json, stderr, stdout, user_errors
from keel.cli.scaling_commands import parse_budgets
from keel.cli.steps_commands import PREFIX
from keel.cli.train_commands import bundled_cache, load_train_config
from keel.core import paths
from keel.core.config import load_config
from keel.core.errors import KeelError, UsageError
from keel.core.stop import install_handler as install_stop_handler
from keel.scaling.ladder import LADDER_FILE, Comparison, compare_to_ladder, load_ladder
from keel.scaling.sweep import (
    RUNS_FILE,
    SweepConfig,
    SweepPoint,
    budget_tag,
    plan_sweep,
    sweep_steps,
)
from keel.steps import Step, all_steps, load_experiment, output_path, run
from keel.train.config import TrainConfig
from keel.train.presets import PRESETS
from keel.train.trainer import CONFIG_FILE

LADDER_EXPERIMENT = "ladder.py"
LADDER_STEP = "ladder"
"""The step of keel/experiments/ladder.py whose output is the ladder directory."""

MAX_PARALLEL = typer.Option(1, "--max-parallel", min=1, help="Train up to N runs at once.")
JSON = typer.Option(False, "--json", help="Print one JSON object on stdout instead of tables.")


def register(scaling_app: typer.Typer) -> None:
    """Add `sweep` and `ladder` to the `keel scaling` group."""
    scaling_app.command("sweep")(sweep_command)
    scaling_app.command("ladder")(ladder_command)


def _ints(text: str | None, option: str) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected whole numbers like 32,64,128") from None
    if any(value < 1 for value in values):
        raise UsageError(f"{option} {text!r}: values must be at least 1")
    return values


@user_errors
def sweep_command(
    config_file: str | None = typer.Argument(
        None, metavar="[CONFIG.yaml]", help="The base TrainConfig (one phase), YAML or JSON."
    ),
    preset_name: str | None = typer.Option(
        None, "--preset", help=f"Start from a named config: {', '.join(PRESETS)}."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a base config key: key=value (repeatable)."
    ),
    budgets: str = typer.Option(
        ..., "--budgets", help="Comma-separated compute budgets in FLOPs, e.g. 1e12,3e12,1e13."
    ),
    points: int = typer.Option(4, "--points", help="Sizes per budget (at least 3)."),
    widths: str | None = typer.Option(
        None,
        "--widths",
        help="d_model values of the family, e.g. 32,64,96 (default: ~√2 steps "
        "from a quarter to 4x the base's).",
    ),
    depths: str | None = typer.Option(
        None, "--depths", help="n_layers values of the family (default: base/2, base, 2x base)."
    ),
    tokens_per_param: float = typer.Option(
        20.0, "--tokens-per-param", help="Prior D/N at the optimum that centres each budget."
    ),
    spacing: float = typer.Option(2.0, "--spacing", help="Ratio between neighbouring sizes."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; train nothing."),
    prefix: str = PREFIX,
    max_parallel: int = MAX_PARALLEL,
    as_json: bool = JSON,
) -> None:
    """Plan an isoFLOP sweep (sizes bracketing each budget's optimum, D = C / FLOPs per token)
    and run it as cached steps; prints the plan and where runs.csv is.

    Examples:
      keel scaling sweep --preset tiny-dense --budgets 1e13,3e13,1e14 --dry-run
      keel scaling sweep run.yaml --budgets 1e12,3e12,1e13 --points 3 --widths 32,64,96,128
    """
    base, _ = load_train_config(config_file, preset_name, overrides)
    chosen = parse_budgets(budgets)
    config = SweepConfig(
        base=base,
        budgets=tuple(chosen or ()),
        widths=_ints(widths, "--widths"),
        depths=_ints(depths, "--depths"),
        points_per_budget=points,
        tokens_per_param=tokens_per_param,
        spacing=spacing,
    )
    planned = plan_sweep(config)
    if not as_json:
        _show_plan(planned, dry_run)  # before training, which can take a while
    runs_csv = None
    if not dry_run:
        if not base.data and not all(phase.mixture for phase in base.phases):
            config = replace(config, base=base.with_data((bundled_cache(prefix),)))
        steps = sweep_steps(config)
        _run(steps, prefix, max_parallel)
        runs_csv = paths.join(output_path(paths.normalize(prefix), steps[-1]), RUNS_FILE)
    if as_json:
        print_json({"plan": [_point_dict(point) for point in planned], "runs_csv": runs_csv})
    elif runs_csv is not None:
        stdout.print(
            f"runs: {runs_csv}\nnext: keel scaling fit {runs_csv} --budgets "
            f"{','.join(budget_tag(c) for c in sorted(config.budgets))}"
        )


def _point_dict(point: SweepPoint) -> dict:
    return {
        "budget": point.budget,
        "label": point.label,
        "params": point.params,
        "tokens": point.tokens,
        "steps": point.steps,
        "flops": point.flops,
        "peak_lr": point.config.phases[0].schedule.peak_lr,
    }


def _show_plan(planned: list[SweepPoint], dry_run: bool) -> None:
    title = "isoFLOP sweep" + (" (dry run: nothing trains)" if dry_run else "")
    table = Table("budget C (FLOPs)", "shape", "N (params)", "D (tokens)", "steps", "peak lr",
                  title=title)  # fmt: skip
    for point in planned:
        lr = point.config.phases[0].schedule.peak_lr
        table.add_row(f"{point.budget:.3g}", point.label, f"{point.params:,}",
                      f"{point.tokens:,}", f"{point.steps:,}", f"{lr:.3g}")  # fmt: skip
    stdout.print(table)


def _run(steps: list[Step], prefix: str, max_parallel: int) -> None:
    install_stop_handler()  # SIGTERM: a training step checkpoints and stops (keel.core.stop)
    report = run(steps, prefix, max_parallel=max_parallel)
    if not report.ok:
        first, error = next(iter(report.errors.items()))
        raise KeelError(
            f"step {first} failed: {error}; see `keel status --prefix {prefix}` "
            f"({len(report.failed)} failed)"
        )


@user_errors
def ladder_command(
    compare: str | None = typer.Option(
        None,
        "--compare",
        help="A run directory (config.yaml, metrics.jsonl) to check against the ladder.",
    ),
    ladder_dir: str | None = typer.Option(
        None,
        "--ladder",
        help="A ladder directory (ladder.json); default: the ladder "
        "experiment's output under --prefix.",
    ),
    tolerance: float = typer.Option(
        0.05,
        "--tolerance",
        help="Relative deviation above the prediction that fails the run (below it: better).",
    ),
    warmup: float = typer.Option(
        0.25, "--warmup", help="Fraction of the run's steps not checked (early training)."
    ),
    prefix: str = PREFIX,
    max_parallel: int = MAX_PARALLEL,
    as_json: bool = JSON,
) -> None:
    """Build the tiny scaling ladder (keel/experiments/ladder.py: 3 budgets x 3 sizes of a tiny
    dense model on the bundled sample, minutes on a CPU) and print its fit and plots; with
    --compare, check a run's loss curve against it: exit code 1 when the run is worse than the
    prediction by more than --tolerance, 0 when within it or better (a warning when the run's
    model is not of the ladder's family: dense or MoE, depth, vocabulary).

    Examples:
      keel scaling ladder --prefix keel-out --max-parallel 2
      keel scaling ladder --compare keel-out/train-tiny-dense --tolerance 0.05
    """
    if compare is not None:
        _compare(compare, ladder_dir or _ladder_output(prefix), tolerance, warmup, as_json)
        return
    if ladder_dir is not None:
        raise UsageError("--ladder names a ladder to --compare against; add --compare RUN_DIR")
    steps = _ladder_steps()
    _run(steps, prefix, max_parallel)
    directory = _ladder_output(prefix)
    ladder = load_ladder(directory)
    plots = [paths.join(directory, name) for name in
             ("isoflops.png", "optimal.png", "predicted_vs_actual.png")]  # fmt: skip
    if as_json:
        print_json(
            {
                "ladder": directory,
                "a": ladder.a,
                "b": ladder.b,
                "budgets": [asdict(budget) for budget in ladder.budgets],
                "law": dict(zip(("E", "A", "B", "alpha", "beta"), ladder.law, strict=True)),
                "plots": plots,
            }
        )
        return
    table = Table("budget C (FLOPs)", "N* (params)", "D* (tokens)", "loss at N* (nats)",
                  title="scaling ladder")  # fmt: skip
    for budget in ladder.budgets:
        table.add_row(f"{budget.flops:.3g}", f"{budget.n_opt:.3g}", f"{budget.d_opt:.3g}",
                      f"{budget.loss_opt:.4f}")  # fmt: skip
    stdout.print(table)
    low, high = ladder.a_interval
    e, a, b, alpha, beta = ladder.law
    stdout.print(
        f"N* = {ladder.G:.3g}·C^{ladder.a:.3f}  (a in [{low:.3f}, {high:.3f}], 90%), "
        f"D* = {ladder.H:.3g}·C^{ladder.b:.3f}\n"
        f"L(N, D) = {e:.3f} + {a:.4g}/N^{alpha:.3f} + {b:.4g}/D^{beta:.3f}\n"
        + "\n".join(f"plot: {plot}" for plot in plots)
        + f"\nladder: {directory}\nnext: keel scaling ladder --compare RUN_DIR --prefix {prefix}"
    )


def _ladder_steps() -> list[Step]:
    source = resources.files("keel.experiments") / LADDER_EXPERIMENT
    with resources.as_file(source) as experiment:
        return load_experiment(experiment)


def _ladder_output(prefix: str) -> str:
    """The ladder experiment's output directory under `prefix` (it may not exist yet)."""
    step = next(step for step in all_steps(_ladder_steps()) if step.name == LADDER_STEP)
    return output_path(paths.normalize(prefix), step)


def _compare(run_dir: str, ladder_dir: str, tolerance: float, warmup: float, as_json: bool):
    if not paths.exists(paths.join(ladder_dir, LADDER_FILE)):
        raise UsageError(
            f"no ladder at {ladder_dir}: build it with `keel scaling ladder` (same --prefix) or "
            "name one with --ladder DIR"
        )
    config_path = paths.join(run_dir, CONFIG_FILE)
    if not paths.exists(config_path):
        raise UsageError(f"{run_dir} has no {CONFIG_FILE}: give the directory of a keel run")
    config = load_config(config_path, TrainConfig)
    comparison = compare_to_ladder(
        run_dir, config, load_ladder(ladder_dir), tolerance=tolerance, warmup_fraction=warmup
    )
    if comparison.family_warning:
        warning = escape(comparison.family_warning)
        stderr.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    if as_json:
        print_json(
            {
                "ok": comparison.ok,
                "verdict": comparison.verdict,
                "family_warning": comparison.family_warning,
                "summary": comparison.summary(),
                "params": comparison.params,
                "prediction": comparison.prediction,
                "tolerance": comparison.tolerance,
                "points": [asdict(point) for point in comparison.points],
            }
        )
    else:
        _show_comparison(comparison)
        if comparison.ok:  # a failed run's summary is its one error line, below
            stdout.print(comparison.summary(), highlight=False)
    if not comparison.ok:
        raise fail(f"{run_dir}: {comparison.summary()}", 1)


def _show_comparison(comparison: Comparison, rows: int = 16) -> None:
    """About `rows` points spread over the run (evaluations preferred), the worst and the last."""
    points = comparison.points
    evals = [point for point in points if point.kind == "eval"]
    shown = {point.step: point for point in _spread(evals, rows)}
    if len(evals) < rows // 2:
        shown.update({point.step: point for point in _spread(list(points), rows - len(evals))})
    for point in (comparison.worst, points[-1]):
        if point is not None:
            shown[point.step] = point
    title = f"run (N={comparison.params:,}) vs ladder {comparison.prediction}"
    table = Table("step", "tokens", "C (FLOPs)", "loss", "predicted", "deviation", "", title=title)
    for step in sorted(shown):
        p = shown[step]
        better = p.checked and p.kind == "eval" and p.deviation < -comparison.tolerance
        mark = "[red]worse[/]" if p.flagged else "[green]better[/]" if better else ""
        mark = mark if p.checked else "warm-up"
        table.add_row(str(p.step), f"{p.tokens:,}", f"{p.flops:.3g}", f"{p.loss:.4f} {p.kind}",
                      f"{p.predicted:.4f}", f"{p.deviation:+.1%}", mark)  # fmt: skip
    stdout.print(table)


def _spread(points: list, count: int) -> list:
    """`count` of `points`, evenly spaced (all of them when there are fewer)."""
    if len(points) <= count:
        return points
    return [points[round(i * (len(points) - 1) / (count - 1))] for i in range(count)]
