"""The trainer through its library API: phases, chained runs, a moved end step, metrics."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from keel.core.errors import UsageError
from keel.model.config import ModelConfig
from keel.train.config import DataSource, Phase, TrainConfig
from keel.train.schedule import ScheduleConfig
from keel.train.trainer import train

SMALL = ModelConfig(
    vocab_size=512,
    d_model=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    ffn_dim=64,
    n_routed_experts=4,
    top_k=2,
    expert_ffn_dim=32,
)


def config(cache: str, **changes) -> TrainConfig:
    base = TrainConfig(
        model=SMALL,
        data=(DataSource(cache),),
        phases=(Phase(seq_len=32, schedule=ScheduleConfig(peak_lr=3e-3, warmup_steps=2)),),
        batch_size=4,
        steps=8,
        eval_every=4,
        eval_batches=1,
        checkpoint_every=4,
    )
    return replace(base, **changes)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_phases_run_back_to_back_with_their_own_sequence_length_and_schedule(
    wikitext_cache, tmp_path
):
    short = Phase("short", tokens=4 * 16 * 6, seq_len=16, schedule=ScheduleConfig(warmup_steps=2))
    rewarm = ScheduleConfig(
        kind="linear", peak_lr=1e-3, warmup_steps=2, warmup_from=0.5, final_fraction=0.1
    )
    long = Phase("long", tokens=4 * 32 * 4, seq_len=32, schedule=rewarm)
    run = config(wikitext_cache, phases=(short, long), steps=0)
    result = train(run, str(tmp_path))
    metrics = rows(tmp_path)
    assert [row["phase"] for row in metrics] == ["short"] * 6 + ["long"] * 4
    assert result.steps == 10 and metrics[-1]["step"] == 10
    assert metrics[6]["lr"] == pytest.approx(0.5e-3)  # the second phase re-warms from half
    assert metrics[7]["lr"] == pytest.approx(0.75e-3)
    assert metrics[-1]["lr"] == pytest.approx(0.55e-3)  # linear decay toward 0.1e-3 at step 10
    assert {"eval_loss", "eval_bpb"} <= metrics[3].keys()  # every eval_every steps
    router = metrics[0]["router"]
    assert len(router["load"]) == SMALL.n_moe_layers and len(router["load"][0]) == 4
    assert sum(router["load"][0]) == 4 * 16 * SMALL.top_k  # tokens x top_k selections


def test_more_steps_on_resume_extend_the_run_without_re_warming(wikitext_cache, tmp_path):
    first = train(config(wikitext_cache, steps=8), str(tmp_path))
    assert first.resumed_from is None
    before = rows(tmp_path)
    longer = train(config(wikitext_cache, steps=12), str(tmp_path))
    assert longer.resumed_from == 8
    after = rows(tmp_path)
    assert after[:8] == before  # the first eight steps stay as they were
    assert [row["step"] for row in after] == list(range(1, 13))
    # the run had decayed to its final lr (0.1 x peak) at step 8: the longer plan goes on from
    # there, never back up to the peak (re-warming is a new phase's; keel/train/replan.py)
    assert before[-1]["lr"] < 3e-3
    assert [row["lr"] for row in after[8:]] == pytest.approx([0.3e-3] * 4)


def test_init_from_starts_a_new_run_from_another_runs_parameters(wikitext_cache, tmp_path):
    train(config(wikitext_cache), str(tmp_path / "a"))
    fresh = train(config(wikitext_cache, steps=2), str(tmp_path / "fresh"))
    chained = train(
        config(wikitext_cache, steps=2, init_from=str(tmp_path / "a")), str(tmp_path / "b")
    )
    assert chained.last["loss"] < fresh.last["loss"] - 0.3
    with pytest.raises(UsageError, match="holds no checkpoint"):
        train(config(wikitext_cache, init_from=str(tmp_path / "none")), str(tmp_path / "c"))


def test_a_run_directory_refuses_another_model(wikitext_cache, tmp_path):
    train(config(wikitext_cache, steps=2), str(tmp_path))
    other = config(wikitext_cache, steps=2, model=replace(SMALL, d_model=64))
    with pytest.raises(UsageError, match=r"model.d_model \(\d+ -> 64\) changes the parameters"):
        train(other, str(tmp_path))


def test_a_dense_model_trains_checkpoints_and_resumes(wikitext_cache, tmp_path):
    dense = config(wikitext_cache, model=replace(SMALL, n_routed_experts=0), steps=4)
    first = train(dense, str(tmp_path))
    assert "router" not in first.last and first.last["step"] == 4
    assert (tmp_path / "checkpoints" / "4").is_dir()
    longer = train(replace(dense, steps=6), str(tmp_path))
    assert longer.resumed_from == 4 and longer.last["step"] == 6
    again = train(replace(dense, steps=6), str(tmp_path))  # finished: nothing runs
    assert again.resumed_from == 6 and again.last == longer.last
    assert json.loads((tmp_path / "result.json").read_text()) == longer.last
