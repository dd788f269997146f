"""The step loop never makes the devices wait for the host: no metric of step k is read before
step k + 1 is dispatched, except at the steps that evaluate or checkpoint, which finish (metrics
line first, then checkpoint) before the next update takes their state."""

import json
from dataclasses import replace

import jax
import numpy as np

from keel.model.config import ModelConfig
from keel.train import trainer
from keel.train.config import DataSource, Phase, TrainConfig
from keel.train.schedule import ScheduleConfig

DENSE = ModelConfig(
    vocab_size=512, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64
)


def tiny(cache: str) -> TrainConfig:
    """Six steps; a checkpoint at step 3, and at step 6 (the end) a checkpoint and evaluation."""
    return TrainConfig(
        model=DENSE,
        data=(DataSource(cache),),
        phases=(Phase(seq_len=16, schedule=ScheduleConfig(warmup_steps=1)),),
        batch_size=2,
        steps=6,
        eval_every=6,
        eval_batches=1,
        checkpoint_every=3,
    )


class Watched:
    """A metric array that notes the first time the host reads it (waits for it, converts it
    or copies it). jax's device-to-host transfer guard cannot tell here: on CPU the device's
    memory is the host's, so reading an array is not a transfer."""

    def __init__(self, array: jax.Array, step: int, events: list) -> None:
        self.array, self.step, self.events = array, step, events

    def _read(self) -> jax.Array:
        if ("read", self.step) not in self.events:
            self.events.append(("read", self.step))
        return self.array

    def block_until_ready(self):
        self._read().block_until_ready()
        return self

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._read(), dtype=dtype)

    def __float__(self) -> float:
        return float(self._read())

    def item(self):
        return self._read().item()

    def tolist(self):
        return self._read().tolist()


def test_no_metric_of_step_k_is_read_before_step_k_plus_1_is_dispatched(
    wikitext_cache, tmp_path, monkeypatch
):
    events: list[tuple[str, int]] = []
    build = trainer.build_step_functions

    def instrumented(*args, **kwargs):
        functions = build(*args, **kwargs)

        def update(state, window):
            step = sum(kind == "dispatch" for kind, _ in events) + 1
            events.append(("dispatch", step))
            state, metrics = functions.update(state, window)
            return state, jax.tree.map(lambda array: Watched(array, step, events), metrics)

        return replace(functions, update=update)

    monkeypatch.setattr(trainer, "build_step_functions", instrumented)
    result = trainer.train(
        tiny(wikitext_cache),
        str(tmp_path),
        on_step=lambda line: events.append(("line", line["step"])),
    )

    dispatch, read, line = "dispatch", "read", "line"
    assert events == [
        (dispatch, 1),
        (dispatch, 2), (read, 1), (line, 1),
        (dispatch, 3), (read, 2), (line, 2),
        (read, 3), (line, 3),  # a checkpoint step: saved, line first, before step 4 takes its state
        (dispatch, 4),
        (dispatch, 5), (read, 4), (line, 4),
        (dispatch, 6), (read, 5), (line, 5),
        (read, 6), (line, 6),
    ]  # fmt: skip
    rows = [json.loads(text) for text in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert all(row["step_s"] > 0 and row["tokens_per_s"] > 0 for row in rows)
    assert "eval_bpb" in rows[-1] and result.last == rows[-1]
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["3", "6"]
