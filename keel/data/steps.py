"""DataKit stages as keel steps: `data_step("dedup", run_fuzzy_dedup, output_of(prev), config)`,
and `download_step("raw", "urls.txt")` for the download stage.

Every stage has the same entry point, `run(input, output, config, options) -> StageReport`, so one
wrapper makes any of them a step: its config is the input (a path, a glob, or `output_of(step)`)
and the stage's own config dataclass, so both are part of the step's identity. The flow backend
and worker count are not (the output is the same whichever runs it): they come from
$KEEL_FLOW_BACKEND and the machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keel.data.documents import StageReport
from keel.data.download import DownloadConfig, run_download
from keel.steps import Step

StageRun = Callable[..., StageReport]
"""run(input, output, config, options=None) -> StageReport."""


@dataclass(frozen=True)
class StageInput:
    """A step's config: where its documents come from, and the stage's own settings."""

    input: Any
    stage: Any


@dataclass(frozen=True)
class _RunStage:
    run: StageRun

    def __call__(self, config: StageInput, output: str) -> None:
        self.run(config.input, output, config.stage)


def data_step(
    name: str, run: StageRun, input: Any, config: Any, version: str | None = None
) -> Step:
    """A step that runs a DataKit stage over `input` into its output directory."""
    return Step(name, _RunStage(run), StageInput(input, config), version)


def download_step(name: str, source: str, config: Any = None, version: str | None = None) -> Step:
    """A step that downloads the URL or URL list `source` (keel.data.download) into its output
    directory; the URL (or the list's path) and the DownloadConfig are its identity."""
    return data_step(name, run_download, source, config or DownloadConfig(), version)
