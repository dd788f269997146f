"""A phase's own RoPE base and scaling: applied from the phase's first step, and allowed to
change on resume (the resumed run then equals one that had the setting from the start)."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

import numpy as np
from mesh_support import metrics, small_dense

from keel.train.trainer import train


class Stop(Exception):
    """Ends a run from its step callback, after that step's checkpoint."""


def two_phases(cache: str, **longer_rope):
    """3 steps at 32 tokens, then 2 at 128 with `longer_rope` (a Phase's rope_* fields)."""
    config = small_dense("model.rope_original_len=32")
    first = replace(config.phases[0], seq_len=32, tokens=3 * 4 * 32)
    first = replace(first, schedule=replace(first.schedule, warmup_steps=1))
    second = replace(first, name="long", seq_len=128, tokens=2 * 4 * 128, **longer_rope)
    config = replace(config, phases=(first, second), steps=0, eval_every=1000, checkpoint_every=3)
    return config.with_data((cache,))


def losses(output: Path) -> list[float]:
    return [line["loss"] for line in metrics(output)]


def test_a_phase_scales_rope_from_its_first_step_and_may_gain_it_on_resume(
    wikitext_cache, tmp_path
):
    yarn = two_phases(wikitext_cache, rope_scaling="yarn", rope_factor=4.0)
    plain = two_phases(wikitext_cache)
    train(yarn, str(tmp_path / "yarn"))
    train(plain, str(tmp_path / "plain"))
    with_yarn, without = losses(tmp_path / "yarn"), losses(tmp_path / "plain")
    assert with_yarn[:3] == without[:3]  # the first phase is untouched
    assert abs(with_yarn[3] - without[3]) > 1e-4  # the second one reads positions otherwise

    def stop_after_first_phase(line: dict) -> None:
        if line["step"] == 3:
            raise Stop

    resumed = tmp_path / "resumed"
    with contextlib.suppress(Stop):
        train(plain, str(resumed), on_step=stop_after_first_phase)
    result = train(yarn, str(resumed))  # the scaling arrives with the resume
    assert result.resumed_from == 3
    np.testing.assert_allclose(losses(resumed), with_yarn, rtol=1e-5)
