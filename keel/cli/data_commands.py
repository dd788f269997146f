"""`keel data ...`: each DataKit stage as a command over document-set directories."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Optional

import typer

from keel.cli.data_views import show_documents, show_stats
from keel.cli.output import print_json, stderr, stdout, user_errors
from keel.cli.stage_commands import command_name, stage_command
from keel.cluster.backend import require_ray
from keel.core.config import apply_overrides
from keel.core.errors import UsageError
from keel.core.progress import PROGRESS_FORMS, STAGES, ProgressDisplay, parse_progress
from keel.data import registry
from keel.data.decontam import DecontamConfig, EvalSet, run_decontam
from keel.data.dedup import ExactDedupConfig, run_exact_dedup
from keel.data.documents import StageReport
from keel.data.download import DownloadConfig, read_source, run_download
from keel.data.fuzzy import FuzzyDedupConfig, run_fuzzy_dedup
from keel.data.head import head
from keel.data.mix import MixConfig, MixSource, run_mix
from keel.data.quality import QualityTrainConfig, train_quality_classifier
from keel.data.runner import run_stage as run_registered
from keel.data.stage import Stage
from keel.data.stats import data_stats
from keel.data.tokenize import TokenizeConfig, run_tokenize
from keel.flow import RunOptions

app = typer.Typer(
    name="data",
    help="DataKit: raw documents -> deduplicated, decontaminated training tokens.\n\n"
    "Each command reads a document set (a directory of part-*.parquet files, or a glob) and "
    "writes one; see docs/data.md.",
    no_args_is_help=True,
)

INPUT = typer.Option(
    ...,
    "--input",
    "-i",
    help="Input documents: a document set directory, or Parquet, JSONL or text files (plain, .gz "
    "or .zst), or a glob of them.",
)
OUTPUT = typer.Option(
    ...,
    "--output",
    "-o",
    help="Output directory: new, empty, or a previous output of a keel data command (replaced "
    "atomically). Never an input or a directory holding one, nor a directory of other files.",
)
OUTPUT_DIRECTORY = typer.Option(
    ...,
    "--output",
    "-o",
    help="Local directory for the files and manifest.json; a rerun into it continues.",
)
WORKERS = typer.Option(None, "--workers", help="keel/flow workers (default: all cores).")
BACKEND = typer.Option("local", "--backend", help="keel/flow backend: local or ray.")
JSON = typer.Option(False, "--json", help="Print the stage report as one JSON object.")
PROGRESS = typer.Option(
    None,
    "--progress",
    help=f"How to show each flow stage's progress on stderr: {PROGRESS_FORMS}; here N counts a "
    "stage's tasks. Default: a bar on a terminal, else a line every 30 s of a long stage.",
)
QUIET = typer.Option(False, "--quiet", help="Show no progress; the report still prints.")
SET = typer.Option(
    [], "--set", help="Override any field of the stage's config: key=value (repeatable)."
)
FORCE = typer.Option(
    False,
    "--force",
    help="fuzzy: remove near-duplicates even where a source loses more than "
    "max_source_drop of its documents (the same as --set max_source_drop=1).",
)


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="data")


HAND_WRITTEN = ("dedup", "decontam", "tokenize", "mix", "download")
"""Stages whose commands are written below (flags of their own); every other stage of the
registry gets a generated command (stage_commands.py)."""
FLAG_ALIASES = {"quality": {"model_path": ("--model",)}}
"""Extra flag names of generated commands, by stage and field."""
COMMON_OPTIONS = {
    "input": (str, INPUT),
    "output": (str, OUTPUT),
    "overrides": (list[str], SET),
    "workers": (Optional[int], WORKERS),  # noqa: UP045 - typer needs the typing form
    "backend": (str, BACKEND),
    "progress": (Optional[str], PROGRESS),  # noqa: UP045
    "quiet": (bool, QUIET),
    "as_json": (bool, JSON),
}


STAGE_OPTIONS = {"fuzzy_dedup": {"force": (bool, FORCE)}}
"""Options of generated commands that are not config fields, by stage: fuzzy-dedup's --force,
which its source guard's error names (as `keel data dedup --mode fuzzy` has it)."""


