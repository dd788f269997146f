"""`keel runs report RUN`: a run's router health (drops, load), per phase and context length.

Everything comes from the run directory the trainer writes (keel/train/trainer.py): the phases'
sequence lengths from config.yaml, the per-step numbers from metrics.jsonl, and what happened
besides steps from events.jsonl. For each phase the report holds the mean over its logged steps of
    drop_rate, drop_rate_send, drop_rate_recv   assignments dropped (all, by the sending device's
                                                pool, by the receiving expert's), mean over layers
    load_max_over_mean                          the busiest expert's load over the mean, max over
                                                layers
    balance_loss                                the sequence-level balance loss, where the run
                                                logs one (seq_balance_loss); None otherwise: keel's
                                                bias balancing has no loss
and the same per MoE layer (metrics.jsonl's `router` lists, one entry per MoE layer). The seed's
"drops by context length" view pools the phases of one seq_len. A dense run has no router: its
report says so (`router` False) and holds the steps and loss per phase only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from keel.core import paths
from keel.core.config import load_config
from keel.core.errors import UsageError
from keel.train.config import TrainConfig
from keel.train.events import read_events
from keel.train.run_dir import CONFIG_FILE, METRICS_FILE

DROP_METRICS = ("drop_rate", "drop_rate_send", "drop_rate_recv")
"""Metrics lines' drop rates (fractions of the step's expert assignments), layers averaged."""
LOAD_METRIC = "load_max_over_mean"
"""Metrics lines' busiest-expert load over the mean load, the max over layers."""
BALANCE_LOSS_METRICS = ("seq_balance_loss", "balance_loss")
"""Names a balance loss may be logged under (top level, or per layer in `router`); the first
present counts."""


@dataclass(frozen=True)
class RouterNumbers:
    """Mean over steps of one phase (or one layer, or one seq_len) of the router's numbers."""

    drop_rate: float
    drop_rate_send: float
    drop_rate_recv: float
    load_max_over_mean: float
    balance_loss: float | None
    """None where the run logs no balance loss."""


@dataclass(frozen=True)
class PhaseReport:
    name: str
    seq_len: int
    """Tokens per sequence in this phase."""
    steps: int
    """Metrics lines of this phase (steps logged)."""
    first_step: int
    last_step: int
    loss: float
    """Mean training loss over the phase's steps (nats per token)."""
    router: RouterNumbers | None
    """None for a dense run."""
    layers: tuple[RouterNumbers, ...] = ()
    """Per MoE layer (in model order), means over the phase's steps."""


@dataclass(frozen=True)
class ContextLengthDrops:
    """The seed's "drops by context length" row: the phases of one seq_len pooled."""

    seq_len: int
    steps: int
    drop_rate: float
    drop_rate_send: float
    drop_rate_recv: float


@dataclass(frozen=True)
class RunReport:
    run: str
    router: bool
    """Whether the run's model has routed experts (False: dense, nothing dropped)."""
    phases: tuple[PhaseReport, ...]
    by_seq_len: tuple[ContextLengthDrops, ...]
    events: tuple[dict[str, Any], ...] = ()
    """events.jsonl's events (re-plans, branches, experiments), in order."""
    series: dict[str, list[float]] = field(default_factory=dict)
    """Per logged step, for the plot: step, seq_len, loss and (MoE) the drop and load metrics."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of the whole report (without the per-step series)."""
        from dataclasses import asdict

        data = asdict(self)
        del data["series"]
        return data


def run_report(run: str) -> RunReport:
    """The report of run directory `run` (a local path or a URL); UsageError when it is not a
    run directory or has logged no step."""
    run = paths.normalize(run)
    config_path = paths.join(run, CONFIG_FILE)
    metrics_path = paths.join(run, METRICS_FILE)
    if not paths.exists(config_path):
        raise UsageError(f"{run} is not a run directory (no {CONFIG_FILE}); check the path")
    config = load_config(config_path, TrainConfig)
    if not paths.exists(metrics_path):
        raise UsageError(f"{run} has no {METRICS_FILE}: it has not finished a step yet")
    lines = read_metrics(metrics_path)
    if not lines:
        raise UsageError(f"{metrics_path} holds no steps: the run has not finished a step yet")
    seq_lens = {phase.name: phase.seq_len for phase in config.phases}
    has_router = config.model.n_routed_experts > 0
    phases = []
    for name in _in_order(line["phase"] for line in lines):
        if name not in seq_lens:
            raise UsageError(
                f"{metrics_path}: phase {name!r} is not in {config_path} (phases: "
                f"{', '.join(seq_lens)}); was config.yaml replaced?"
            )
        phase_lines = [line for line in lines if line["phase"] == name]
        phases.append(_phase_report(name, seq_lens[name], phase_lines, has_router))
    by_seq_len = _by_seq_len(lines, seq_lens) if has_router else ()
    return RunReport(
        run=run,
        router=has_router,
        phases=tuple(phases),
        by_seq_len=by_seq_len,
        events=tuple(read_events(run)),
        series=_series(lines, seq_lens, has_router),
    )


