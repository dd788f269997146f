"""The training loop: phases of updates, evaluation, checkpoints, and metrics.jsonl.

A run directory holds
    config.yaml       the run's TrainConfig (rewritten on each start)
    metrics.jsonl     one JSON object per step: step, loss, lr, grad_norm, tokens/s, MFU, router
                      metrics per MoE layer, at evaluation steps eval_loss and eval_bpb, and
                      at eval_tasks steps eval_task/<task>/<metric> (keel.train.task_scores)
    checkpoints/      Orbax checkpoints (see checkpoint.py)
    result.json       the final step's numbers, written when the run completes
The run directory may be an fsspec URL (s3://bucket/run): the trainer then writes metrics.jsonl
and the checkpoints in a local working copy that each checkpoint uploads (keel.train.run_dir),
and writes config.yaml and result.json there directly.
Starting a run on a directory that has checkpoints resumes from the latest: the data position
is a function of the step, so the resumed run computes the same updates as an uninterrupted one.
The loop never makes the devices wait for the host: step k's metrics are read only once step
k + 1 is dispatched (its batch placed while step k runs), except at steps that evaluate or save
a checkpoint, which finish before the next update takes their state; a step's metrics line is
always written before its checkpoint.
Everything a user can get wrong (config, caches, vocabularies) is checked before compiling.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import closing, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from keel.core import paths
from keel.core.config import dump_config, load_config
from keel.core.errors import ConfigError, UsageError
from keel.core.experiment_id import current_experiment
from keel.core.stop import Stopped, stop_requested, stoppable
from keel.core.stop import install_handler as install_stop_handler
from keel.data.token_cache import TokenCache
from keel.data.tokenize import load_tokenizer
from keel.model.config import ModelConfig
from keel.model.size import flops_per_token
from keel.steps.context import step_output
from keel.telemetry.sink import TARGET_ENV, MetricsSink, write_record
from keel.train import distributed
from keel.train.branch import BranchPoint, branch_event, branch_state, parent_config
from keel.train.checkpoint import Checkpoints, TrainState
from keel.train.compile_cache import enable_compilation_cache
from keel.train.config import Phase, TrainConfig, cache_name
from keel.train.events import append_event, read_events
from keel.train.gang_programs import compiled_in_step
from keel.train.hf_import import hf_directory, hf_start_state, with_hf_model
from keel.train.layout import RunLayout, initial_state, place_batch
from keel.train.loader import MixtureLoader, WindowRange, check_cache, scored_batches, split_windows
from keel.train.long_eval import (
    PASSKEY_METRIC,
    LongContextTotals,
    PasskeyBatch,
    passkey_accuracy,
    passkey_batch,
)
from keel.train.midrun import check_resume_changes, data_positions
from keel.train.peak import device_peak
from keel.train.replan import resume_schedule
from keel.train.run_dir import CONFIG_FILE, METRICS_FILE, RESULT_FILE
from keel.train.step import StepFunctions, bits_per_byte, build_step_functions
from keel.train.task_scores import TaskScores
from keel.train.token_bytes import token_byte_lengths

logger = logging.getLogger(__name__)

EVENTS_NAMESPACE = "train.events"
"""Telemetry namespace of a run's events (branches), beside train.metrics."""
EXPERIMENT_EVENT = "experiment"
"""events.jsonl: the run (re)started for an experiment record (`keel run --experiment ID`)."""
EXPERIMENT_NAMESPACE = "experiment.runs"
"""Telemetry namespace tying a run (train.metrics' `run`) to the experiment it trained for."""


@dataclass(frozen=True)
class PhasePlan:
    phase: Phase
    start: int
    """Global step at which the phase begins."""
    steps: int
    loader: MixtureLoader


@dataclass(frozen=True)
class EvalSet:
    """Windows to evaluate, and whether the final evaluation scores all of the cache."""

    windows: WindowRange
    whole: bool
    """True for an eval_data cache: its windows are all of the cache, and the final evaluation
    scores every one of them and the tail after the last (every token after the first, once).
    False for a training cache's held-out windows: at most eval_batches batches each time."""


