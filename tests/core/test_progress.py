"""keel.core.progress: plain progress lines where there is no terminal, and the --progress forms."""

import io

import pytest

from keel.core import progress as progress_module
from keel.core.errors import UsageError
from keel.core.progress import ProgressDisplay, ProgressStyle, parse_progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(progress_module.time, "monotonic", fake)
    return fake


def test_steps_write_a_line_every_tenth_with_loss_speed_elapsed_and_eta(clock):
    stream = io.StringIO()  # not a terminal: auto means plain lines
    with ProgressDisplay(ProgressStyle(), stream) as display:
        task = display.task("train", 20)
        clock.now += 10  # start-up and compile: counted in elapsed, not in the rate
        for step in range(1, 21):
            clock.now += 0.5
            task.update(step, loss=f"loss {7 - step * 0.1:.3f}", speed="1,000 tokens/s")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[0] == "train: step 2/20, loss 6.800, 1,000 tokens/s, elapsed 0:00:11, eta 0:00:09"
    assert lines[-1] == (
        "train: step 20/20, loss 5.000, 1,000 tokens/s, elapsed 0:00:20, eta 0:00:00"
    )


def test_a_long_stage_writes_a_line_every_interval_and_a_last_one(clock):
    stream = io.StringIO()
    style = ProgressStyle(every=0, every_seconds=30.0)
    with ProgressDisplay(style, stream) as display:
        short = display.task("stage 0: read", 4, unit="tasks")
        for done in range(1, 5):
            clock.now += 1
            short.update(done)
        short.finish()
        assert stream.getvalue() == ""  # a short stage says nothing
        long = display.task("stage 1: dedup", 10, unit="tasks")
        for done in range(1, 10):
            clock.now += 10
            long.update(done, rows=f"{done * 100:,} rows out")
        long.finish()
    assert stream.getvalue().splitlines() == [
        "stage 1: dedup: 3/10 tasks, 300 rows out, elapsed 0:00:30, eta 0:01:10",
        "stage 1: dedup: 6/10 tasks, 600 rows out, elapsed 0:01:00, eta 0:00:40",
        "stage 1: dedup: 9/10 tasks, 900 rows out, elapsed 0:01:30, eta 0:00:10",
    ]


def test_off_writes_nothing(clock):
    stream = io.StringIO()
    with ProgressDisplay(parse_progress(None, quiet=True), stream) as display:
        task = display.task("train", 3)
        for step in (1, 2, 3):
            task.update(step, loss="loss 1.000")
    assert stream.getvalue() == ""


@pytest.mark.parametrize(
    ("text", "style"),
    [
        (None, ProgressStyle()),
        ("lines", ProgressStyle(mode="lines")),
        ("bar", ProgressStyle(mode="bar")),
        ("off", ProgressStyle(mode="off")),
        ("50", ProgressStyle(mode="lines", every=50, every_seconds=None)),
        ("15s", ProgressStyle(mode="lines", every=0, every_seconds=15.0)),
    ],
)
def test_progress_forms(text, style):
    assert parse_progress(text) == style


@pytest.mark.parametrize("text", ["often", "0", "-3", "0s", "s"])
def test_a_bad_progress_form_names_the_forms(text):
    with pytest.raises(UsageError, match="use auto, bar, lines, off"):
        parse_progress(text)


def test_quiet_and_progress_contradict():
    with pytest.raises(UsageError, match="--quiet and --progress lines contradict"):
        parse_progress("lines", quiet=True)
