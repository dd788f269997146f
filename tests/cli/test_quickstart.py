"""`keel quickstart`: DataKit end to end on the bundled samples, as cached steps."""

import itertools
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cli_support import KeelCli
from quickstart_support import copy_quickstart_outputs, earlier_quickstart

from keel.data.token_cache import TokenCache
from keel.telemetry import TelemetryStore

pytestmark = pytest.mark.timeout(900)  # the module's first quickstart also trains tiny-moe

STEPS = [
    "ingest_wikitext",
    "ingest_pydocs",
    "ingest_crawl",
    "quality_examples",
    "quality_model",
    "quality",
    "filter",
    "exact_dedup",
    "fuzzy_dedup",
    "decontam",
    "tokenize",
    "train",
    "summary",
]


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """One quickstart run shared by the tests of this module. In CI it starts from a copy of the
    cold quickstart .ci/run has just run and checked (tests/quickstart_support.py), so it finds
    every step cached instead of training tiny-moe a second time; elsewhere it runs cold (minutes).
    """
    cli = KeelCli(tmp_path_factory.mktemp("quickstart"))
    if source := earlier_quickstart(checkout_fallback=False):
        copy_quickstart_outputs(source, cli.prefix)
    first = cli.run("quickstart", "--prefix", str(cli.prefix), timeout=600)
    assert first.returncode == 0, first.stderr
    # Read now: later tests add summaries of changed configs under the same prefix, and a glob
    # lists them in the order of their hashed names.
    cli.first_summary = _summary(cli.prefix)
    return cli, first


def _summary(prefix: Path, name: str = "summary-*") -> dict:
    return json.loads(next(prefix.glob(f"{name}/summary.json")).read_text())


def test_quickstart_runs_every_stage_and_accounts_for_every_document(done):
    cli, first = done
    assert "token cache:" in first.stdout and "dropped" in first.stdout
    summary = cli.first_summary
    stages = {stage["stage"]: stage for stage in summary["stages"]}
    assert stages["ingest"]["documents_out"] > 0
    chain = summary["stages"][3:]  # quality -> ... -> tokenize, each reading the previous one
    assert chain[0]["documents_in"] == sum(s["documents_out"] for s in summary["stages"][:3])
    for before, after in itertools.pairwise(chain):
        assert after["documents_in"] == before["documents_out"]
    for stage in summary["stages"]:
        dropped = sum(stage["dropped"].values())
        assert stage["documents_in"] - stage["documents_out"] == dropped, stage
    cache = TokenCache(summary["cache"])
    cache.verify()
    assert cache.manifest.total_tokens == summary["tokens"] > 100_000
    assert cache.manifest.documents == chain[-1]["documents_out"]


def test_every_cleaning_stage_removes_something_from_the_bundled_samples(done):
    """The bundled crawl holds exact and near duplicates and a page quoting the eval set: each
    stage shows its job in the summary, and the first screen says so."""
    cli, first = done
    stages = {stage["stage"]: stage for stage in cli.first_summary["stages"]}
    assert stages["exact_dedup"]["dropped"]["exact_duplicate"] >= 1
    assert stages["fuzzy_dedup"]["dropped"]["near_duplicate"] >= 3
    assert sum(stages["decontam"]["dropped"].values()) >= 1
    assert sum(stages["filter"]["dropped"].values()) >= 1
    for step in ("filter", "exact_dedup", "fuzzy_dedup", "decontam"):
        row = next(line for line in first.stdout.splitlines() if line.startswith(f"│ {step}-"))
        assert "│ -" not in row, row  # a drop, not the "-" of nothing dropped


def test_the_quality_classifier_trained_in_the_pipeline_drops_the_spam_page(done):
    """The crawl's keyword-spam page passes Gopher's heuristics; the classifier the quickstart
    trains scores it below the filter's 0.5 and the filter drops it for that reason alone,
    while every clean document keeps a score above it."""
    cli, _ = done
    filtered = next(cli.prefix.glob("filter-*"))
    report = json.loads((filtered / "stage.json").read_text())
    assert report["dropped"]["min_quality_score"] == 1
    (spam,) = report["dropped_sample"]["min_quality_score"]
    scored = pq.read_table(sorted(next(cli.prefix.glob("quality-*")).glob("part-*.parquet")))
    rows = {row["id"]: row for row in scored.to_pylist()}
    assert rows[spam]["url"] == "https://best-deals.example/top-10-reviews"
    assert rows[spam]["quality_score"] < 0.5
    clean = [row for row in rows.values() if row["source"] in ("wikitext2", "pydocs")]
    assert len(clean) == 70 and min(row["quality_score"] for row in clean) > 0.5
    model = json.loads((next(cli.prefix.glob("quality_model-*")) / "stage.json").read_text())
    assert model["details"]["holdout_auc"] > 0.9


