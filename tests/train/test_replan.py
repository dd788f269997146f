"""Resuming with another length re-plans the learning rate from where the run stands: no jump at
the resume step, never rising after it, final_fraction x peak at the new end."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mesh_support import small_dense

from keel.core.config import dump_config
from keel.core.errors import UsageError
from keel.train.config import TrainConfig
from keel.train.events import read_events
from keel.train.replan import resume_schedule
from keel.train.schedule import piecewise_lr
from keel.train.trainer import train

PEAK, FINAL = 3e-3, 0.05


class Stop(Exception):
    """Ends a run from its step callback, as a kill would (after the step's checkpoint)."""


def planned(steps: int) -> TrainConfig:
    """tiny-dense cut down to seconds: 1 layer, 4 x 64 tokens a step, wsd decaying over the
    last half, ending at 5% of the peak."""
    config = small_dense(
        "phases.0.schedule.decay_fraction=0.5",
        f"phases.0.schedule.final_fraction={FINAL}",
        f"phases.0.schedule.peak_lr={PEAK}",
    )
    return replace(config, steps=steps, eval_every=1000, eval_batches=1, checkpoint_every=45)


def lrs(schedule, first: int, last: int) -> np.ndarray:
    return np.asarray(schedule(np.arange(first, last + 1)))


def _schedule(tmp_path: Path, before: int, after: int, at: int, replans: list | None = None):
    if replans:
        (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in replans))
    return resume_schedule(planned(after), str(tmp_path), planned(before), at)


@pytest.mark.parametrize(("after", "at"), [(70, 45), (150, 45), (150, 60), (70, 60)])
def test_the_lr_continues_from_where_the_run_stands_and_ends_at_the_final_fraction(
    tmp_path, after, at
):
    schedule, event = _schedule(tmp_path, 100, after, at)
    old = piecewise_lr(planned(100).segments())
    new = lrs(schedule, at, after)
    assert new[0] == pytest.approx(float(old(at)), rel=1e-6)  # no jump at the resume step
    assert np.all(np.diff(new) <= 1e-9)  # never rises after it
    assert new[-1] == pytest.approx(FINAL * PEAK, rel=1e-5)  # 5% of the peak at the new end
    assert event["step"] == at and event["old"]["total_steps"] == 100
    assert event["new"]["total_steps"] == after
    # Shortened into the decay, or resumed while already decaying: the lr decays from where it
    # stands; lengthened from the stable part: the configured schedule runs on to its new end.
    assert (event["anchor"] is None) == ((after, at) == (150, 45))


def test_a_second_resume_under_the_same_plan_keeps_the_re_plan(tmp_path):
    schedule, event = _schedule(tmp_path, 100, 70, 60)
    again, none = _schedule(tmp_path, 70, 70, 65, replans=[event])
    assert none is None
    np.testing.assert_allclose(lrs(again, 60, 70), lrs(schedule, 60, 70), rtol=1e-6)


def test_a_plan_that_ends_behind_the_run_is_refused(tmp_path):
    with pytest.raises(UsageError, match="stands at step 60; a plan of 50 steps ends before it"):
        _schedule(tmp_path, 100, 50, 60)


def test_a_run_resumed_with_fewer_steps_follows_the_re_plan(wikitext_cache, tmp_path):
    """100 steps planned, checkpointed at 45 and stopped; resumed with --steps 70."""
    output = str(tmp_path / "run")
    first = planned(100).with_data((wikitext_cache,))

    def stop_at_45(line: dict) -> None:
        if line["step"] == 45:
            raise Stop  # the checkpoint at 45 is written before this callback

    with contextlib.suppress(Stop):
        train(first, output, on_step=stop_at_45)
    resumed = replace(first, steps=70)
    train(resumed, output)
    lines = [json.loads(line) for line in Path(output, "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 71))
    after = np.array([line["lr"] for line in lines[45:]])  # steps 46..70 use lr(45..69)
    assert after[0] == pytest.approx(float(piecewise_lr(first.segments())(45)), rel=1e-6)
    assert np.all(np.diff(after) <= 1e-9)
    (event,) = read_events(output, "replan")
    assert event["step"] == 45 and event["anchor"]["end"] == 70
    dump_config(resumed, str(tmp_path / "resumed.yaml"))  # the run dir's config is the new plan
    assert Path(output, "config.yaml").read_text() == (tmp_path / "resumed.yaml").read_text()