def run_generated(stage: Stage, config: object, common: dict) -> None:
    """The body of a generated command: --set on top of the flags, then the stage."""
    options = flow_options(
        common["workers"], common["backend"], common["progress"], common["quiet"]
    )
    config = configured(config, common["overrides"])
    if common.get("force"):
        config = without_source_guard(config)
    report = run_registered(stage, common["input"], common["output"], config, options)
    show_report(report, common["output"], common["as_json"])
    if "sources" in report.details and not common["as_json"]:
        show_source_losses(report.details["sources"])


def add_generated_commands() -> None:
    for stage in registry.STAGES.values():
        name = command_name(stage)
        if name not in HAND_WRITTEN:
            options = {**COMMON_OPTIONS, **STAGE_OPTIONS.get(stage.name, {})}
            command = stage_command(stage, options, run_generated, FLAG_ALIASES.get(stage.name, {}))
            app.command(name)(command)


def without_source_guard(config: FuzzyDedupConfig) -> FuzzyDedupConfig:
    """--force: fuzzy dedup's config with its source guard lifted (max_source_drop=1)."""
    return dataclasses.replace(config, max_source_drop=1.0)


def run_stage(
    run: Callable[..., StageReport],
    input: str,
    output: str,
    config: object,
    options: RunOptions,
    as_json: bool,
) -> StageReport:
    """Run one stage with `options` (flow_options) and print its report."""
    report = run(input, output, config, options)
    show_report(report, output, as_json)
    return report


def flow_options(
    workers: int | None, backend: str, progress: str | None = None, quiet: bool = False
) -> RunOptions:
    """The flow options of a data command's --workers, --backend, --progress and --quiet (no
    --progress: flow's default for stages, a bar on a terminal, else a line every 30 s)."""
    if backend not in ("local", "ray"):
        raise UsageError(f"--backend {backend!r}: use local or ray")
    if backend == "ray":
        require_ray("--backend ray")
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    style = None if progress is None and not quiet else parse_progress(progress, quiet)
    return RunOptions(backend=backend, workers=workers, progress=style)


def show_report(report: StageReport, output: str, as_json: bool) -> None:
    if as_json:
        print_json(dataclasses.asdict(report))
        return
    dropped = sum(report.dropped.values())
    stdout.print(
        f"[bold]{report.stage}[/]: {report.documents_in:,} documents in, "
        f"{report.documents_out:,} out, {dropped:,} dropped -> {output}"
    )
    for reason, count in sorted(report.dropped.items(), key=lambda item: -item[1]):
        stdout.print(f"  {reason}: {count:,}")


def configured(config: object, overrides: list[str]) -> object:
    """`config` with the command's --set overrides applied (type-checked, one-line errors)."""
    return apply_overrides(config, overrides) if overrides else config


@app.command("run")
@user_errors
def run_command(
    stages: str = typer.Argument(
        ...,
        help="Stages to run, comma-separated, e.g. extract,quality,filter: keel's own (an "
        "unknown name lists them), module:attribute for a Stage of your own, or an entry point "
        "of the keel.data.stages group. Consecutive map stages run as one pass.",
        metavar="STAGE[,STAGE...]",
    ),
    input: str = INPUT,
    output: str = OUTPUT,
    overrides: list[str] = typer.Option(
        [],
        "--set",
        help="Override a stage's config field: STAGE.key=value (repeatable), e.g. "
        "filter.min_word_count=20.",
    ),
    workers: int | None = WORKERS,
    backend: str = BACKEND,
    progress: str | None = PROGRESS,
    quiet: bool = QUIET,
    as_json: bool = JSON,
) -> None:
    """Run a chain of stages over a document set; consecutive map stages share one pass.

    Example: keel data run extract,quality,filter --input pages/ --output kept/
    --set filter.min_word_count=20
    """
    from keel.data.registry import chain
    from keel.data.runner import run_chain

    found = chain(stages)
    configs = stage_configs([stage.name for stage in found], [s.config for s in found], overrides)
    report = run_chain(
        list(zip(found, configs, strict=True)),
        input,
        output,
        flow_options(workers, backend, progress, quiet),
    )
    show_report(report, output, as_json)


