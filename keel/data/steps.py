"""DataKit stages as keel steps: `data_step("dedup", run_fuzzy_dedup, output_of(prev), config)`,
and `download_step("raw", "urls.txt")` for the download stage.

Every stage has the same entry point, `run(input, output, config, options) -> StageReport`, so one
wrapper makes any of them a step: its config is the input (a path, a glob, or `output_of(step)`)
and the stage's own config dataclass, so both are part of the step's identity. The flow backend
and worker count are not (the output is the same whichever runs it): they come from
$KEEL_FLOW_BACKEND and the machine. Overrides name the stage's fields directly:
`--set fuzzy_dedup.threshold=0.7`, and `--set filter.input=other/` the input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from keel.core.config import apply_overrides
from keel.core.errors import ConfigError
from keel.data.documents import StageReport
from keel.data.download import DownloadConfig, run_download
from keel.steps import Step

StageRun = Callable[..., StageReport]
"""run(input, output, config, options=None) -> StageReport."""


@dataclass(frozen=True)
class StageInput:
    """A step's config: where its documents come from, and the stage's own settings.

    `--set STEP.key=value` names the stage's fields directly (`fuzzy_dedup.threshold=0.7`) and
    `STEP.input=...` the input: keel.steps calls `with_overrides` (the wrapper is no key)."""

    input: Any
    stage: Any

    def with_overrides(self, overrides: Sequence[str], key_prefix: str) -> StageInput:
        """This config with `key=value` overrides applied: `input`, or a field of the stage's
        config. The old form `stage.key=value` is refused with the key to use instead."""
        stage_overrides = []
        for override in overrides:
            key = override.split("=", 1)[0]
            if key == "stage" or key.startswith("stage."):
                new = f"{key_prefix}{override.removeprefix('stage.')}"
                raise ConfigError(
                    f"--set {key_prefix}{override}: a data step's keys are its stage's fields "
                    f"now; use --set {new}"
                )
            if key == "input":
                self = apply_overrides(self, [override], key_prefix=key_prefix)
            else:
                stage_overrides.append(override)
        if not stage_overrides:
            return self
        stage = apply_overrides(self.stage, stage_overrides, key_prefix=key_prefix)
        return dataclasses.replace(self, stage=stage)


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
