"""Approaches 2 and 3 recover a known Chinchilla law from synthetic runs; bad input fails clearly.

Synthetic data: L = 1.69 + 406.4/N^0.34 + 410.7/D^0.28 (Hoffmann et al. 2022) times exp(0.002·ε),
5 budgets 1e18..1e21 FLOPs, 9 sizes per budget spanning N*/4..4N* (log-spaced), D = C/(6N).
Tolerances (docs/scaling.md): isoflop a, b within 0.015; parametric E within 0.03 nats, α, β
within 0.02, A, B within 25%, a, b within 0.015; predicted N*, D* at 1e23 FLOPs within 10% and
loss within 1%.
"""

import math

import numpy as np
import pytest

from keel.core.errors import UsageError
from keel.scaling.fits import fit_isoflop, fit_parametric, group_budgets, load_runs, make_runs

TRUE = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
ALPHA, BETA = TRUE["alpha"], TRUE["beta"]
TRUE_A = BETA / (ALPHA + BETA)
G = (ALPHA * TRUE["A"] / (BETA * TRUE["B"])) ** (1 / (ALPHA + BETA))
BUDGETS = np.logspace(18, 21, 5)


def true_loss(n, d):
    return TRUE["E"] + TRUE["A"] / n**ALPHA + TRUE["B"] / d**BETA


def true_optimum(flops):
    n = G * (flops / 6) ** TRUE_A
    d = flops / (6 * n)
    return n, d, true_loss(n, d)


def synthetic(noise=0.002, seed=0, budgets=BUDGETS, sizes=9, span=4.0):
    rng = np.random.default_rng(seed)
    rows = []
    for flops in budgets:
        n_opt = true_optimum(flops)[0]
        for n in np.geomspace(n_opt / span, n_opt * span, sizes):
            d = flops / (6 * n)
            rows.append((n, d, true_loss(n, d) * math.exp(noise * rng.standard_normal())))
    return [list(column) for column in zip(*rows, strict=True)]


@pytest.fixture(scope="module")
def runs():
    return make_runs(*synthetic())


@pytest.fixture(scope="module")
def isoflop(runs):
    return fit_isoflop(runs, bootstrap=50)


@pytest.fixture(scope="module")
def parametric(runs):
    return fit_parametric(runs, bootstrap=20)


def test_isoflop_recovers_exponents(isoflop):
    assert len(isoflop.budgets) == 5
    assert abs(isoflop.a - TRUE_A) < 0.015
    assert abs(isoflop.b - (1 - TRUE_A)) < 0.015
    assert isoflop.a_interval[0] <= isoflop.a <= isoflop.a_interval[1]
    for budget in isoflop.budgets:
        n, d, _ = true_optimum(budget.flops)
        assert budget.n_opt == pytest.approx(n, rel=0.1)
        assert budget.d_opt == pytest.approx(d, rel=0.1)


def test_parametric_recovers_parameters(parametric):
    assert abs(parametric.E - TRUE["E"]) < 0.03
    assert abs(parametric.alpha - ALPHA) < 0.02
    assert abs(parametric.beta - BETA) < 0.02
    assert abs(parametric.A / TRUE["A"] - 1) < 0.25
    assert abs(parametric.B / TRUE["B"] - 1) < 0.25
    assert abs(parametric.a - TRUE_A) < 0.015
    assert parametric.a + parametric.b == pytest.approx(1.0)


@pytest.mark.parametrize("method", ["isoflop", "parametric"])
def test_predictions_at_larger_budget(method, isoflop, parametric):
    fit = isoflop if method == "isoflop" else parametric
    prediction = fit.predict(1e23)
    n, d, loss = true_optimum(1e23)
    assert prediction.n_opt == pytest.approx(n, rel=0.1)
    assert prediction.d_opt == pytest.approx(d, rel=0.1)
    assert prediction.loss == pytest.approx(loss, rel=0.01)
    for value, (low, high) in [
        (prediction.n_opt, prediction.n_interval),
        (prediction.d_opt, prediction.d_interval),
        (prediction.loss, prediction.loss_interval),
    ]:
        assert low <= value <= high


def test_budgets_grouped_by_gaps_or_given():
    flops = np.array([1e18, 1.05e18, 0.97e18, 1e19, 1.1e19, 3e19])
    assert [rows.tolist() for _, rows in group_budgets(flops)] == [[0, 1, 2], [3, 4], [5]]
    groups = group_budgets(flops, [1e18, 1e19])
    assert [c for c, _ in groups] == [1e18, 1e19]
    assert [rows.tolist() for _, rows in groups] == [[0, 1, 2], [3, 4]]  # 3e19 is ignored


def test_too_few_points_names_the_budget():
    params, tokens, loss = synthetic()
    keep = [i for i in range(len(loss)) if not 9 <= i < 16]  # budget 2 keeps 2 runs
    runs = make_runs(*([column[i] for i in keep] for column in (params, tokens, loss)))
    with pytest.raises(UsageError, match=r"5\.62e\+18 FLOPs has 2 runs.*--method parametric"):
        fit_isoflop(runs, bootstrap=1)


def test_no_interior_minimum_names_the_budget():
    params, tokens, loss = synthetic()
    loss[9:18] = sorted(loss[9:18])  # budget 2: loss now lowest at its smallest model
    with pytest.raises(UsageError, match=r"budget 5\.62e\+18 FLOPs: .* smallest model"):
        fit_isoflop(make_runs(params, tokens, loss), bootstrap=1)


@pytest.mark.parametrize(
    ("column", "value"), [("loss", math.nan), ("params", 0.0), ("tokens", -5.0), ("loss", math.inf)]
)
def test_bad_values_name_the_row(column, value):
    params, tokens, loss = synthetic()
    columns = {"params": params, "tokens": tokens, "loss": loss}
    columns[column][6] = value
    with pytest.raises(UsageError, match=rf"row 7 \(line 8\): {column} is"):
        make_runs(**columns)


def test_csv_errors(tmp_path):
    missing = tmp_path / "missing.csv"
    missing.write_text("params,loss\n1e8,3.0\n")
    with pytest.raises(UsageError, match="missing column 'tokens'"):
        load_runs(missing)
    text = tmp_path / "text.csv"
    text.write_text("params,tokens,loss\n1e8,2e9,3.0\n1e8,2e9,oops\n")
    with pytest.raises(UsageError, match=r"row 2 \(line 3\): loss is 'oops'"):
        load_runs(text)
    with pytest.raises(UsageError, match="no such file"):
        load_runs(tmp_path / "absent.csv")


def test_flops_column_is_used(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("params,tokens,loss,flops\n1e8,2e9,3.0,1.3e18\n")
    assert load_runs(path).flops.tolist() == [1.3e18]
    assert make_runs([1e8], [2e9], [3.0]).flops.tolist() == [1.2e18]