def stage_configs(names: list[str], kinds: list[type], overrides: list[str]) -> list[object]:
    """Each stage's default config with its `--set STAGE.key=value` overrides applied."""
    by_stage: dict[str, list[str]] = {name: [] for name in names}
    for override in overrides:
        prefix, dot, rest = override.partition(".")
        if not dot or prefix not in by_stage or "=" not in rest:
            raise UsageError(
                f"--set {override!r}: name a stage of the chain ({', '.join(names)}) first, "
                f"e.g. {names[-1]}.key=value"
            )
        by_stage[prefix].append(rest)
    return [configured(kind(), by_stage[name]) for name, kind in zip(names, kinds, strict=True)]


@app.command("train-quality")
@user_errors
def train_quality_command(
    positive: str = typer.Option(..., "--positive", help="Document set of good documents."),
    negative: str = typer.Option(..., "--negative", help="Document set of poor documents."),
    model: str = typer.Option(..., "--model", help="Where to write the model file."),
    overrides: list[str] = SET,
    workers: int | None = WORKERS,
    backend: str = BACKEND,
    progress: str | None = PROGRESS,
    quiet: bool = QUIET,
) -> None:
    """Train the quality classifier from a positive and a negative document set.

    Example: keel data train-quality --positive wiki/ --negative crawl/ --model quality.model
    """
    config = configured(QualityTrainConfig(), overrides)
    trained = train_quality_classifier(
        positive, negative, config, flow_options(workers, backend, progress, quiet)
    )
    trained.save(model)
    stdout.print(f"quality model written to {model}")


@app.command("dedup")
@user_errors
def dedup_command(
    input: str = INPUT,
    output: str = OUTPUT,
    mode: str = typer.Option(
        "exact", "--mode", help="exact (same text) or fuzzy (MinHash LSH, verified)."
    ),
    threshold: float = typer.Option(0.8, "--threshold", help="fuzzy: Jaccard to remove at."),
    force: bool = FORCE,
    overrides: list[str] = SET,
    workers: int | None = WORKERS,
    backend: str = BACKEND,
    progress: str | None = PROGRESS,
    quiet: bool = QUIET,
    as_json: bool = JSON,
) -> None:
    """Remove exact or near duplicates; DIR gets the kept documents and removed.parquet.

    Example: keel data dedup --mode fuzzy --input docs/ --output deduped/ --threshold 0.8
    """
    if mode == "exact":
        config = configured(ExactDedupConfig(), overrides)
        run_stage(
            run_exact_dedup,
            input,
            output,
            config,
            flow_options(workers, backend, progress, quiet),
            as_json,
        )
    elif mode == "fuzzy":
        config = configured(FuzzyDedupConfig(threshold=threshold), overrides)
        if force:
            config = without_source_guard(config)
        report = run_stage(
            run_fuzzy_dedup,
            input,
            output,
            config,
            flow_options(workers, backend, progress, quiet),
            as_json,
        )
        if not as_json:
            show_source_losses(report.details["sources"])
    else:
        raise UsageError(f"--mode {mode!r}: use exact or fuzzy")


def show_source_losses(losses: dict[str, dict], shown: int = 10) -> None:
    """The sources that lost the largest fractions of their documents (those that lost any)."""
    losing = sorted(losses.items(), key=lambda item: -item[1]["fraction"])
    losing = [(source, row) for source, row in losing if row["removed"]][:shown]
    if losing:
        stdout.print("  lost per source:")
    for source, row in losing:
        stdout.print(
            f"    {source}: {row['fraction']:.1%} ({row['removed']:,} of {row['documents']:,})"
        )


