"""`keel train`: train a dense or MoE model from a config file or a preset.

`--data PATH` trains on your own text (or a token cache) and `--eval-data PATH` evaluates on
more: keel/train/own_text.py tokenizes text as a cached step under --prefix. With no data named,
the run trains on the bundled sample's token cache, built on first use by the quickstart's data
steps under --prefix (cached there like any step, so `keel quickstart` and `keel train` share
it).
"""

from __future__ import annotations

import os
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from importlib import resources

import typer
import yaml
from rich.markup import escape

from keel.cli.output import print_json, stderr, stdout, user_errors
from keel.cli.steps_commands import PREFIX
from keel.core import paths
from keel.core.config import to_dict
from keel.core.errors import UsageError
from keel.core.gang import REPLICAS, run_local_gang
from keel.core.progress import PROGRESS_FORMS, ProgressDisplay, parse_progress
from keel.steps import all_steps, load_experiment, output_path, run
from keel.train.branch import parse_branch_point
from keel.train.config import TrainConfig, apply_train_overrides
from keel.train.distributed import check_shared_directory, initialize_from_env, process_label
from keel.train.layout import check_mesh, run_devices
from keel.train.own_text import ResolvedData, eval_names, with_eval_data, with_training_data
from keel.train.presets import PRESETS, load_run_config, preset
from keel.train.trainer import train

BUNDLED_CACHE_STEP = "tokenize"
"""The quickstart step whose output is the bundled sample's token cache."""


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)