def test_second_run_is_entirely_cached(done):
    cli, _ = done
    again = cli.run("quickstart", "--prefix", str(cli.prefix), "--json", timeout=600)
    assert json.loads(again.stdout) == {"executed": [], "cached": STEPS, "failed": []}


def test_a_threshold_change_reruns_from_that_stage_on(done):
    cli, _ = done
    changed = cli.run(
        "quickstart",
        "--prefix",
        str(cli.prefix),
        "--json",
        "--set",
        "filter.min_word_count=400",
        "--set",
        "train.steps=20",
        "--set",
        "train.phases.0.schedule.warmup_steps=5",
        timeout=600,
    )
    assert changed.returncode == 0, changed.stderr
    result = json.loads(changed.stdout)
    assert result["cached"] == STEPS[:6]
    assert result["executed"] == STEPS[6:]
    summaries = [json.loads(p.read_text()) for p in cli.prefix.glob("summary-*/summary.json")]
    strict = next(s for s in summaries if s["stages"][4]["dropped"].get("min_word_count", 0) > 5)
    assert strict["tokens"] < cli.first_summary["tokens"] or len(summaries) == 2


def test_every_command_has_help_with_an_example(cli):
    for command in ("run", "status", "quickstart"):
        result = cli.run(command, "--help")
        assert result.returncode == 0
        assert "Example" in result.stdout


def test_unknown_backend_is_a_usage_error(cli):
    result = cli.run("quickstart", "--prefix", str(cli.prefix), "--backend", "spark")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --backend 'spark': use one of local, ray"


@pytest.mark.ray
def test_quickstart_on_ray_writes_the_same_bytes_as_local(done):
    cli, _ = done
    ray_prefix = cli.root / "ray"
    short_training = ("--set", "train.steps=5", "--set", "train.phases.0.schedule.warmup_steps=1")
    args = ("quickstart", "--prefix", str(ray_prefix), "--backend", "ray", *short_training)
    on_ray = cli.run(*args, timeout=900)
    assert on_ray.returncode == 0, on_ray.stderr
    local_cache = next(cli.prefix.glob("tokenize-*"))
    ray_cache = ray_prefix / local_cache.name  # same step identity: same directory name
    for shard in [*sorted(local_cache.glob("*.bin")), local_cache / "manifest.json"]:
        assert (ray_cache / shard.name).read_bytes() == shard.read_bytes()


def test_tiny_moe_learns_well_below_the_unigram_entropy(done):
    cli, first = done
    summary = cli.first_summary
    train, unigram = summary["train"], summary["unigram_entropy"]
    assert train["step"] == 300
    assert train["loss"] < 0.75 * unigram, (train, unigram)
    assert train["eval_loss"] < unigram - 1.0, (train, unigram)
    assert 0.5 < train["eval_bpb"] < 3.0
    assert "bits/byte" in first.stdout
    metrics = Path(train["output"], "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 300


def test_training_metrics_and_flow_counters_land_in_the_telemetry_store(done):
    cli, first = done
    train = cli.first_summary["train"]
    store = TelemetryStore(cli.prefix / "telemetry")
    losses = store.query(
        f"SELECT step, value FROM \"train.metrics\" WHERE run = '{train['output']}' "
        "AND name = 'loss' ORDER BY step"
    )
    assert losses.column("step").to_pylist() == list(range(1, 301))
    assert losses.column("value").to_pylist()[-1] == pytest.approx(train["loss"])
    stages = store.query('SELECT count(*) AS n, sum(rows_in) AS rows FROM "flow.stage"')
    assert stages.column("n")[0].as_py() > 10 and stages.column("rows")[0].as_py() > 0
    assert f"metric rows of this run in {cli.prefix / 'telemetry'}" in first.stdout
