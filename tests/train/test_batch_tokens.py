"""Batches in tokens: a phase's batch_tokens keeps the tokens per step when seq_len grows, its
loader draws every window of an epoch once, and a seq_len that does not divide it is an error."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from mesh_support import metrics, small_dense

from keel.core.errors import ConfigError
from keel.train.layout import check_mesh
from keel.train.loader import MixtureLoader
from keel.train.trainer import open_run_data, train

BATCH_TOKENS = 1024


def growing(cache: str, steps: tuple[int, int] = (3, 2)):
    """`steps[0]` steps at 128 tokens a sequence, then `steps[1]` at 512, 1024 tokens a step."""
    config = small_dense()
    first = replace(config.phases[0], seq_len=128, batch_tokens=BATCH_TOKENS)
    first = replace(first, tokens=steps[0] * BATCH_TOKENS)
    first = replace(first, schedule=replace(first.schedule, warmup_steps=1))
    second = replace(first, name="long", seq_len=512, tokens=steps[1] * BATCH_TOKENS)
    config = replace(config, phases=(first, second), steps=0, eval_every=1000)
    return config.with_data((cache,))


def test_tokens_per_step_stay_constant_when_seq_len_grows(wikitext_cache, tmp_path):
    config = growing(wikitext_cache)
    assert config.validate().phase_steps() == [3, 2]
    train(config, str(tmp_path / "run"))
    lines = metrics(tmp_path / "run")
    assert [line["phase"] for line in lines] == ["main"] * 3 + ["long"] * 2
    tokens = [line["tokens_per_s"] * line["step_s"] for line in lines]
    np.testing.assert_allclose(tokens, [BATCH_TOKENS] * 5, rtol=1e-6)
    short, long = open_run_data(config).phases
    assert short.loader.batch(0).shape == (8, 129) and long.loader.batch(0).shape == (2, 513)


def test_no_window_is_drawn_twice_in_an_epoch_of_the_longer_phase(wikitext_cache):
    config = growing(wikitext_cache)
    loader = open_run_data(config).phases[1].loader
    (windows,) = loader.ranges
    n = len(windows)
    one_by_one = MixtureLoader([(windows, 1.0)], batch_size=1, seed=loader.seed)
    order = np.concatenate([one_by_one.indices(g)[1] for g in range(n)])
    assert sorted(order.tolist()) == list(range(windows.start, windows.stop))  # one epoch
    drawn = np.concatenate([loader.indices(step)[1] for step in range(n // 2)])
    assert len(set(drawn.tolist())) == len(drawn)  # no window twice in the epoch
    assert drawn.tolist() == order[: len(drawn)].tolist()  # in the loader's own order


def test_batch_tokens_that_seq_len_does_not_divide_is_a_config_error(wikitext_cache):
    config = growing(wikitext_cache)
    bad = replace(config, phases=(config.phases[0], replace(config.phases[1], seq_len=384)))
    with pytest.raises(ConfigError, match=r"batch_tokens \(1024\) must be a multiple of seq_len"):
        bad.validate()


def test_a_phase_whose_sequences_do_not_split_over_the_devices_is_named(wikitext_cache):
    config = growing(wikitext_cache).validate()  # the 512 phase: 2 sequences a step
    assert check_mesh(config, 2) == (2, 1, 1)
    with pytest.raises(ConfigError, match=r"phase 'long'.*batch_tokens // seq_len \(2\).* = 4"):
        check_mesh(config, 4)