@user_errors
def train_command(
    config_file: str | None = typer.Argument(
        None,
        metavar="[CONFIG.yaml]",
        help="A TrainConfig as YAML or JSON; `preset: NAME` in it starts from a preset.",
    ),
    preset_name: str | None = typer.Option(
        None, "--preset", help=f"Start from a named config: {', '.join(PRESETS)}."
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        help="Override a config key: key=value (repeatable), e.g. model.top_k=4; list items by "
        "index: data.0.cache=DIR (adds the first item of an empty list), or a whole list: "
        "'data=[{cache: A}, {cache: B, weight: 2}]'.",
    ),
    output: str | None = typer.Option(
        None, "--output", help="Run directory (default: PREFIX/train-NAME); rerun to resume."
    ),
    steps: int | None = typer.Option(
        None, "--steps", min=1, help="Total steps of the run (the schedule follows)."
    ),
    data: str | None = typer.Option(
        None,
        "--data",
        help="Train on this: a .txt file (one document), .jsonl/.parquet files (`text`), a "
        "directory of them, or a token cache. Text is tokenized once (cached under --prefix).",
    ),
    eval_data: list[str] = typer.Option(
        [],
        "--eval-data",
        help="Evaluate on this (repeatable; text or a cache, in the training tokenizer); the "
        "final evaluation scores all of it as eval/<file stem>/bpb.",
    ),
    tokenizer: str | None = typer.Option(
        None,
        "--tokenizer",
        help="With --data text: encode with this tokenizer.json instead of training a BPE.",
    ),
    processes: int = typer.Option(
        1,
        "--processes",
        min=1,
        help="Run as a gang of N processes on this machine (one JAX run over all their devices).",
    ),
    plan: bool = typer.Option(
        False, "--plan", help="Compile one step on abstract arrays and print bytes per device."
    ),
    devices: int | None = typer.Option(
        None, "--devices", min=1, help="With --plan: simulate N CPU devices."
    ),
    progress_form: str | None = typer.Option(
        None,
        "--progress",
        metavar="FORM",
        help=f"How to show progress on stderr: {PROGRESS_FORMS}. Default auto: a bar in a "
        "terminal, elsewhere (a log, CI, nohup) a plain line every tenth of the run or 30 s.",
    ),
    quiet: bool = typer.Option(
        False, "--quiet", help="Show no progress (same as --progress off); the result still prints."
    ),
    print_config: bool = typer.Option(
        False,
        "--print-config",
        help="Print the complete config as YAML (preset, file, --set and --steps applied) and "
        "exit: `keel train THAT.yaml` trains the same run.",
    ),
    branch_from: str | None = typer.Option(
        None,
        "--from",
        metavar="RUN:STEP",
        help="Start this new run from RUN's checkpoint at STEP (its whole state), then follow "
        "this config: a branch, e.g. a cooldown. RUN is only read.",
    ),
    gate: int | None = typer.Option(
        None,
        "--gate",
        metavar="N",
        help="Qualify the config instead of training it: N steps in a temporary directory; exit "
        "1 on a non-finite loss or memory over --memory-limit; print median tokens/s and peak "
        "memory.",
    ),
    memory_limit: str | None = typer.Option(
        None,
        "--memory-limit",
        metavar="BYTES",
        help="With --gate: the most memory a device may need (XLA's estimate) or use (its peak), "
        "e.g. 80GB or 141GiB.",
    ),
    report_to: str | None = typer.Option(
        None,
        "--report-to",
        metavar="TARGET",
        help="Also mirror the run's metrics and config to: wandb (needs `pip install "
        "'keel[wandb]'`; WANDB_MODE=offline works without an account).",
    ),
    prefix: str = PREFIX,
    as_json: bool = typer.Option(False, "--json", help="Print the final metrics as JSON."),
) -> None:
    """Train a model; running the same command again resumes from the last checkpoint.

    Examples:
      keel train --preset tiny-dense --data train.txt --eval-data val.txt
      keel train --preset tiny-moe --steps 200
      keel train run.yaml --set optimizer.name=muon --output runs/muon
      keel train --preset tiny-moe --processes 2 --set mesh.expert=2 --output runs/a
      keel train --preset 535b-a23b --plan --devices 64
      keel train --preset tiny-dense --progress 20 > train.log 2>&1   # a line every 20 steps
      keel train --preset tiny-moe --print-config > run.yaml   # every key, to edit
      keel train run.yaml --gate 20 --memory-limit 80GB   # qualify it before a long run
      keel train cooldown.yaml --from runs/main:2000 --output runs/cool   # a branch
      keel train --preset tiny-dense --report-to wandb   # metrics and config to W&B too
    """
    style = parse_progress(progress_form, quiet)
    if report_to is not None:
        from keel.train.wandb_report import check_report_target

        check_report_target(report_to)
    branch = None if branch_from is None else parse_branch_point(branch_from)
    config, name = load_train_config(config_file, preset_name, overrides)
    if steps is not None:
        config = replace(config, steps=steps)
    config.validate()
    for line in config.contradictions():
        stderr.print(f"[bold yellow]warning:[/] {escape(line)}", highlight=False)
    if print_config:
        if data is not None or eval_data:
            raise UsageError(
                "--print-config prints the config before --data/--eval-data are tokenized: "
                "print it without them, then pass them again with the YAML"
            )
        typer.echo(config_yaml(config), nl=False)
        return
    eval_names(eval_data)  # two sets of one name: an error before anything runs
    if tokenizer is not None and data is None:
        raise UsageError("--tokenizer goes with --data (the text it encodes)")
    if plan:
        _print_plan(config, devices, as_json)
        return
    if devices is not None:
        raise UsageError("--devices goes with --plan; a run uses the devices it sees")
    if memory_limit is not None and gate is None:
        raise UsageError("--memory-limit goes with --gate N")
    if gate is not None and (processes > 1 or REPLICAS in os.environ):
        raise UsageError("--gate qualifies a config in one process; run it without a gang")
    if data is not None:
        config, resolved = with_training_data(config, data, prefix, tokenizer)
        _report_data([resolved])
    needs_sample = not config.data and not all(phase.mixture for phase in config.phases)
    output = output or paths.join(prefix, f"train-{name}")
    if processes > 1 and REPLICAS not in os.environ:
        if needs_sample:  # built once here; the members find it (and the eval sets) cached
            config = config.with_data((bundled_cache(prefix),))
        if eval_data:
            _report_data(with_eval_data(config, eval_data, prefix)[1])
        _run_gang(processes)
        return
    gang = initialize_from_env()
    check_mesh(config, len(run_devices()))  # before the sample is built or anything compiled
    if needs_sample:
        config = config.with_data((bundled_cache(prefix),))
    if eval_data:
        config, evaluated = with_eval_data(config, eval_data, prefix)
        if gang is None:
            _report_data(evaluated)
    if gate is not None:
        _run_gate(config, gate, memory_limit, as_json)
        return
    if gang is not None:
        check_shared_directory(output, gang)
        stderr.print(f"{process_label(gang)} of the gang at {gang.coordinator}")
        if gang.process != 0:  # it trains; process 0 reports
            train(config, output, branch=branch)
            return
    with ProgressDisplay(style) as progress, _mirror(report_to, config, output, name) as mirror:
        shown = progress.task("train", config.total_steps)

        def on_step(line: dict) -> None:
            shown.update(
                line["step"],
                loss=f"loss {line['loss']:.3f}",
                speed=f"{line['tokens_per_s']:,.0f} tokens/s",
            )
            if mirror is not None:
                mirror.log(line)

        result = train(config, output, on_step=on_step, branch=branch)
    if as_json:
        print_json({"output": result.output, "resumed_from": result.resumed_from, **result.last})
        return
    last = result.last
    if result.resumed_from == config.total_steps:
        stdout.print(f"{output}: already trained to step {config.total_steps}; nothing to do")
        return
    resumed = f" (resumed from step {result.resumed_from})" if result.resumed_from else ""
    evaluation = (
        f", eval loss {last['eval_loss']:.3f}, {last['eval_bpb']:.3f} bits/byte"
        if "eval_bpb" in last
        else ""
    )
    stdout.print(
        f"trained {output} to step {last['step']}{resumed}: loss {last['loss']:.3f}{evaluation}\n"
        f"metrics: {paths.join(output, 'metrics.jsonl')}"
    )


