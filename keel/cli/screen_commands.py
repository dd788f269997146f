"""`keel scaling screen CONFIG.yaml`: train a baseline and its variants at small budgets and sort
the variants by their effective compute multiplier (keel.scaling.screen)."""

from __future__ import annotations

from dataclasses import dataclass, field

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from keel.cli.output import print_json, stdout, user_errors
from keel.cli.steps_commands import PREFIX
from keel.cli.train_commands import bundled_cache
from keel.core import paths
from keel.core.config import apply_overrides, load_config
from keel.core.errors import ConfigError, KeelError
from keel.core.stop import install_handler as install_stop_handler
from keel.scaling.screen import BaselineFit, ScreenConfig, read_screen, screen_steps
from keel.steps import output_path, run
from keel.train.config import TrainConfig
from keel.train.presets import preset

EXAMPLE = """\
preset: tiny-moe              # or base: {...} (a TrainConfig)
overrides: [eval_batches=4]   # of the baseline, so of every variant too
variants:
  lr-x3: [phases.0.schedule.peak_lr=9e-3]
  top-4: [model.top_k=4]      # twice the active experts: fewer tokens
  seed-1: [seed=1]            # a control: the baseline's noise
budgets: [1e12, 2e12, 4e12]   # FLOPs; at least 2 (3+ also fit the asymptote)
tolerance: 0.05               # multipliers within 1 ± 0.05 are neutral
"""


@dataclass(frozen=True)
class ScreenFile:
    """A screen's YAML: ScreenConfig's keys, the base as `base` (a TrainConfig) or as `preset`
    plus `overrides`."""

    preset: str = ""
    base: TrainConfig | None = None
    overrides: tuple[str, ...] = ()
    variants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    budgets: tuple[float, ...] = ScreenConfig.budgets
    tolerance: float = ScreenConfig.tolerance
    max_extrapolation: float = ScreenConfig.max_extrapolation
    use_throughput: bool = ScreenConfig.use_throughput


def load_screen(path: str) -> ScreenConfig:
    """Read a screen's YAML or JSON file (see ScreenFile) into a validated ScreenConfig."""
    spec = load_config(path, ScreenFile)
    if spec.preset and spec.base is not None:
        raise ConfigError(f"{path}: give the baseline as `preset` or as `base`, not both")
    if not spec.preset and spec.base is None:
        raise ConfigError(f"{path}: name the baseline: `preset: tiny-moe`, or `base:` a config")
    base = preset(spec.preset) if spec.preset else spec.base
    base = apply_overrides(base, spec.overrides, where=f"{path}: overrides:")
    return ScreenConfig(
        base, spec.variants, spec.budgets, spec.tolerance, spec.max_extrapolation,
        spec.use_throughput,
    ).validate()  # fmt: skip


def register(scaling_app: typer.Typer) -> None:
    scaling_app.command("screen", help=_HELP)(screen_command)


_HELP = (
    "Screen variants of a baseline by their effective compute multiplier.\n\n"
    "The baseline and every variant train at every budget (cached steps under --prefix: rerun "
    "to reuse them). A variant's multiplier at a budget is the compute the baseline needs to "
    "reach its loss over the compute the variant spent, times its achieved FLOP/s over the "
    "baseline's. "
    "See docs/scaling.md.\n\n"
    f"Example CONFIG.yaml:\n\n{escape(EXAMPLE)}\n"
    "Then: keel scaling screen screen.yaml --prefix runs/"
)


@user_errors
def screen_command(
    config_file: str = typer.Argument(..., metavar="CONFIG.yaml", help="The screen (YAML/JSON)."),
    prefix: str = PREFIX,
    as_json: bool = typer.Option(False, "--json", help="Print screen.json as one JSON object."),
) -> None:
    config = load_screen(config_file)
    caches: tuple[str, ...] = ()
    if not config.base.data and not all(phase.mixture for phase in config.base.phases):
        caches = (bundled_cache(prefix),)
    steps = screen_steps(config, caches)
    install_stop_handler()  # SIGTERM: a training step checkpoints and stops (keel.core.stop)
    report = run(steps, paths.normalize(prefix))
    if not report.ok:
        name, error = next(iter(report.errors.items()))
        raise KeelError(f"screen step {name} failed: {error}; see `keel status --prefix {prefix}`")
    output = output_path(paths.normalize(prefix), steps[-1])
    result = read_screen(output)
    if as_json:
        print_json({"output": output, **result})
    else:
        _show(result, output)


_MARKS = {"effective": "+", "neutral": "=", "ineffective": "-", "undecided": "?"}


def _sci(value: float | None) -> str:
    """3 digits, compact exponents: 1.2e+09 -> 1.2e9."""
    if value is None:
        return "-"
    text = f"{value:.3g}"
    return text.replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


def _show(result: dict, output: str) -> None:
    table = Table(
        "variant", "verdict", "budget", "loss", "FLOPs", "baseline", "speed", "multiplier",
        box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
    )  # fmt: skip
    for variant in result["variants"]:
        for index, row in enumerate(variant["rows"]):
            if row["status"] == "ok":
                equivalent, multiplier = _sci(row["baseline_flops"]), _sci(row["multiplier"])
            else:
                side = "<" if row["status"] == "below_range" else ">"
                equivalent = f"{side} {_sci(row['baseline_bound'])}"
                if row["status"] == "below_asymptote":
                    equivalent = "never"
                multiplier = f"{side} {_sci(row['bound'])}"
            first = index == 0
            table.add_row(
                variant["name"] if first else "", variant["verdict"] if first else "",
                _sci(row["budget"]), f"{row['loss']:.4f}", _sci(row["flops"]), equivalent,
                _sci(row["throughput_ratio"]), f"{multiplier} {_MARKS[row['verdict']]}",
            )  # fmt: skip
    stdout.print(table)
    fit = result["fit"]
    baseline_fit = BaselineFit(**fit)
    own = baseline_fit.self_multipliers()
    low = min(fit["flops"]) / result["max_extrapolation"]
    high = max(fit["flops"]) * result["max_extrapolation"]
    speed = "x speed" if result["use_throughput"] else "(speed not counted)"
    stdout.print(
        f"baseline: the FLOPs the baseline needs to reach the loss, from its fit "
        f"{baseline_fit.describe()} (nats; RMS error {fit['rms']:.2%}) over "
        f"{len(fit['flops'])} budgets, trusted for C in [{_sci(low)}, {_sci(high)}]; never: "
        f"below its asymptote; the baseline's own multipliers by the fit: {_sci(min(own))} to "
        f"{_sci(max(own))}\n"
        "speed: achieved FLOP/s (tokens/s x FLOPs per token) over the baseline's at that budget\n"
        f"multiplier = baseline / FLOPs {speed}: + above 1 + {result['tolerance']:g}, "
        f"- below 1 - {result['tolerance']:g}, = in between, ? a bound that cannot tell\n"
        f"wrote {paths.join(output, 'screen.json')} and screen.csv"
    )
