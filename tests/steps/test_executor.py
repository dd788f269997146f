"""The step executor through its Python API: caching, invalidation, failures, parallelism."""

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pytest

from keel.core.errors import UnhashableConfigError, UsageError
from keel.steps import Status, Step, StepStore, output_of, plan, run

CALLS: list[str] = []
_CALLS_LOCK = threading.Lock()


@dataclass(frozen=True)
class Source:
    text: str = "a b c"


@dataclass(frozen=True)
class Derived:
    upstream: str
    factor: int = 1


def write_source(config: Source, output: str) -> None:
    _called("source")
    Path(output, "text.txt").write_text(config.text)


def repeat(config: Derived, output: str) -> None:
    _called("repeat")
    text = Path(config.upstream, "text.txt").read_text()
    Path(output, "text.txt").write_text(" ".join([text] * config.factor))


def upper(config: Derived, output: str) -> None:
    _called("upper")
    Path(output, "text.txt").write_text(Path(config.upstream, "text.txt").read_text().upper())


def explode(config: Derived, output: str) -> None:
    _called("explode")
    Path(output, "partial.txt").write_text("half")
    raise ValueError("the data is bad")


def _called(name: str) -> None:
    with _CALLS_LOCK:
        CALLS.append(name)


@pytest.fixture(autouse=True)
def _reset_calls():
    CALLS.clear()


def dag(text="a b c", factor=2):
    source = Step("source", write_source, Source(text))
    repeated = Step("repeat", repeat, Derived(output_of(source), factor))
    shouted = Step("upper", upper, Derived(output_of(repeated)))
    return source, repeated, shouted


def test_second_run_executes_nothing_and_reports_every_step_cached(tmp_path):
    first = run([dag()[2]], str(tmp_path))
    assert first.executed == ["source", "repeat", "upper"] and first.cached == []
    second = run([dag()[2]], str(tmp_path))
    assert second.executed == [] and second.failed == []
    assert sorted(second.cached) == ["repeat", "source", "upper"]
    assert CALLS == ["source", "repeat", "upper"]


def test_output_is_readable_and_carries_its_record(tmp_path):
    _, repeated, shouted = dag()
    run([shouted], str(tmp_path))
    out = tmp_path / shouted.dir_name
    assert (out / "text.txt").read_text() == "A B C A B C"
    record = json.loads((out / ".keel" / "step.json").read_text())
    assert record["status"] == "SUCCESS"
    assert record["identity"] == shouted.identity
    assert record["dependencies"] == [
        {
            "name": "repeat",
            "identity": repeated.identity,
            "output": str(tmp_path / repeated.dir_name),
        }
    ]
    assert record["config"]["upstream"] == {"__step__": repeated.identity, "subpath": ""}
    assert record["start_time"] <= record["end_time"] and record["host"] and record["keel_version"]


def test_changing_one_config_reruns_that_step_and_its_descendants_only(tmp_path):
    run([dag(factor=2)[2]], str(tmp_path))
    CALLS.clear()
    report = run([dag(factor=3)[2]], str(tmp_path))
    assert report.cached == ["source"]
    assert report.executed == ["repeat", "upper"]
    assert CALLS == ["repeat", "upper"]


def test_identity_does_not_depend_on_the_prefix(tmp_path):
    first = run([dag()[2]], str(tmp_path / "one"))
    second = run([dag()[2]], str(tmp_path / "two"))
    names_one = sorted(p.name for p in (tmp_path / "one").iterdir() if not p.name.startswith("."))
    names_two = sorted(p.name for p in (tmp_path / "two").iterdir() if not p.name.startswith("."))
    assert names_one == names_two == sorted(s.dir_name for s in dag())
    assert first.executed == second.executed


def test_identity_changes_with_name_config_and_version_and_follows_dependencies():
    source, repeated, _ = dag()
    assert Step("source", write_source, Source()).identity == source.identity
    assert Step("other", write_source, Source()).identity != source.identity
    assert Step("source", write_source, Source("x")).identity != source.identity
    assert Step("source", write_source, Source(), version="2").identity != source.identity
    assert dag(text="x")[1].identity != repeated.identity  # an upstream change propagates
    assert len(source.dir_name) == len("source-") + 8