def _mirror(
    report_to: str | None, config: TrainConfig, output: str, name: str
) -> AbstractContextManager:
    """The W&B run mirroring this one (`--report-to wandb`), or nothing."""
    if report_to is None:
        return nullcontext()
    from keel.train.wandb_report import WandbRun

    return WandbRun(config, output, name)


def _report_data(resolved: list[ResolvedData]) -> None:
    for item in resolved:
        stderr.print(f"data: {item.path} -> {item.cache} ({item.outcome})", highlight=False)


def _run_gang(processes: int) -> None:
    """This command again as a gang of `processes` local processes (the bundled cache is
    built already, so they find it); exits with the gang's code."""
    argv = [sys.executable, "-m", "keel", *_without_processes(sys.argv[1:])]
    code = run_local_gang(argv, processes)
    if code:
        raise typer.Exit(code)


def _without_processes(args: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--processes":
            skip = True
        elif not arg.startswith("--processes="):
            kept.append(arg)
    return kept


def _run_gate(config: TrainConfig, steps: int, memory_limit: str | None, as_json: bool) -> None:
    from keel.train.gate import parse_memory_limit, run_gate

    limit = None if memory_limit is None else parse_memory_limit(memory_limit)
    result = run_gate(config, steps, limit)
    if as_json:
        print_json(result.to_dict())
    else:
        stdout.print(result.line(), highlight=False)


def _print_plan(config: TrainConfig, devices: int | None, as_json: bool) -> None:
    if devices is not None:  # before the CPU backend starts: it reads the count once
        import jax

        jax.config.update("jax_num_cpu_devices", devices)
        jax.config.update("jax_platforms", "cpu")
    from keel.train.plan import plan_run

    report = plan_run(config)
    if as_json:
        print_json(report.to_dict())
        return
    for line in report.lines():
        stdout.print(line, highlight=False)


def load_train_config(
    config_file: str | None, preset_name: str | None, overrides: list[str]
) -> tuple[TrainConfig, str]:
    """The config named by a file or a preset, with `--set` overrides; and the run's name."""
    if (config_file is None) == (preset_name is None):
        raise UsageError(
            "name a CONFIG.yaml or a --preset (one of them; a YAML may say `preset: NAME`): "
            "keel train --help"
        )
    if preset_name is not None:
        return apply_train_overrides(preset(preset_name), overrides), preset_name
    stem = paths.local_path(config_file).stem if paths.is_local(config_file) else "run"
    return load_run_config(config_file, overrides), stem


def config_yaml(config: TrainConfig) -> str:
    """Every key of `config` as YAML, under a comment with the run's identity."""
    body = yaml.safe_dump(to_dict(config), sort_keys=False)
    return (
        f"# keel train config, run identity {config.identity()[:16]}: "
        "`keel train THIS.yaml` trains this run\n" + body
    )


def bundled_cache(prefix: str) -> str:
    """Build (or find cached) the quickstart's token cache under `prefix`; its path."""
    source = resources.files("keel.experiments") / "quickstart.py"
    with resources.as_file(source) as experiment:
        steps = all_steps(load_experiment(experiment))
    tokenize = next(step for step in steps if step.name == BUNDLED_CACHE_STEP)
    report = run([tokenize], prefix)
    if not report.ok:
        raise UsageError(
            f"building the bundled sample's token cache failed: {report.errors}; "
            f"see `keel status --prefix {prefix}`"
        )
    return output_path(paths.normalize(prefix), tokenize)
