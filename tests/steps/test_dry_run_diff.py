"""`keel run --dry-run` says, for each step it would run, what differs from its nearest cached
output: the config keys with both values, a changed version, or the upstream steps that changed."""

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from keel.steps import Step, output_of, plan, run


@dataclass(frozen=True)
class Settings:
    lr: float = 0.1
    width: int = 4


@dataclass(frozen=True)
class Load:
    rows: int
    settings: Settings = Settings()


@dataclass(frozen=True)
class Use:
    data: str
    label: str = "x"


def write(config, output: str) -> None:
    Path(output, "out.txt").write_text(repr(config))


def experiment(rows: int = 10, lr: float = 0.1, label: str = "x", version: str | None = None):
    load = Step("load", write, Load(rows, Settings(lr=lr)), version=version)
    use = Step("use", write, Use(output_of(load), label))
    report = Step("report", write, Use(output_of(use)))
    return [report]


def reasons(steps, prefix):
    return {item.step.name: (item.action, item.reason) for item in plan(steps, str(prefix))}


def test_a_changed_key_is_named_with_both_values_and_descendants_say_upstream(tmp_path):
    run(experiment(rows=10, lr=0.1), str(tmp_path))
    assert reasons(experiment(rows=10, lr=0.1), tmp_path) == {
        "load": ("cached", "output committed"),
        "use": ("cached", "output committed"),
        "report": ("cached", "output committed"),
    }
    assert reasons(experiment(rows=20, lr=0.5), tmp_path) == {
        "load": ("run", "rows: 10 -> 20; settings.lr: 0.1 -> 0.5"),
        "use": ("run", "upstream changed: load"),
        "report": ("run", "upstream changed: use"),
    }
    # a step's own change and its upstream's together; steps above it stay cached
    assert reasons(experiment(label="y"), tmp_path) == {
        "load": ("cached", "output committed"),
        "use": ("run", 'label: "x" -> "y"'),
        "report": ("run", "upstream changed: use"),
    }


def test_the_nearest_cached_output_is_the_one_with_fewest_differences(tmp_path):
    run(experiment(rows=10, lr=0.1), str(tmp_path))
    run(experiment(rows=20, lr=0.5), str(tmp_path))
    planned = {p.step.name: p for p in plan(experiment(rows=20, lr=0.7), str(tmp_path))}
    assert planned["load"].reason == "settings.lr: 0.5 -> 0.7"
    assert (
        planned["load"].diff.nearest
        == experiment(rows=20, lr=0.5)[0].dependencies[0].dependencies[0].dir_name
    )


def test_version_and_never_run_steps(tmp_path):
    run(experiment(), str(tmp_path))
    assert reasons(experiment(version="2"), tmp_path)["load"] == ("run", 'version: null -> "2"')
    other = tmp_path / "other"
    assert set(reasons(experiment(), other).values()) == {("run", "not run yet")}


EXPERIMENT = """
    from dataclasses import dataclass
    from pathlib import Path
    from keel.steps import Step, output_of

    @dataclass(frozen=True)
    class Config:
        value: int = 1
        data: str = ""

    def work(config, output):
        Path(output, "v.txt").write_text(str(config.value))

    a = Step("a", work, Config(value=1))
    b = Step("b", work, Config(data=output_of(a)))
    STEPS = [b]
"""


def test_dry_run_after_a_set_override_through_the_cli(tmp_path):
    path = tmp_path / "exp.py"
    path.write_text(textwrap.dedent(EXPERIMENT))
    env = {**os.environ, "COLUMNS": "200"}

    def keel(*args):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "keel",
                "run",
                str(path),
                "--prefix",
                str(tmp_path / "out"),
                *args,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    keel()
    planned = json.loads(keel("--dry-run", "--json", "--set", "a.value=7"))
    assert planned["to_run"] == ["a", "b"]
    assert planned["why"] == {"a": "value: 1 -> 7", "b": "upstream changed: a"}
    assert planned["changes"]["a"]["changed"] == {"value": {"cached": 1, "now": 7}}
    table = keel("--dry-run", "--set", "a.value=7")
    assert "value: 1 -> 7" in table and "upstream changed: a" in table
    outputs = sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith("."))
    assert len(outputs) == 2 and planned["changes"]["a"]["nearest"] in outputs  # nothing ran


def test_a_long_change_is_cut_in_the_line_but_whole_in_the_diff(tmp_path):
    run([Step("many", write, {"values": list(range(10)), "note": "n"})], str(tmp_path))
    changed = Step("many", write, {"values": list(range(1, 11)), "note": "x" * 200})
    [planned] = plan([changed], str(tmp_path))
    assert planned.reason.startswith('note: "n" -> "xxx')
    assert planned.reason.endswith("values.4: 4 -> 5; and 5 more keys")
    assert len(planned.reason) < 200
    assert len(planned.diff.changed) == 11 and planned.diff.changed[0].now == "x" * 200
