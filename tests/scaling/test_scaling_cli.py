"""`keel scaling fit` and `keel scaling plot` through the real command, as a user runs them."""

import csv
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from keel.cli import scaling_commands


def keel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "keel", *args], capture_output=True, text=True, timeout=120
    )


def write_runs(path, budgets=(1e18, 1e19, 1e20, 1e21), noise=0.002, seed=0):
    """Chinchilla's law (E=1.69, A=406.4, B=410.7, α=0.34, β=0.28), 7 sizes per budget."""
    rng = np.random.default_rng(seed)
    g = (0.34 * 406.4 / (0.28 * 410.7)) ** (1 / 0.62)
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["params", "tokens", "loss"])
        for flops in budgets:
            n_opt = g * (flops / 6) ** (0.28 / 0.62)
            for n in np.geomspace(n_opt / 4, n_opt * 4, 7):
                d = flops / (6 * n)
                loss = 1.69 + 406.4 / n**0.34 + 410.7 / d**0.28
                writer.writerow([n, d, loss * math.exp(noise * rng.standard_normal())])
    return path


@pytest.fixture(scope="module")
def runs_csv(tmp_path_factory):
    return write_runs(tmp_path_factory.mktemp("scaling") / "runs.csv")


def test_fit_isoflop_json(runs_csv):
    result = keel("scaling", "fit", str(runs_csv), "--method", "isoflop", "--json")
    assert result.returncode == 0, result.stderr
    fit = json.loads(result.stdout)
    assert set(fit) == {"a", "b", "budgets"}
    assert abs(fit["a"] - 0.28 / 0.62) < 0.02 and fit["a"] + fit["b"] == pytest.approx(1)
    assert [b["flops"] for b in fit["budgets"]] == pytest.approx([1e18, 1e19, 1e20, 1e21])
    assert set(fit["budgets"][0]) == {"flops", "n_opt", "d_opt", "loss_opt"}


def test_fit_parametric_json(runs_csv):
    result = keel(
        "scaling", "fit", str(runs_csv), "--method", "parametric", "--json", "--bootstrap", "5"
    )
    assert result.returncode == 0, result.stderr
    fit = json.loads(result.stdout)
    assert set(fit) == {"E", "A", "B", "alpha", "beta", "a", "b"}
    assert abs(fit["E"] - 1.69) < 0.03 and abs(fit["alpha"] - 0.34) < 0.02


def test_plot_writes_pngs(runs_csv, tmp_path):
    result = keel("scaling", "plot", str(runs_csv), "--output", str(tmp_path), "--bootstrap", "5")
    assert result.returncode == 0, result.stderr
    for name in ("isoflops.png", "optimal.png", "predicted_vs_actual.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def invoke(*args: str):
    return CliRunner().invoke(scaling_commands.app, list(args))


def test_budgets_and_predict(runs_csv):
    result = invoke("fit", str(runs_csv), "--budgets", "1e19,1e20,1e21", "--predict", "1e23")
    assert result.exit_code == 0, result.output
    assert "1e+18" not in result.output  # runs at 1e18 FLOPs are ignored
    assert "at C = 1e+23 FLOPs" in result.output and "loss =" in result.output
    json_result = invoke("fit", str(runs_csv), "--json", "--predict", "1e23", "--bootstrap", "20")
    prediction = json.loads(json_result.output)["prediction"]
    low, high = prediction["n_interval"]
    assert low <= prediction["n_opt"] <= high


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ("params,loss\n1e8,3\n", (), "missing column 'tokens'"),
        ("params,tokens,loss\n1e8,2e9,nan\n", (), "row 1 (line 2): loss is nan"),
        (None, ("--method", "mle"), "--method 'mle'"),
        (None, ("--budgets", "1e18,x"), "--budgets '1e18,x'"),
        (None, ("--budgets", "1e18,1e19,1e20,3e21"), "budget 3e+21 FLOPs has 0 runs"),
    ],
)
def test_user_errors_are_one_line(runs_csv, tmp_path, content, args, message):
    path = runs_csv
    if content is not None:
        path = tmp_path / "bad.csv"
        path.write_text(content)
    result = invoke("fit", str(path), *args)
    assert result.exit_code == 2
    assert message in result.output
    assert result.output.startswith("error:") and result.output.count("\n") == 1
