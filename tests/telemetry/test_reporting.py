"""The trainer's metrics and flow's stage counters land in the telemetry store when configured."""

import json
from dataclasses import replace

from keel.flow import from_items
from keel.model.config import ModelConfig
from keel.telemetry import TelemetryStore
from keel.train.config import DataSource, Phase, TrainConfig
from keel.train.schedule import ScheduleConfig
from keel.train.trainer import train

TINY = ModelConfig(
    vocab_size=512, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64,
    n_routed_experts=4, top_k=2, expert_ffn_dim=32,
)  # fmt: skip


def test_training_metrics_are_queryable_by_run_step_and_name(wikitext_cache, tmp_path):
    store = tmp_path / "telemetry"
    config = TrainConfig(
        model=TINY,
        data=(DataSource(wikitext_cache),),
        phases=(Phase(seq_len=32, schedule=ScheduleConfig(warmup_steps=1)),),
        batch_size=4,
        steps=3,
        eval_every=3,
        eval_batches=1,
        checkpoint_every=3,
        telemetry=str(store),
    )
    run = tmp_path / "run"
    train(config, str(run))
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    reader = TelemetryStore(store)
    loss = reader.query(
        f"SELECT step, value FROM \"train.metrics\" WHERE run = '{run}' AND name = 'loss' "
        "ORDER BY step"
    ).to_pylist()
    assert loss == [{"step": line["step"], "value": line["loss"]} for line in lines]
    names = set(
        reader.query('SELECT DISTINCT name FROM "train.metrics"').column("name").to_pylist()
    )
    assert {"lr", "grad_norm", "router.drop_rate.0", "router.drop_rate.1"} <= names
    train(replace(config, steps=4), str(run))  # a resumed run appends to the same namespace
    steps = reader.query(f"SELECT max(step) AS s FROM \"train.metrics\" WHERE run = '{run}'")
    assert steps.column("s").to_pylist() == [4]


def test_flow_writes_one_row_of_counters_per_stage(tmp_path):
    store = tmp_path / "telemetry"
    rows = (
        from_items([{"k": i % 5, "n": i} for i in range(100)], num_shards=2)
        .filter(lambda r: r["n"] % 2 == 0)
        .deduplicate("k")
        .to_table(workers=1, telemetry=str(store))
    )
    assert rows.num_rows == 5
    stages = (
        TelemetryStore(store)
        .query('SELECT stage, rows_in, rows_out FROM "flow.stage" ORDER BY stage')
        .to_pylist()
    )
    assert stages[0] == {"stage": 0, "rows_in": 100, "rows_out": 50}
    assert stages[-1]["rows_out"] == 5
