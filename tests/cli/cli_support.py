"""Helpers for driving the real `keel` command in subprocesses, as a user would."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

EXPERIMENT = """
import os
import time
from dataclasses import dataclass
from pathlib import Path

from keel.steps import Step, output_of


@dataclass(frozen=True)
class Work:
    label: str
    inputs: tuple[str, ...] = ()
    value: int = 1
    pause: float = 0.0


def work(config: Work, output: str) -> None:
    with open(os.environ["KEEL_TEST_COUNTER"], "a") as counter:
        counter.write(config.label + "\\n")
    if config.label == os.environ.get("KEEL_TEST_SLOW_STEP"):
        Path(os.environ["KEEL_TEST_STARTED"]).write_text("started")
        time.sleep(float(os.environ.get("KEEL_TEST_SLEEP", "60")))
    failing = (os.environ.get("KEEL_TEST_FAILING_STEP"), os.environ.get("KEEL_TEST_FAILING_TOKEN"))
    if config.label in failing:
        raise ValueError("bad value at row 7")
    time.sleep(config.pause)
    total = config.value + sum(int(Path(i, "value.txt").read_text()) for i in config.inputs)
    Path(output, "value.txt").write_text(str(total))


a = Step("a", work, Work("a", value=VALUE_A))
b = Step("b", work, Work("b", inputs=(output_of(a),), pause=0.3))
c = Step("c", work, Work("c", inputs=(output_of(a),), pause=0.3))
d = Step("d", work, Work("d", inputs=(output_of(b), output_of(c))))

STEPS = [d]
"""


class KeelCli:
    """Runs `python -m keel` with a side-channel counter file that step functions append to."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.prefix = root / "out"
        self.counter = root / "executions.txt"
        self.env = {**os.environ, "KEEL_TEST_COUNTER": str(self.counter), "COLUMNS": "200"}

    def experiment(self, value_a: int = 1, name: str = "exp.py") -> Path:
        path = self.root / name
        path.write_text(EXPERIMENT.replace("VALUE_A", str(value_a)))
        return path

    def write(self, name: str, source: str) -> Path:
        path = self.root / name
        path.write_text(textwrap.dedent(source))
        return path

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "keel", *args]

    def run(self, *args: str, env: dict | None = None, timeout: float = 120):
        return subprocess.run(
            self.command(*args),
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            timeout=timeout,
            cwd=self.root,
        )

    def popen(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            self.command(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**self.env, **(env or {})},
            cwd=self.root,
            start_new_session=True,
        )

    def executions(self) -> list[str]:
        return self.counter.read_text().split() if self.counter.exists() else []


def keel(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """`keel ARGS...` in `cwd`; with `check`, assert it exited 0 (showing its stderr if not)."""
    result = subprocess.run(
        [sys.executable, "-m", "keel", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]
