"""`keel eval RUN --tasks NAMES --output DIR`: a trained run's checkpoint on lm-eval tasks."""

from __future__ import annotations

import typer

from keel.cli.output import print_json, stdout, user_errors


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)


@user_errors
def eval_command(
    run: str = typer.Argument(..., help="A run directory (a local path or a URL)."),
    output: str = typer.Option(
        ..., "--output", help="The directory for eval.json (not the run directory)."
    ),
    tasks: str = typer.Option(
        "",
        "--tasks",
        help="Comma-separated task names: gsm8k_sample, wikitext_cloze, or a --task-file's task.",
    ),
    task_file: list[str] = typer.Option(
        [], "--task-file", help="An lm-eval task YAML over local data (repeatable); it runs too."
    ),
    step: int | None = typer.Option(
        None, "--step", help="The checkpoint to evaluate (default: the latest)."
    ),
    limit: int | None = typer.Option(
        None, "--limit", help="Documents per task and per --eval-data set at most."
    ),
    eval_data: list[str] = typer.Option(
        [],
        "--eval-data",
        help="A text set (.txt, .jsonl, .parquet or a directory) to report "
        "bits per byte on, named by its file stem (repeatable).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print eval.json's object on stdout."),
) -> None:
    """Evaluate a trained run's checkpoint on lm-eval tasks read from local files.

    Results go to DIR/eval.json and to telemetry (eval.results). Nothing downloads: tasks are
    the bundled ones or lm-eval task YAMLs with `dataset_path: json` and `data_files`. Needs
    the eval extra (pip install 'keel[eval]').

    Examples:
      keel eval runs/tiny --tasks gsm8k_sample --limit 20 --output evals/tiny
      keel eval runs/tiny --task-file my_task.yaml --eval-data held_out.jsonl --output evals/t
    """
    import os

    from keel.core.errors import UsageError

    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be at least 1, got {limit}")
    # Nothing downloads: lm-eval and datasets read local files only.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from keel.train.eval_tasks import require_lm_eval

    require_lm_eval("keel eval")
    from keel.train.evaluate import EvalRequest, run_eval

    names = tuple(name.strip() for name in tasks.split(",") if name.strip())
    request = EvalRequest(
        run=run,
        output=output,
        tasks=names,
        task_files=tuple(task_file),
        step=step,
        limit=limit,
        eval_data=tuple(eval_data),
    )
    results = run_eval(request)
    if as_json:
        print_json(results)
        return
    for task, metrics in results["tasks"].items():
        for metric, value in metrics.items():
            stdout.print(f"{task}  {metric}  {value:.4f}", markup=False, highlight=False)
    for name, value in results["bpb"].items():
        stdout.print(f"{name}  bpb  {value:.4f}", markup=False, highlight=False)
    stdout.print(f"wrote {output}/eval.json", markup=False, highlight=False)