@app.command("download")
@user_errors
def download_command(
    source: str = typer.Argument(
        ...,
        help="A URL (http(s)://, s3://, gs://) or a local file listing URLs, one a line, each "
        "optionally followed by its SHA-256.",
    ),
    output: str = OUTPUT_DIRECTORY,
    concurrency: int = typer.Option(8, "--concurrency", help="Files fetched at once."),
    overrides: list[str] = SET,
    progress: str | None = PROGRESS,
    quiet: bool = QUIET,
    as_json: bool = JSON,
) -> None:
    """Fetch raw files, resumably (a rerun fetches only the missing bytes), checksum-verified
    (a URL list's SHA-256 column or URL.sha256 beside the file); writes manifest.json.

    Example: keel data download urls.txt --output raw/ --concurrency 16
    """
    config = configured(DownloadConfig(concurrency=concurrency), overrides)
    style = STAGES if progress is None and not quiet else parse_progress(progress, quiet)
    with ProgressDisplay(style) as display:
        files = display.task("download", total=len(read_source(source)), unit="files")
        done: list[int] = []

        def on_file(fetched) -> None:
            done.append(fetched.bytes)
            files.update(len(done), bytes=f"{sum(done):,} bytes")

        report = run_download(source, output, config, on_file=on_file)
        files.finish()
    if as_json:
        print_json(report.to_dict())
        return
    stdout.print(
        f"[bold]download[/]: {len(report.files):,} files, {report.bytes:,} bytes "
        f"({report.fetched_bytes:,} fetched now) -> {output}"
    )


@app.command("decontam")
@user_errors
def decontam_command(
    eval: list[str] = typer.Option(..., "--eval", help="An eval set file (repeatable)."),
    eval_field: list[str] = typer.Option(
        ["question"], "--eval-field", help="Text field of the eval sets (repeatable)."
    ),
    input: str = INPUT,
    output: str = OUTPUT,
    ngram: int = typer.Option(13, "--ngram", help="Words per n-gram."),
    threshold: int = typer.Option(1, "--threshold", help="Matching n-grams that flag a document."),
    mode: str = typer.Option("drop", "--mode", help="drop, or remove_spans."),
    overrides: list[str] = SET,
    workers: int | None = WORKERS,
    backend: str = BACKEND,
    progress: str | None = PROGRESS,
    quiet: bool = QUIET,
    as_json: bool = JSON,
) -> None:
    """Drop (or cut) documents sharing n-grams with eval sets; report per eval set.

    Example: keel data decontam --eval gsm8k.jsonl --eval-field question --eval-field answer
    --input docs/ --output clean/
    """
    eval_sets = tuple(EvalSet(path, tuple(eval_field)) for path in eval)
    config = DecontamConfig(eval_sets, ngram=ngram, min_matches=threshold, mode=mode)
    run_stage(
        run_decontam,
        input,
        output,
        configured(config, overrides),
        flow_options(workers, backend, progress, quiet),
        as_json,
    )


@app.command("tokenize")
@user_errors
def tokenize_command(
    input: str = INPUT,
    output: str = OUTPUT,
    train_tokenizer: bool = typer.Option(
        False, "--train-tokenizer", help="Train a byte-level BPE on the input."
    ),
    vocab_size: int = typer.Option(32_768, "--vocab-size", help="Vocabulary of a trained one."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="A tokenizer.json to use."),
    overrides: list[str] = SET,
    workers: int | None = WORKERS,
    backend: str = BACKEND,
    progress: str | None = PROGRESS,
    quiet: bool = QUIET,
    as_json: bool = JSON,
) -> None:
    """Documents -> a token cache (manifest.json + shards) and the tokenizer.json used.

    Example: keel data tokenize --input clean/ --output cache/ --train-tokenizer --vocab-size 32768
    """
    if train_tokenizer == (tokenizer is not None):
        raise UsageError("pass exactly one of --train-tokenizer and --tokenizer PATH")
    config = TokenizeConfig(vocab_size=vocab_size, tokenizer_path=tokenizer)
    run_stage(
        run_tokenize,
        input,
        output,
        configured(config, overrides),
        flow_options(workers, backend, progress, quiet),
        as_json,
    )