@dataclass
class RunData:
    """The run's data, opened and checked: per-phase loaders and the evaluation sets."""

    phases: list[PhasePlan]
    eval_sets: dict[str, EvalSet]
    """By metric name (`eval/<name>/bpb`)."""
    token_bytes: np.ndarray
    eos_id: int
    tokenizer_path: str = ""
    """The caches' tokenizer.json (passkey prompts are written with it)."""
    passkeys: dict[int, PasskeyBatch | None] = field(default_factory=dict)
    """Passkey prompts by seq_len, made at a phase's first evaluation."""


@dataclass
class TrainResult:
    output: str
    steps: int
    resumed_from: int | None
    last: dict[str, Any] = field(default_factory=dict)
    """The last step's metrics (evaluation included), from result.json when nothing ran."""


def train(
    config: TrainConfig,
    output: str,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    devices: list[jax.Device] | None = None,
    branch: BranchPoint | None = None,
) -> TrainResult:
    """Train (or resume) the run in `output` to config.total_steps on `devices` (default: every
    device of every process of the gang); `on_step` receives each step's metrics as they are
    written. A new run given `branch` starts from that run's whole state at that step
    (keel.train.branch); once it has checkpoints it resumes from them like any run. Only
    process 0 writes the run's files; every process writes checkpoints."""
    enable_compilation_cache()  # before anything compiles
    config = with_hf_model(config.validate()).validate()  # init_from: hf:DIR sets the model
    data = open_run_data(config)
    previous = _previous_config(config, output)
    # lm-eval tasks checked (names, files, lm-eval installed) before anything is written
    tasks = (
        TaskScores(config, output, data.tokenizer_path, data.eos_id) if config.eval_tasks else None
    )
    if not paths.is_local(output) and jax.process_count() > 1:
        raise UsageError(
            f"{output}: a gang trains in a run directory on shared storage, not an object "
            "store; train in one process there, or give the gang a shared local path"
        )
    primary = distributed.is_primary()
    if branch is not None and config.init_from:
        raise UsageError("--from and init_from both say where to start: give one of them")
    # A new branch checks its parent before anything is written here.
    parent = parent_config(branch, config) if branch is not None and previous is None else None
    checkpoints = Checkpoints(
        output,
        config.checkpoint_every,
        config.keep_checkpoints,
        carried=(METRICS_FILE,),
        keep_every=config.keep_every,
    )
    resumed_from = checkpoints.latest_step()
    branching = branch is not None and resumed_from is None
    if branching and parent is None:  # a branch killed before its first checkpoint
        parent = parent_config(branch, config)
    positions, batch_changed = data_positions(output, config, previous, resumed_from)
    if positions:  # a batch size changed mid-phase: its loader continues where the data stands
        data = open_run_data(config, positions)
    learning_rate, replanned = resume_schedule(config, output, previous, resumed_from)
    if primary:
        for line in config.warmup_overruns():
            logger.warning("%s", line)
        # Before the config: a kill between them finds the same change again on resume.
        for event in (batch_changed, replanned):
            if event is not None:
                append_event(output, event)
        dump_config(config, paths.join(output, CONFIG_FILE))

    state, optimizer, layout = initial_state(config, learning_rate, devices)
    if resumed_from is not None:
        state = checkpoints.restore(state)
        logger.info("resuming %s from step %d", output, resumed_from)
    elif branching:
        state = branch_state(branch, state)
        logger.info("branching %s from %s", output, branch)
        if primary:
            event = branch_event(branch, parent, config)
            append_event(output, event)
            _report_event(config, output, event)
    elif config.init_from:
        state = _start_from(config.init_from, state, config.model)
    if primary:
        _record_experiment(config, output, int(state.step))
    metrics_path = checkpoints.run.local_file(METRICS_FILE)  # uploaded with each checkpoint
    if primary:
        _truncate_metrics(metrics_path, int(state.step))

    token_bytes = jnp.asarray(data.token_bytes)
    phase_functions = {  # one pair per phase model: a phase may set its own RoPE base and scaling
        model: _in_step(
            build_step_functions(
                replace(config, model=model),
                optimizer,
                learning_rate,
                token_bytes,
                data.eos_id,
                layout,
            )
        )
        for model in {phase.model_config(config.model) for phase in config.phases}
    }
    peak = (config.peak_flops or device_peak(compute_dtype=_dtype(config))) * layout.mesh.size
    result = TrainResult(output, config.total_steps, resumed_from)
    telemetry_target = _telemetry_target(config)
    if jax.process_count() == 1:  # a gang hears SIGTERM through JAX's preemption service
        install_stop_handler()
    with (
        closing(checkpoints.run),  # on an error too: a remote run's working copy is removed
        paths.open_file(metrics_path if primary else os.devnull, "a") as metrics_file,
        MetricsSink(telemetry_target if primary else "", run=step_output() or output) as telemetry,
        stoppable(),
        closing(tasks) if tasks is not None else nullcontext(),
    ):
        log = _StepLog(config, peak, metrics_file, telemetry, checkpoints, on_step)
        pending: _PendingStep | None = None
        for plan, step in _schedule(data.phases, int(state.step)):
            if _stop_requested_at(step):  # SIGTERM: save the state after `step` updates, stop
                if pending is not None:
                    log.write(log.read(pending))
                checkpoints.save(state, force=True)
                checkpoints.close()
                raise Stopped(
                    f"stopped by SIGTERM after step {step}: checkpoint saved in "
                    f"{checkpoints.directory}; run the same command again to resume from it"
                )
            started = time.perf_counter()
            shape = (plan.loader.batch_size, plan.phase.seq_len + 1)
            window = place_batch(layout, partial(plan.loader.batch, step - plan.start), shape)
            functions = phase_functions[plan.phase.model_config(config.model)]
            state, metrics = dispatch_update(functions.update, state, window)
            if pending is not None:  # step k's metrics, read now that step k + 1 is queued
                log.write(log.read(pending))
            pending = _PendingStep(step + 1, plan, metrics, started)
            last = pending.step == config.total_steps
            evaluates = last or pending.step % config.eval_every == 0
            saves = last or pending.step % config.checkpoint_every == 0
            scores_tasks = tasks is not None and config.evaluates_tasks(pending.step)
            if evaluates or saves or scores_tasks:  # the next update takes (donates) the state
                line = log.read(pending)
                if evaluates:
                    seq_len = plan.phase.seq_len
                    line.update(_evaluate(functions, state, data, config, layout, seq_len))
                if scores_tasks:
                    line.update(tasks.scores(state.params, state.router_bias, pending.step))
                log.write(line, checkpoint=state if saves else None)
                pending = None  # the last step always lands here: nothing is left pending
        result.last = log.last
    checkpoints.close()
    result_path = paths.join(output, RESULT_FILE)
    if result.last and primary:
        paths.write_text(result_path, json.dumps(result.last, indent=2) + "\n")
    elif paths.exists(result_path):  # already trained to the end: nothing ran
        result.last = json.loads(paths.read_text(result_path))
    return result


