"""`keel export RUN --format hf --output DIR`: a trained run's checkpoint in another format."""

from __future__ import annotations

import typer

from keel.cli.output import stdout, user_errors

FORMATS = ("hf",)
"""Export formats (keel.train.hf_export for "hf")."""


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)


@user_errors
def export_command(
    run: str = typer.Argument(..., help="A run directory (a local path or a URL)."),
    output: str = typer.Option(..., "--output", help="The directory to write (new or empty)."),
    export_format: str = typer.Option("hf", "--format", help=f"One of: {', '.join(FORMATS)}."),
    step: int | None = typer.Option(
        None, "--step", help="The checkpoint to export (default: the latest)."
    ),
    architecture: str | None = typer.Option(
        None,
        "--architecture",
        help="hf: the transformers class to export as (default: the first stock class that "
        "expresses the model exactly, else KeelForCausalLM); a class that cannot is refused.",
    ),
) -> None:
    """Export a trained run's checkpoint (hf: safetensors, config.json, tokenizer files).

    The hf directory loads with transformers' AutoModelForCausalLM and AutoTokenizer: dense
    models as Qwen3 (QK-norm) or Llama, MoE models without shared experts as Qwen3-MoE, any
    other model as KeelForCausalLM (keel's modeling file in the directory: load it, and its
    tokenizer, with trust_remote_code=True).

    Examples:
      keel export runs/tiny --format hf --output exports/tiny
      keel export runs/tiny --step 200 --format hf --output exports/tiny-200
    """
    from keel.core.errors import UsageError

    if export_format not in FORMATS:
        raise UsageError(f"--format {export_format!r}: known formats are {', '.join(FORMATS)}")
    from keel.train.hf_export import export_hf
    from keel.train.trained import load_trained

    trained = load_trained(run, step)
    exported = export_hf(trained, output, architecture)
    stdout.print(
        f"exported {trained.run} step {trained.step} as {exported.name} to {output}",
        markup=False,
        highlight=False,
    )
    if exported.remote_code:
        stdout.print(
            f"load it with trust_remote_code=True (the model's code is in {output}): "
            f"AutoModelForCausalLM.from_pretrained({output!r}, trust_remote_code=True), and "
            "the same for AutoTokenizer, which reads config.json too and otherwise asks whether "
            "to run the code",
            markup=False,
            highlight=False,
        )