def read_metrics(path: str) -> list[dict[str, Any]]:
    """metrics.jsonl's step lines in step order; a step logged twice (a resume that re-ran it)
    counts once, its last line."""
    by_step: dict[int, dict[str, Any]] = {}
    for number, text in enumerate(paths.read_text(path).splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as err:
            raise UsageError(f"{path}:{number}: not a JSON line ({err.msg})") from err
        if not isinstance(line, dict) or "step" not in line or "phase" not in line:
            raise UsageError(f"{path}:{number}: not a metrics line (no step or phase)")
        by_step[int(line["step"])] = line
    return [by_step[step] for step in sorted(by_step)]


def _phase_report(
    name: str, seq_len: int, lines: Sequence[dict[str, Any]], has_router: bool
) -> PhaseReport:
    router = _router_numbers(lines) if has_router else None
    layers: tuple[RouterNumbers, ...] = ()
    if has_router:
        layer_count = len(lines[0]["router"]["drop_rate"])
        layers = tuple(_layer_numbers(lines, layer) for layer in range(layer_count))
    return PhaseReport(
        name=name,
        seq_len=seq_len,
        steps=len(lines),
        first_step=int(lines[0]["step"]),
        last_step=int(lines[-1]["step"]),
        loss=_mean(line["loss"] for line in lines),
        router=router,
        layers=layers,
    )


def _router_numbers(lines: Sequence[dict[str, Any]]) -> RouterNumbers:
    drops = {name: _mean(line[name] for line in lines) for name in DROP_METRICS}
    return RouterNumbers(
        **drops,
        load_max_over_mean=_mean(line[LOAD_METRIC] for line in lines),
        balance_loss=_balance_loss(lines, lambda line, key: line.get(key)),
    )


def _layer_numbers(lines: Sequence[dict[str, Any]], layer: int) -> RouterNumbers:
    def value(line: dict[str, Any], key: str) -> float | None:
        values = line["router"].get(key)
        return None if values is None else values[layer]

    drops = {name: _mean(line["router"][name][layer] for line in lines) for name in DROP_METRICS}
    return RouterNumbers(
        **drops,
        load_max_over_mean=_mean(line["router"][LOAD_METRIC][layer] for line in lines),
        balance_loss=_balance_loss(lines, value),
    )


def _balance_loss(lines: Sequence[dict[str, Any]], value: Any) -> float | None:
    """The mean of the first BALANCE_LOSS_METRICS name that every line has; None if none has."""
    for key in BALANCE_LOSS_METRICS:
        values = [value(line, key) for line in lines]
        if all(v is not None for v in values):
            return _mean(values)
    return None


def _by_seq_len(
    lines: Sequence[dict[str, Any]], seq_lens: dict[str, int]
) -> tuple[ContextLengthDrops, ...]:
    rows = []
    for seq_len in sorted(set(seq_lens[line["phase"]] for line in lines)):
        pooled = [line for line in lines if seq_lens[line["phase"]] == seq_len]
        drops = {name: _mean(line[name] for line in pooled) for name in DROP_METRICS}
        rows.append(ContextLengthDrops(seq_len=seq_len, steps=len(pooled), **drops))
    return tuple(rows)


def _series(
    lines: Sequence[dict[str, Any]], seq_lens: dict[str, int], has_router: bool
) -> dict[str, list[float]]:
    names = ["loss", *DROP_METRICS, LOAD_METRIC] if has_router else ["loss"]
    series: dict[str, list[float]] = {
        "step": [float(line["step"]) for line in lines],
        "seq_len": [float(seq_lens[line["phase"]]) for line in lines],
    }
    for name in names:
        series[name] = [float(line[name]) for line in lines]
    return series


def _in_order(names: Any) -> list[str]:
    """Distinct names in order of first appearance."""
    return list(dict.fromkeys(names))


def _mean(values: Any) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values)
