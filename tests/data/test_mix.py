"""Mixing document sets by token weight, with epochs when a source is smaller than its share."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
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


def test_a_glob_source_is_named_by_its_directory_and_pattern(sources, tmp_path):
    globs = [MixSource(str(sources / name / "part-*.parquet"), 1.0) for name in ("web", "books")]
    report = run_mix(MixConfig(tuple(globs)), str(tmp_path / "mix"), RunOptions(workers=1))
    names = [plan["name"] for plan in report.details["sources"]]
    assert names == ["web/part-*.parquet", "books/part-*.parquet"]


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


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """Bundled Wikipedia articles and Python docs pages (raw HTML), embedded into 2 clusters by the
    embed stage (real text: the two kinds fall into different clusters)."""
    from keel.data.embed import EmbedConfig, run_embed

    root = tmp_path_factory.mktemp("embedded")
    sample = Path(__file__).resolve().parents[2] / "keel" / "experiments" / "sample"
    rows = []
    for name in ("wikitext2", "pydocs"):
        with gzip.open(sample / f"{name}.jsonl.gz", "rt", encoding="utf-8") as lines:
            for number, line in enumerate(lines):
                text = json.loads(line).get("text") or json.loads(line).get("html")
                rows.append({"id": document_id(f"{name}{number}"), "text": text, "kind": name})
    with LocalBackend(workers=2) as pool:
        from_items(rows, 2).write_parquet(root / "docs", backend=pool)
        run_embed(
            str(root / "docs"),
            str(root / "embedded"),
            EmbedConfig(clusters=2, dimension=32),
            RunOptions(backend=pool),
        )
    return root / "embedded"


def _cluster_mix(embedded, tmp_path, weights, **config):
    source = MixSource(str(embedded), 1.0, name="docs", cluster_weights=weights)
    with LocalBackend(workers=2) as pool:
        report = run_mix(
            MixConfig((source,), **config), str(tmp_path / "mix"), RunOptions(backend=pool)
        )
    parts = sorted((tmp_path / "mix").glob("part-*.parquet"))
    table = pa.concat_tables([pq.read_table(part) for part in parts])
    return {plan["name"]: plan for plan in report.details["sources"]}, table


def test_mixing_by_the_embed_stages_clusters_weights_each_cluster(embedded, tmp_path):
    """Multipliers 1 take the set as it is, split by cluster; 0 leaves a cluster out; 3 gives a
    cluster three times its natural share of the tokens (repeating it under a target)."""
    natural, table = _cluster_mix(embedded, tmp_path / "natural", ((0, 1.0),))
    assert set(natural) == {"docs#0", "docs#1"}
    assert all(plan["epochs"] == pytest.approx(1.0) for plan in natural.values())
    assert table.num_rows == pq.read_table(sorted(embedded.glob("part-*.parquet"))).num_rows
    assert set(table.column("mix_source").to_pylist()) == {"docs#0", "docs#1"}
    for name in ("docs#0", "docs#1"):
        rows = table.filter(pc.equal(table.column("mix_source"), name))
        assert set(rows.column("cluster").to_pylist()) == {int(name[-1])}

    plans, table = _cluster_mix(embedded, tmp_path / "only1", ((0, 0.0),))
    assert set(plans) == {"docs#1"} and set(table.column("cluster").to_pylist()) == {1}

    tokens = {name: plan["tokens_available"] for name, plan in natural.items()}
    total = tokens["docs#0"] + tokens["docs#1"]
    plans, _ = _cluster_mix(embedded, tmp_path / "triple", ((1, 3.0),), total_tokens=total)
    expected = 3 * tokens["docs#1"] / (tokens["docs#0"] + 3 * tokens["docs#1"])
    taken = plans["docs#1"]["tokens_target"] / total
    assert taken == pytest.approx(expected, rel=0.01)
    assert plans["docs#1"]["epochs"] > 1.0 > plans["docs#0"]["epochs"]


def test_cluster_weights_need_the_cluster_column_and_known_clusters(sources, embedded, tmp_path):
    with pytest.raises(UsageError, match=r"no cluster column.*keel data embed"):
        run_mix(
            MixConfig((MixSource(str(sources / "web"), 1.0, cluster_weights=((0, 2.0),)),)),
            str(tmp_path / "a"),
        )
    with pytest.raises(UsageError, match="no documents in cluster 7"):
        _cluster_mix(embedded, tmp_path / "b", ((7, 2.0),))
    with pytest.raises(UsageError, match="every cluster has weight 0"):
        _cluster_mix(embedded, tmp_path / "c", ((0, 0.0), (1, 0.0)))


def test_the_mix_command_weights_clusters(embedded, tmp_path):
    output = tmp_path / "mix"
    command = ["mix", "--source", f"{embedded}=1", "--cluster-weight", "0=0"]
    done = subprocess.run(
        [sys.executable, "-m", "keel", "data", *command, "--output", str(output), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    sources = json.loads((output / "mix.json").read_text())["sources"]
    assert [plan["name"] for plan in sources] == [f"{embedded.name}#1"]