def _stop_requested_at(step: int) -> bool:
    """Whether to stop before `step`'s update: on SIGTERM (keel.core.stop); in a gang, at the
    step JAX's preemption sync point agrees on, the same step on every process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)
    return stop_requested()


def _in_step(functions: StepFunctions) -> StepFunctions:
    """The step's programs compiled by every process of a gang before any runs them
    (keel.train.gang_programs); the same functions for a process alone."""
    return replace(
        functions,
        update=compiled_in_step(functions.update, "update"),
        evaluate=compiled_in_step(functions.evaluate, "evaluate"),
    )


def dispatch_update(
    update: Callable, state: TrainState, window: jax.Array
) -> tuple[TrainState, dict[str, jax.Array]]:
    """Queue one update on the devices and return at once with its (not yet computed) state and
    metrics. Nothing may come back from the devices here: that would make the host wait for
    the step, so a device-to-host transfer during the dispatch is an error."""
    with jax.transfer_guard_device_to_host("disallow"):
        return update(state, window)


@dataclass(frozen=True)
class _PendingStep:
    """An update dispatched to the devices whose metrics the host has not read yet."""

    step: int
    """Updates done once it completes (the metrics line's step)."""
    plan: PhasePlan
    metrics: dict[str, jax.Array]
    started: float
    """time.perf_counter() seconds when the host began the step (placing its batch)."""


class _StepLog:
    """Turns finished updates into metrics lines and writes them, in step order, to
    metrics.jsonl, telemetry and `on_step`, saving a step's checkpoint after its line (a resume
    from that checkpoint then never lacks the line)."""

    def __init__(
        self,
        config: TrainConfig,
        peak: float,
        metrics_file: Any,
        telemetry: MetricsSink,
        checkpoints: Checkpoints,
        on_step: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.config, self.peak, self.on_step = config, peak, on_step
        self.metrics_file, self.telemetry, self.checkpoints = metrics_file, telemetry, checkpoints
        self.finished = 0.0
        """When the host saw the previous step complete (time.perf_counter() seconds)."""
        self.last: dict[str, Any] = {}

    def read(self, pending: _PendingStep) -> dict[str, Any]:
        """Wait for the step and read its metrics. step_s is the time from the previous step's
        completion (or from this step's start, when the host began it after that) to this one's,
        both as the host sees them: with updates queued back to back, the interval between
        completions, i.e. the time a step takes in the pipeline."""
        metrics = jax.device_get(jax.block_until_ready(pending.metrics))
        finished = time.perf_counter()
        seconds = finished - max(self.finished, pending.started)
        self.finished = finished
        seq_len = pending.plan.phase.seq_len
        tokens = pending.plan.loader.batch_size * seq_len
        line: dict[str, Any] = {"step": pending.step, "phase": pending.plan.phase.name}
        for name in ("loss", "cross_entropy", "z_loss", "router_z_loss", "grad_norm", "lr"):
            line[name] = float(metrics[name])
        line["tokens_per_s"] = tokens / seconds
        line["step_s"] = seconds
        if "router" in metrics:
            router = {name: np.asarray(value).tolist() for name, value in metrics["router"].items()}
            line["router"] = router
            line["drop_rate"] = float(np.mean(router["drop_rate"]))
            line["drop_rate_send"] = float(np.mean(router["drop_rate_send"]))
            line["drop_rate_recv"] = float(np.mean(router["drop_rate_recv"]))
            line["load_max_over_mean"] = float(np.max(router["load_max_over_mean"]))
        if "seq_balance_loss" in metrics:  # model.router.seq_balance_weight > 0
            line["seq_balance_loss"] = float(metrics["seq_balance_loss"])
        flops = flops_per_token(self.config.model, seq_len) * tokens
        line["mfu"] = flops / seconds / self.peak
        return line

    def write(self, line: dict[str, Any], checkpoint: TrainState | None = None) -> None:
        """Write `line`, then save `checkpoint` (the state after the line's step) when given."""
        self.metrics_file.write(json.dumps(line) + "\n")
        self.metrics_file.flush()
        self.telemetry.write(line["step"], line)
        if checkpoint is not None:
            self.checkpoints.save(checkpoint, force=line["step"] == self.config.total_steps)
        self.last = line
        if self.on_step is not None:
            self.on_step(line)


def open_run_data(
    config: TrainConfig, positions: dict[int, tuple[int, int]] | None = None
) -> RunData:
    """Open and check every cache the run names (vocabulary, size) and build the loaders;
    `positions` gives a phase's loader the (phase step, sequence) it starts from
    (keel.train.midrun: after a batch-size change)."""
    vocab = config.model.vocab_size
    caches: dict[str, TokenCache] = {}

    def cache(path: str) -> TokenCache:
        if path not in caches:
            caches[path] = check_cache(path, vocab)
        return caches[path]

    plans = []
    eval_seq_len = max(phase.seq_len for phase in config.phases)
    eval_sets: dict[str, EvalSet] = {}
    for index, (phase, segment) in enumerate(zip(config.phases, config.segments(), strict=True)):
        mixture = phase.mixture or config.data
        if not mixture:
            raise UsageError(
                f"phase {phase.name!r} names no data: set data (or phases[{index}].mixture) to "
                "token caches, or use keel train --preset, which trains on the bundled sample"
            )
        sources = []
        for source in mixture:
            train_range, _ = split_windows(cache(source.cache), phase.seq_len, config.eval_fraction)
            sources.append((train_range, source.weight))
            if config.eval_fraction > 0:
                _, held_out = split_windows(cache(source.cache), eval_seq_len, config.eval_fraction)
                name = source.name or cache_name(source.cache)
                _add_eval_set(eval_sets, name, EvalSet(held_out, whole=False))
        loader = MixtureLoader(
            sources,
            phase.sequences_per_step(config.batch_size),
            seed=config.seed * 1009 + index,
            position=(positions or {}).get(index, (0, 0)),
        )
        plans.append(PhasePlan(phase, segment.start_step, segment.steps, loader))
    for path, name in zip(config.eval_data, config.eval_set_names(), strict=True):
        opened = cache(path)
        windows = WindowRange(opened.path, eval_seq_len, 0, opened.num_windows(eval_seq_len))
        _add_eval_set(eval_sets, name, EvalSet(windows, whole=True))
    first = next(iter(caches.values()))
    for path, other in caches.items():
        if other.manifest.tokenizer_sha256 != first.manifest.tokenizer_sha256:
            raise ConfigError(
                f"{path} and {first.path} were tokenized with different tokenizers: "
                "a run reads caches of one tokenizer"
            )
    token_bytes = token_byte_lengths(first.tokenizer_path(), vocab)
    return RunData(plans, eval_sets, token_bytes, first.eos_id, first.tokenizer_path())


def _schedule(phases: list[PhasePlan], first_step: int) -> Iterator[tuple[PhasePlan, int]]:
    """(phase, global step) for every step from `first_step` to the end."""
    for plan in phases:
        for step in range(max(first_step, plan.start), plan.start + plan.steps):
            yield plan, step


def _telemetry_target(config: TrainConfig) -> str:
    """Where the run reports to telemetry: its `telemetry`, else $KEEL_TELEMETRY ("": nowhere)."""
    return config.telemetry or os.environ.get(TARGET_ENV, "")


def _report_event(config: TrainConfig, output: str, event: dict[str, Any]) -> None:
    """`event` as a row of telemetry's train.events, where the run reports to telemetry."""
    target = _telemetry_target(config)
    if target:
        write_record(target, EVENTS_NAMESPACE, {"run": step_output() or output, **event})


def _record_experiment(config: TrainConfig, output: str, step: int) -> None:
    """Under an experiment record (keel.core.experiment_id): an `experiment` event in the run's
    events.jsonl and a row of telemetry's experiment.runs, once per experiment the run serves."""
    experiment = current_experiment()
    if experiment is None:
        return
    if any(e["experiment"] == experiment for e in read_events(output, EXPERIMENT_EVENT)):
        return
    append_event(output, {"event": EXPERIMENT_EVENT, "step": step, "experiment": experiment})
    target = _telemetry_target(config)
    if target:
        run = step_output() or output
        write_record(target, EXPERIMENT_NAMESPACE, {"run": run, "experiment": experiment})


def _start_from(init_from: str, fresh: TrainState, model: ModelConfig) -> TrainState:
    """Fresh optimizer state with the parameters and router bias of another run's checkpoint,
    or of a Hugging Face checkpoint (`hf:DIR`, keel.train.hf_import)."""
    hf = hf_directory(init_from)
    if hf is not None:
        return hf_start_state(hf, model, fresh)
    run_dir = init_from
    source = Checkpoints(run_dir, every=1, keep=1)
    if source.latest_step() is None:
        raise UsageError(f"init_from: {run_dir} holds no checkpoint; train that run first")
    restored = source.restore(fresh)
    source.close()
    return TrainState(
        restored.params,
        fresh.opt_state,
        restored.router_bias,
        fresh.step,
        fresh.rng,
        fresh.balance_state,
    )


def _previous_config(config: TrainConfig, output: str) -> TrainConfig | None:
    """The config the run in `output` last trained under (None: a new run); raise UsageError
    when `config` changes something a resume cannot (keel.train.midrun)."""
    previous_path = paths.join(output, CONFIG_FILE)
    if not paths.exists(previous_path):
        return None
    previous = load_config(previous_path, TrainConfig)
    check_resume_changes(previous, config, output)
    return previous


def _truncate_metrics(path: str, step: int) -> None:
    """Drop metric lines past `step` (written after the checkpoint a resume starts from)."""
    if not paths.exists(path):
        return
    lines = paths.read_text(path).splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    paths.write_text(path, "".join(line + "\n" for line in kept))


def _evaluate(
    functions: StepFunctions,
    state: TrainState,
    data: RunData,
    config: TrainConfig,
    layout: RunLayout,
    seq_len: int,
) -> dict[str, Any]:
    """Bits per byte on each evaluation set (`eval/<name>/bpb`), and loss and bits per byte over
    all of them; loss by position bucket over all of them, and passkey accuracy at the phase's
    `seq_len` (keel.train.long_eval). The final evaluation (step == total_steps) scores each
    eval_data set whole."""
    final = int(state.step) == config.total_steps
    out: dict[str, Any] = {}
    by_position = LongContextTotals()
    total_nats = total_bytes = total_targets = 0.0
    for name, eval_set in data.eval_sets.items():
        whole = eval_set.whole and final
        nats = target_bytes = targets = 0.0
        batches = scored_batches(
            eval_set.windows,
            config.batch_size,
            None if whole else config.eval_batches,
            tail=eval_set.whole,
        )
        for windows, weights in batches:
            result = functions.evaluate(
                state.params,
                state.router_bias,
                place_batch(layout, windows.__getitem__, windows.shape),
                place_batch(layout, weights.__getitem__, weights.shape),
            )
            *sums, long_context = result
            nats, target_bytes, targets = (
                a + float(b) for a, b in zip((nats, target_bytes, targets), sums, strict=True)
            )
            by_position.add(windows.shape[1] - 1, long_context)
        out[f"eval/{name}/bpb"] = bits_per_byte(nats, target_bytes)
        total_nats, total_bytes, total_targets = (
            total_nats + nats,
            total_bytes + target_bytes,
            total_targets + targets,
        )
    if data.eval_sets:
        out["eval_loss"] = total_nats / max(total_targets, 1.0)
        out["eval_bpb"] = bits_per_byte(total_nats, total_bytes)
        out.update(by_position.metrics())
    out.update(_passkey(functions, state, data, config, layout, seq_len))
    return out


def _passkey(
    functions: StepFunctions,
    state: TrainState,
    data: RunData,
    config: TrainConfig,
    layout: RunLayout,
    seq_len: int,
) -> dict[str, float]:
    """`eval/passkey_accuracy` over one batch of passkey prompts of `seq_len` tokens; nothing
    when the run has no tokenizer or seq_len is too short to hide a key."""
    if seq_len not in data.passkeys:
        batch = None
        if data.tokenizer_path:
            tokenizer = Tokenizer.from_str(load_tokenizer(data.tokenizer_path).decode("utf-8"))
            batch = passkey_batch(tokenizer, seq_len, config.batch_size, config.seed)
        if batch is None:
            logger.debug("no passkey check at seq_len %d: too short to hide a key", seq_len)
        data.passkeys[seq_len] = batch
    batch = data.passkeys[seq_len]
    if batch is None:
        return {}
    *_, long_context = functions.evaluate(
        state.params,
        state.router_bias,
        place_batch(layout, batch.windows.__getitem__, batch.windows.shape),
        place_batch(layout, batch.weights.__getitem__, batch.weights.shape),
    )
    correct, targets = jax.device_get((long_context["row_correct"], long_context["row_targets"]))
    return {PASSKEY_METRIC: passkey_accuracy(correct, targets)}


def _add_eval_set(eval_sets: dict[str, EvalSet], name: str, eval_set: EvalSet) -> None:
    """Add a set under `name`; a set of the same cache is replaced (a training cache that is
    also in eval_data is evaluated whole), another cache of the same name is a ConfigError."""
    previous = eval_sets.get(name)
    if previous is not None and previous.windows.cache != eval_set.windows.cache:
        raise ConfigError(
            f"{previous.windows.cache} and {eval_set.windows.cache} would both report as "
            f"eval/{name}/bpb: rename one directory, or name the eval sets (eval_names)"
        )
    if previous is None or eval_set.whole:
        eval_sets[name] = eval_set


def _dtype(config: TrainConfig) -> jnp.dtype:
    return jnp.bfloat16 if config.compute_dtype == "bfloat16" else jnp.float32