def test_failed_step_is_recorded_fails_its_descendants_and_commits_nothing(tmp_path):
    source = Step("source", write_source, Source())
    broken = Step("explode", explode, Derived(output_of(source)))
    child = Step("upper", upper, Derived(output_of(broken)))
    sibling = Step("repeat", repeat, Derived(output_of(source)))
    report = run([child, sibling], str(tmp_path))
    assert not report.ok
    assert report.failed == ["explode", "upper"]
    assert sorted(report.executed) == ["repeat", "source"]
    assert "upper" not in CALLS
    assert not (tmp_path / broken.dir_name).exists()
    assert not (tmp_path / child.dir_name).exists()
    attempt = StepStore(str(tmp_path)).attempt_record(broken.dir_name)
    assert attempt.status is Status.FAILED
    assert attempt.error == "ValueError: the data is bad"
    assert "Traceback" in attempt.traceback and "the data is bad" in attempt.traceback
    assert report.errors[child.dir_name] == "not run: upstream step explode failed"


def test_a_failed_step_runs_again_on_the_next_run(tmp_path):
    source = Step("source", write_source, Source())
    broken = Step("explode", explode, Derived(output_of(source)))
    run([broken], str(tmp_path))
    report = run([broken], str(tmp_path))
    assert report.cached == ["source"] and report.failed == ["explode"]
    assert CALLS.count("explode") == 2


def test_force_reruns_matching_steps_only(tmp_path):
    run([dag()[2]], str(tmp_path))
    CALLS.clear()
    report = run([dag()[2]], str(tmp_path), force="^rep")
    assert report.executed == ["repeat"]
    assert sorted(report.cached) == ["source", "upper"]
    with pytest.raises(UsageError, match="regular expression"):
        run([dag()[2]], str(tmp_path), force="(")


def test_dry_run_plan_says_what_would_run_and_runs_nothing(tmp_path):
    run([dag()[1]], str(tmp_path))
    CALLS.clear()
    planned = plan([dag()[2]], str(tmp_path))
    assert [(p.step.name, p.action) for p in planned] == [
        ("source", "cached"),
        ("repeat", "cached"),
        ("upper", "run"),
    ]
    assert CALLS == []
    assert not (tmp_path / dag()[2].dir_name).exists()


def test_independent_steps_run_in_parallel(tmp_path):
    both_running = threading.Barrier(2, timeout=10)

    def meet(config: Source, output: str) -> None:
        both_running.wait()  # raises BrokenBarrierError unless the other step runs at once
        Path(output, "ok").write_text(config.text)

    steps = [Step("left", meet, Source("l")), Step("right", meet, Source("r"))]
    report = run(steps, str(tmp_path), max_parallel=2)
    assert sorted(report.executed) == ["left", "right"]


def test_max_parallel_one_runs_one_step_at_a_time(tmp_path):
    active, peak = [0], [0]
    guard = threading.Lock()

    def busy(config: Source, output: str) -> None:
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with guard:
            active[0] -= 1

    run([Step(f"s{i}", busy, Source(str(i))) for i in range(4)], str(tmp_path), max_parallel=1)
    assert peak[0] == 1


def test_unhashable_config_is_a_clear_error():
    step = Step("bad", write_source, {"transform": lambda x: x})
    with pytest.raises(UnhashableConfigError, match=r"bad\.config\.transform: a lambda"):
        _ = step.identity


def test_steps_run_on_an_fsspec_prefix():
    fsspec.filesystem("memory").store.clear()

    def write(config: Source, output: str) -> None:
        fs, path = fsspec.core.url_to_fs(output)
        fs.pipe_file(f"{path}/text.txt", config.text.encode())

    def read(config: Derived, output: str) -> None:
        fs, path = fsspec.core.url_to_fs(config.upstream)
        fs.pipe_file(output.split("://", 1)[1] + "/copy.txt", fs.cat_file(f"{path}/text.txt"))

    source = Step("source", write, Source("remote"))
    copy = Step("copy", read, Derived(output_of(source)))
    assert run([copy], "memory://bucket/exp").executed == ["source", "copy"]
    assert run([copy], "memory://bucket/exp").cached == ["source", "copy"]
    fs = fsspec.filesystem("memory")
    assert fs.cat_file(f"/bucket/exp/{copy.dir_name}/copy.txt") == b"remote"
    assert fs.exists(f"/bucket/exp/{copy.dir_name}/.keel/step.json")
