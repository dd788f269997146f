"""Changes on resume: the batch size (the data continuing at the first sequence not yet drawn),
a phase appended with its own mixture, model settings that keep every parameter's shape; a
shape-changing setting is refused naming it."""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mesh_support import small_dense

from keel.core.config import apply_overrides
from keel.core.errors import UsageError
from keel.train.config import DataSource, Phase
from keel.train.events import read_events
from keel.train.loader import MixtureLoader, check_cache, split_windows
from keel.train.midrun import data_positions
from keel.train.trainer import open_run_data, train


class Stop(Exception):
    """Ends a run from its step callback, after that step's checkpoint."""


def tiny(cache: str, steps: int = 20, batch: int = 4):
    config = small_dense("phases.0.schedule.warmup_steps=2")
    config = replace(config, steps=steps, batch_size=batch, eval_every=1000, checkpoint_every=10)
    return config.with_data((cache,))


def run_until(config, output: Path, step: int) -> None:
    def stop(line: dict) -> None:
        if line["step"] == step:
            raise Stop

    with contextlib.suppress(Stop):
        train(config, str(output), on_step=stop)


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def test_a_batch_change_draws_every_window_once_in_the_loaders_own_order(wikitext_cache):
    windows, _ = split_windows(check_cache(wikitext_cache, 512), 64, 0.05)
    n = len(windows)
    one_by_one = MixtureLoader([(windows, 1.0)], batch_size=1, seed=7)
    order = np.concatenate([one_by_one.indices(g)[1] for g in range(n)])
    assert len(set(order.tolist())) == n  # the loader's own permutation of the epoch
    before = MixtureLoader([(windows, 1.0)], batch_size=16, seed=7)
    change = 5  # steps at 16, then 24 from step 5 on, starting at sequence 80
    after = MixtureLoader([(windows, 1.0)], batch_size=24, seed=7, position=(change, 16 * change))
    drawn = [before.indices(step)[1] for step in range(change)]
    drawn += [after.indices(step)[1] for step in range(change, change + (n - 80) // 24)]
    drawn = np.concatenate(drawn)
    assert len(set(drawn.tolist())) == len(drawn)  # no window twice in the epoch
    assert drawn.tolist() == order[: len(drawn)].tolist()  # and none skipped


def test_a_run_resumed_with_another_batch_size_continues_its_data(wikitext_cache, tmp_path):
    output = tmp_path / "run"
    run_until(tiny(wikitext_cache, batch=4), output, 10)
    bigger = tiny(wikitext_cache, batch=6)
    result = train(bigger, str(output))
    assert result.last["step"] == 20 and result.resumed_from == 10
    assert [line["step"] for line in metrics(output)] == list(range(1, 21))
    (event,) = read_events(str(output), "batch")
    assert (event["step"], event["phase_step"], event["sequences"]) == (10, 10, 40)
    assert (event["from"], event["to"]) == (4, 6)
    positions, _ = data_positions(str(output), bigger, None, None)  # read back from the event
    assert positions == {0: (10, 40)}
    loader = open_run_data(bigger, positions).phases[0].loader
    one_by_one = MixtureLoader([(loader.ranges[0], 1.0)], 1, loader.seed)
    first_sequences = [one_by_one.indices(g)[1][0] for g in range(40, 46)]
    assert loader.indices(10)[1].tolist() == first_sequences  # step 11 reads sequences 40-45


def test_a_phase_appended_on_resume_draws_only_from_its_mixture(wikitext_cache, tmp_path):
    other = tmp_path / "other-cache"
    shutil.copytree(wikitext_cache, other)
    first = replace(tiny(wikitext_cache, batch=4), steps=0)
    first = replace(first, phases=(replace(first.phases[0], name="main", tokens=10 * 4 * 64),))
    output = tmp_path / "run"
    train(first, str(output))
    extra = Phase(
        name="more",
        tokens=5 * 4 * 64,
        mixture=(DataSource(str(other)),),
        seq_len=64,
        schedule=replace(first.phases[0].schedule, warmup_steps=1),
    )
    longer = replace(first, phases=(*first.phases, extra))
    result = train(longer, str(output))
    assert result.resumed_from == 10 and result.last["step"] == 15
    assert [line["phase"] for line in metrics(output)] == ["main"] * 10 + ["more"] * 5
    plan = open_run_data(longer).phases[1]
    assert plan.start == 10 and [cache.path for cache in plan.loader.caches] == [str(other)]


def test_shape_keeping_model_settings_may_change_and_shape_changing_ones_may_not(
    wikitext_cache, tmp_path
):
    output = tmp_path / "run"
    run_until(tiny(wikitext_cache, steps=12), output, 10)
    kept = apply_overrides(tiny(wikitext_cache, steps=12), ["model.rope_theta=20000"])
    assert train(kept, str(output)).last["step"] == 12
    wider = apply_overrides(tiny(wikitext_cache, steps=14), ["model.ffn_dim=512"])
    with pytest.raises(UsageError, match=r"model.ffn_dim \(\d+ -> 512\) changes the parameters"):
        train(wider, str(output))
