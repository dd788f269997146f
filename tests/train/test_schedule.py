"""Learning-rate schedules: warmup, the four kinds, moving end steps and phase segments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keel.core.errors import ConfigError
from keel.train.schedule import ScheduleConfig, Segment, piecewise_lr, segment_lr

PEAK = 1e-2


def lrs(steps: int, config: ScheduleConfig, upto: int) -> np.ndarray:
    """The segment's lr at local steps 0..upto-1, as float64 numpy."""
    return np.asarray(segment_lr(jnp.arange(upto), steps, config), np.float64)


def test_warmup_is_linear_from_warmup_from_to_peak():
    config = ScheduleConfig(peak_lr=PEAK, warmup_steps=10, warmup_from=0.25, kind="constant")
    got = lrs(100, config, 12)
    expected = PEAK * (0.25 + 0.75 * np.arange(11) / 10)
    np.testing.assert_allclose(got[:11], expected, rtol=1e-6)
    assert got[11] == pytest.approx(PEAK)


def test_wsd_is_flat_then_decays_to_final_exactly_at_the_end_step():
    config = ScheduleConfig(peak_lr=PEAK, warmup_steps=10, decay_fraction=0.2, final_fraction=0.1)
    got = lrs(100, config, 150)
    np.testing.assert_allclose(got[10:81], PEAK, rtol=1e-6)
    decay = got[80:101]
    assert np.all(np.diff(decay) < 0)
    assert got[99] > 0.1 * PEAK
    assert got[100] == np.float32(0.1 * PEAK)
    assert np.all(got[100:] == got[100])


@pytest.mark.parametrize("shape", ["cosine", "sqrt"])
def test_wsd_decay_shapes_end_at_final(shape: str):
    config = ScheduleConfig(peak_lr=PEAK, warmup_steps=0, decay_shape=shape, final_fraction=0.0)
    got = lrs(50, config, 51)
    assert got[40] == pytest.approx(PEAK)
    assert np.all(np.diff(got[40:51]) < 0)
    assert got[50] == 0.0


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_cosine_and_linear_decrease_monotonically_after_warmup(kind: str):
    config = ScheduleConfig(kind=kind, peak_lr=PEAK, warmup_steps=10, final_fraction=0.1)
    got = lrs(110, config, 120)
    assert got[10] == pytest.approx(PEAK)
    assert np.all(np.diff(got[10:111]) < 0)
    assert got[60] == pytest.approx(0.55 * PEAK, rel=1e-5)  # halfway: same for both shapes
    assert np.all(got[110:] == np.float32(0.1 * PEAK))


def test_moving_the_end_step_changes_only_the_future():
    config = ScheduleConfig(peak_lr=PEAK, warmup_steps=10, decay_fraction=0.2)
    short, long = lrs(200, config, 300), lrs(300, config, 300)
    np.testing.assert_array_equal(short[:160], long[:160])  # before the earlier decay start
    assert np.all(short[170:200] < long[170:200])
    np.testing.assert_allclose(long[170:240], PEAK, rtol=1e-6)


def test_piecewise_second_segment_rewarms_from_the_first_ones_final_lr():
    first = ScheduleConfig(peak_lr=PEAK, warmup_steps=10, final_fraction=0.1)
    second = ScheduleConfig(peak_lr=PEAK, warmup_steps=20, warmup_from=0.1, kind="cosine")
    # Given out of order: the segments are sorted by start_step.
    lr = piecewise_lr([Segment(100, 60, second), Segment(0, 100, first)])
    got = np.asarray(lr(jnp.arange(200)), np.float64)
    np.testing.assert_array_equal(got[:100], lrs(100, first, 100))
    assert got[100] == pytest.approx(0.1 * PEAK)  # where the first segment ends
    # Continuous across the boundary: the step into the second segment is one decay step.
    assert got[99] - got[100] == pytest.approx(got[98] - got[99], rel=1e-3)
    np.testing.assert_allclose(got[100:121], PEAK * (0.1 + 0.9 * np.arange(21) / 20), rtol=1e-5)
    assert np.all(np.diff(got[120:161]) < 0)
    assert np.all(got[160:] == np.float32(0.1 * PEAK))


def test_schedules_run_under_jit_with_a_traced_step():
    config = ScheduleConfig(peak_lr=PEAK, warmup_steps=10)
    jitted = jax.jit(lambda step: segment_lr(step, 100, config))
    lr = piecewise_lr([Segment(0, 100, config), Segment(100, 50, config)])
    jitted_piecewise = jax.jit(lr)
    for step in (0, 5, 50, 90, 100, 130):
        eager = float(segment_lr(step, 100, config))
        assert float(jitted(jnp.int32(step))) == pytest.approx(eager, rel=1e-6)
        assert float(jitted_piecewise(jnp.int32(step))) == pytest.approx(float(lr(step)), rel=1e-6)
    assert jitted(jnp.int32(5)) == pytest.approx(0.5 * PEAK)


@pytest.mark.parametrize(
    "segments",
    [
        pytest.param([], id="empty"),
        pytest.param([Segment(0, 100), Segment(90, 100)], id="overlap"),
        pytest.param([Segment(0, 100), Segment(110, 100)], id="gap"),
        pytest.param([Segment(0, 0)], id="no-steps"),
        pytest.param([Segment(0, 200, ScheduleConfig(final_fraction=1.5))], id="final>1"),
        pytest.param([Segment(0, 200, ScheduleConfig(warmup_from=-0.1))], id="warmup_from<0"),
        pytest.param([Segment(0, 200, ScheduleConfig(decay_fraction=2.0))], id="decay>1"),
        pytest.param([Segment(0, 200, ScheduleConfig(peak_lr=0.0))], id="peak=0"),
        pytest.param([Segment(0, 200, ScheduleConfig(kind="step"))], id="kind"),  # type: ignore[arg-type]
    ],
)
def test_bad_schedules_raise_config_error(segments: list[Segment]):
    with pytest.raises(ConfigError):
        piecewise_lr(segments)


def test_a_warmup_longer_than_the_segment_still_rises_at_its_end():
    config = ScheduleConfig(warmup_steps=100, warmup_from=0.0, peak_lr=1.0)
    lrs = [float(segment_lr(step, 50, config)) for step in range(50)]
    assert lrs == sorted(lrs) and lrs[-1] == pytest.approx(0.49)  # 49/100 of the way up
