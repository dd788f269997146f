"""`keel scaling ...`: Chinchilla scaling-law fits and their plots from a CSV of runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer
from rich.table import Table

from keel.cli.output import print_json, stdout, user_errors
from keel.core.errors import UsageError
from keel.scaling.fits import (
    IsoflopFit,
    ParametricFit,
    Prediction,
    fit_isoflop,
    fit_parametric,
    load_runs,
)

app = typer.Typer(
    name="scaling",
    help="Scaling-law fits (Hoffmann et al. 2022) from a CSV of runs: params, tokens, loss "
    "[, flops]; see docs/scaling.md.",
    no_args_is_help=True,
)

CSV = typer.Argument(..., help="CSV with columns params, tokens, loss and optional flops.")
BUDGETS = typer.Option(
    None, "--budgets", help="Comma-separated FLOP budgets, e.g. 1e18,3e18,1e19 (runs within ±15%)."
)
BOOTSTRAP = typer.Option(200, "--bootstrap", help="Bootstrap resamples for the intervals.")


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="scaling")


def parse_budgets(text: str | None) -> list[float] | None:
    """'1e18,3e18' -> [1e18, 3e18] (FLOPs); None when not given."""
    if not text:
        return None
    try:
        budgets = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--budgets {text!r}: expected numbers like 1e18,3e18,1e19") from None
    if not budgets or any(not budget > 0 for budget in budgets):
        raise UsageError(f"--budgets {text!r}: budgets must be positive FLOP counts")
    return budgets


def _prediction_dict(prediction: Prediction) -> dict:
    return dataclasses.asdict(prediction)


@app.command("fit")
@user_errors
def fit_command(
    csv: Path = CSV,
    method: str = typer.Option(
        "isoflop", "--method", help="isoflop (Approach 2) or parametric (3)."
    ),
    budgets: str | None = BUDGETS,
    predict: float | None = typer.Option(
        None, "--predict", help="Also predict N*, D* and loss at this budget C (FLOPs)."
    ),
    bootstrap: int = BOOTSTRAP,
    as_json: bool = typer.Option(False, "--json", help="Print the fit as one JSON object."),
) -> None:
    """Fit a scaling law to the runs in CSV.

    Example: keel scaling fit runs.csv --method parametric --predict 1e23 --json
    """
    if method not in ("isoflop", "parametric"):
        raise UsageError(f"--method {method!r}: use isoflop or parametric")
    if predict is not None and not predict > 0:
        raise UsageError(f"--predict {predict}: a budget must be a positive FLOP count")
    if bootstrap < 0:
        raise UsageError(f"--bootstrap must be at least 0, got {bootstrap}")
    runs = load_runs(csv)
    chosen = parse_budgets(budgets)
    if method == "isoflop":
        fit: IsoflopFit | ParametricFit = fit_isoflop(runs, chosen, bootstrap=max(bootstrap, 1))
    else:
        if chosen is not None:
            raise UsageError("--budgets applies to --method isoflop only")
        fit = fit_parametric(runs, bootstrap=bootstrap)
    prediction = fit.predict(predict) if predict is not None else None
    if as_json:
        print_json(_fit_dict(fit, prediction))
    else:
        _show_fit(fit, prediction)


def _fit_dict(fit: IsoflopFit | ParametricFit, prediction: Prediction | None) -> dict:
    if isinstance(fit, IsoflopFit):
        data: dict = {
            "a": fit.a,
            "b": fit.b,
            "budgets": [
                {"flops": f.flops, "n_opt": f.n_opt, "d_opt": f.d_opt, "loss_opt": f.loss_opt}
                for f in fit.budgets
            ],
        }
    else:
        names = ("E", "A", "B", "alpha", "beta", "a", "b")
        data = {name: getattr(fit, name) for name in names}
    if prediction is not None:
        data["prediction"] = _prediction_dict(prediction)
    return data


def _show_fit(fit: IsoflopFit | ParametricFit, prediction: Prediction | None) -> None:
    if isinstance(fit, IsoflopFit):
        table = Table("budget C (FLOPs)", "N* (params)", "D* (tokens)", "loss at N* (nats)")
        for f in fit.budgets:
            table.add_row(f"{f.flops:.3g}", f"{f.n_opt:.3g}", f"{f.d_opt:.3g}", f"{f.loss_opt:.4f}")
        stdout.print(table)
        low, high = fit.a_interval
        stdout.print(
            f"N* = {fit.G:.3g}·C^{fit.a:.3f}  (a in [{low:.3f}, {high:.3f}], {fit.level:.0%})\n"
            f"D* = {fit.H:.3g}·C^{fit.b:.3f}"
        )
    else:
        stdout.print(
            f"L(N, D) = {fit.E:.3f} + {fit.A:.4g}/N^{fit.alpha:.3f} + {fit.B:.4g}/D^{fit.beta:.3f}"
            f"\na = β/(α+β) = {fit.a:.3f}, b = α/(α+β) = {fit.b:.3f}"
        )
    if prediction is not None:
        p = prediction
        lines = [
            f"at C = {p.flops:.3g} FLOPs ({p.level:.0%} intervals):",
            f"  N* = {p.n_opt:.3g} params [{p.n_interval[0]:.3g}, {p.n_interval[1]:.3g}]",
            f"  D* = {p.d_opt:.3g} tokens [{p.d_interval[0]:.3g}, {p.d_interval[1]:.3g}]",
        ]
        if p.loss is not None and p.loss_interval is not None:
            low, high = p.loss_interval
            lines.append(f"  loss = {p.loss:.4f} nats [{low:.4f}, {high:.4f}]")
        stdout.print("\n".join(lines))


@app.command("plot")
@user_errors
def plot_command(
    csv: Path = CSV,
    output: Path = typer.Option(..., "--output", "-o", help="Directory for the PNG files."),
    budgets: str | None = BUDGETS,
    predict: float | None = typer.Option(
        None,
        "--predict",
        help="Extrapolate N*(C), D*(C) to this budget (default 100x the largest).",
    ),
    bootstrap: int = BOOTSTRAP,
) -> None:
    """Write isoflops.png, optimal.png and predicted_vs_actual.png for the runs in CSV.

    Example: keel scaling plot runs.csv --output plots/
    """
    from keel.scaling.plots import write_plots  # matplotlib is slow to import: only when plotting

    runs = load_runs(csv)
    isoflop = fit_isoflop(runs, parse_budgets(budgets), bootstrap=max(bootstrap, 1))
    parametric = fit_parametric(runs, bootstrap=bootstrap)
    paths = write_plots(runs, isoflop, parametric, output, predict)
    for path in paths:
        stdout.print(f"wrote {path}")