@app.command("mix")
@user_errors
def mix_command(
    source: list[str] = typer.Option(
        ..., "--source", help="DIR=WEIGHT (repeatable): a document set and its token weight."
    ),
    output: str = OUTPUT,
    total_tokens: int | None = typer.Option(
        None, "--total-tokens", help="Target tokens (default: the most that repeats no source)."
    ),
    bytes_per_token: float = typer.Option(4.0, "--bytes-per-token", help="Token estimate."),
    cluster_weight: list[str] = typer.Option(
        [],
        "--cluster-weight",
        help="K=M (repeatable): split each source by its `cluster` column (keel data embed) and "
        "give cluster K M times its natural share of the source's tokens (1 when not given, 0 "
        "leaves it out).",
    ),
    workers: int | None = WORKERS,
    backend: str = BACKEND,
    progress: str | None = PROGRESS,
    quiet: bool = QUIET,
    as_json: bool = JSON,
) -> None:
    """Mix document sets by token weight; small sources repeat (epochs in mix.json).

    Examples:
      keel data mix --source web/=0.7 --source books/=0.3 --output mix/ --total-tokens 1e9
      keel data mix --source embedded/=1 --cluster-weight 3=2 --cluster-weight 5=0 --output mix/
    """
    weights = tuple(_cluster_weight(text) for text in cluster_weight)
    sources = tuple(
        dataclasses.replace(_mix_source(text), cluster_weights=weights) for text in source
    )
    config = MixConfig(sources, total_tokens, bytes_per_token)
    report = run_mix(config, output, flow_options(workers, backend, progress, quiet))
    show_report(report, output, as_json)


@app.command("stats")
@user_errors
def stats_command(
    path: str = typer.Argument(
        ...,
        help="A document set or token cache directory, or raw input: Parquet, JSONL or text "
        "files (plain, .gz or .zst), or a glob of them.",
    ),
    png: str | None = typer.Option(
        None, "--png", help="Also draw the histograms into this PNG file."
    ),
    as_json: bool = JSON,
) -> None:
    """Documents, text bytes, tokens (for a token cache), histograms and the stage's drops.

    Text bytes are the UTF-8 size of the text column, not the size of the files. Histograms:
    document length, and language and quality score when the set has those columns.

    Examples:
      keel data stats keel-out/dedup-1a2b3c4d
      keel data stats scored/ --png scored.png
      keel data stats 'raw/*.jsonl.zst'
    """
    stats = data_stats(path)
    if png is not None:
        from keel.data.stats_plot import save_stats_plot  # matplotlib: only when asked

        save_stats_plot(stats, png)
    if as_json:
        print_json(stats.to_dict())
    else:
        show_stats(stats)
    if png is not None:
        stderr.print(f"histograms drawn to {png}")


@app.command("head")
@user_errors
def head_command(
    path: str = typer.Argument(
        ...,
        help="A document set directory, or raw input: Parquet, JSONL or text files (plain, .gz "
        "or .zst), or a glob of them.",
    ),
    n: int = typer.Option(5, "-n", help="How many documents."),
    where: str | None = typer.Option(
        None,
        "--where",
        help="Only documents for which this DuckDB SQL condition over the columns holds, e.g. "
        "\"language = 'en' AND quality_score < 0.2\".",
    ),
    chars: int = typer.Option(500, "--chars", help="Characters of each text to show."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the documents, whole, as one JSON object."
    ),
) -> None:
    """The first documents of a document set (with --where, the first that match).

    Examples:
      keel data head scored/ -n 3
      keel data head scored/ --where "quality_score < 0.2 AND length(text) > 1000"
      keel data head 'raw/*.jsonl.gz' --where "source = 'web'"
    """
    documents = head(path, n, where)
    if as_json:
        print_json({"documents": documents})
        return
    if not documents:
        stderr.print(f"no documents{' match' if where else ''} in {path}")
        return
    show_documents(documents, chars)


def _mix_source(text: str) -> MixSource:
    path, separator, weight = text.rpartition("=")
    try:
        return MixSource(path, float(weight)) if separator else _bad_source(text)
    except ValueError:
        return _bad_source(text)


def _cluster_weight(text: str) -> tuple[int, float]:
    cluster, separator, multiplier = text.partition("=")
    try:
        if separator:
            return int(cluster), float(multiplier)
    except ValueError:
        pass
    raise UsageError(f"--cluster-weight {text!r}: expected CLUSTER=MULTIPLIER, e.g. 3=2")


def _bad_source(text: str) -> MixSource:
    raise UsageError(f"--source {text!r}: expected DIR=WEIGHT, e.g. web/=0.7")


add_generated_commands()
