"""Mixing document sets by token weight, with epochs when a source is smaller than its share."""

import json

import pyarrow.parquet as pq
import pytest

from keel.core.errors import UsageError
from keel.data.documents import document_id
from keel.data.mix import MixConfig, MixSource, run_mix
from keel.flow import LocalBackend, RunOptions, from_items

COLUMNS = ["mix_source", "epoch"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    with LocalBackend(workers=2) as pool:
        for name, count in (("web", 400), ("books", 50)):
            rows = [
                {"id": document_id(f"{name}{i}"), "text": f"{name} {i} " * 50, "source": name}
                for i in range(count)
            ]
            from_items(rows, 2).write_parquet(root / name, backend=pool)
    return root


def _mix(sources, tmp_path, **config):
    with LocalBackend(workers=2) as pool:
        mixed = MixConfig(
            (MixSource(str(sources / "web"), 3.0), MixSource(str(sources / "books"), 1.0)),
            **config,
        )
        report = run_mix(mixed, str(tmp_path / "mix"), RunOptions(backend=pool))
    parts = sorted((tmp_path / "mix").glob("part-*.parquet"))
    rows = [row for part in parts for row in pq.read_table(part, columns=COLUMNS).to_pylist()]
    return report, rows


def test_without_a_target_no_source_repeats_and_weights_hold(sources, tmp_path):
    report, rows = _mix(sources, tmp_path)
    plans = {plan["name"]: plan for plan in report.details["sources"]}
    assert plans["books"]["epochs"] == pytest.approx(1.0)
    assert plans["web"]["epochs"] < 1.0
    share = plans["web"]["tokens_taken"] / (
        plans["web"]["tokens_taken"] + plans["books"]["tokens_taken"]
    )
    assert share == pytest.approx(0.75, abs=0.05)
    assert max(row["epoch"] for row in rows) == 0
    assert report.documents_out == len(rows)


def test_a_small_source_is_repeated_with_epoch_accounting(sources, tmp_path):
    books_tokens = _mix(sources, tmp_path / "probe")[0].details["sources"][1]["tokens_available"]
    report, rows = _mix(sources, tmp_path, total_tokens=int(books_tokens * 4 * 2.5))
    books = next(plan for plan in report.details["sources"] if plan["name"] == "books")
    assert books["epochs"] == pytest.approx(2.5)
    epochs = [row["epoch"] for row in rows if row["mix_source"] == "books"]
    assert epochs.count(0) == epochs.count(1) == 50 and 15 <= epochs.count(2) <= 35
    written = json.loads((tmp_path / "mix" / "mix.json").read_text())
    assert written == report.details


def test_bad_configs_are_usage_errors(sources, tmp_path):
    with pytest.raises(UsageError, match="at least one source"):
        run_mix(MixConfig(()), str(tmp_path / "x"))
    with pytest.raises(UsageError, match="positive"):
        run_mix(MixConfig((MixSource(str(sources / "web"), 0.0),)), str(tmp_path / "x"))
