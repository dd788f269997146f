"""What a training run is: the model, the optimizer, and an ordered list of phases.

A phase has a token budget, a data mixture (weights over token caches), a sequence length and a
segment of the learning-rate schedule; phases run back to back in one continuous run (global
steps keep counting) or as chained runs (`init_from` another run's checkpoint). Steps per phase =
tokens // (batch_size * seq_len), with a phase's batch_tokens // seq_len sequences in place of
batch_size where it gives batch_tokens; `steps` (the CLI's --steps) instead sets the run's total and
shares it over the phases in proportion to their budgets.

`--set` overrides reach list items by index (`apply_train_overrides`): `data.0.cache=PATH` on an
empty `data` adds item 0, and any other missing index is a one-line error showing the whole-list
form (`--set 'data=[{cache: PATH}]'`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args, get_type_hints

from keel.core import paths
from keel.core.config import apply_overrides, parse_override, to_dict
from keel.core.errors import ConfigError
from keel.core.hashing import content_hash
from keel.model.config import ModelConfig, RouterConfig
from keel.model.sharding import MeshConfig
from keel.train.optim import OptimizerConfig
from keel.train.schedule import ScheduleConfig, Segment

logger = logging.getLogger(__name__)


def cache_name(path: str) -> str:
    """A token cache's name in the metrics (`eval/<name>/bpb`): its directory's name."""
    return paths.local_path(path).name if paths.is_local(path) else path


@dataclass(frozen=True)
class DataSource:
    cache: str
    """A token cache directory (keel data tokenize)."""
    weight: float = 1.0
    """Relative share of sequences drawn from this cache."""
    name: str = field(default="", metadata={"identity": False})
    """What its held-out part reports as (`eval/<name>/bpb`); default: cache_name(cache)."""


@dataclass(frozen=True)
class Phase:
    name: str = "main"
    tokens: int = 0
    """Token budget (sequences x seq_len); 0 with a single phase means `steps` decides."""
    mixture: tuple[DataSource, ...] = ()
    """The caches to draw from; empty means the run's `data`."""
    seq_len: int = 256
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    rope_theta: float = 0.0
    """This phase's RoPE base from its first step on; 0: model.rope_theta."""
    rope_scaling: Literal["", "none", "linear", "yarn"] = ""
    """This phase's RoPE scaling (keel/model/rope.py); "": model.rope_scaling."""
    rope_factor: float = 0.0
    """This phase's RoPE scaling factor; 0: model.rope_factor."""
    batch_tokens: int = 0
    """Tokens per step: batch_tokens // seq_len sequences (seq_len must divide it), so a phase
    that grows seq_len keeps the tokens per step; 0: the run's batch_size sequences."""

    def sequences_per_step(self, batch_size: int) -> int:
        """Sequences a step of this phase draws: batch_tokens // seq_len, or `batch_size` (the
        run's) when batch_tokens is 0."""
        return self.batch_tokens // self.seq_len if self.batch_tokens else batch_size

    def model_config(self, model: ModelConfig) -> ModelConfig:
        """`model` with this phase's RoPE settings in place of its own."""
        changes = {
            name: getattr(self, name)
            for name in ("rope_theta", "rope_scaling", "rope_factor")
            if getattr(self, name)
        }
        return replace(model, **changes) if changes else model


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    phases: tuple[Phase, ...] = (Phase(),)
    data: tuple[DataSource, ...] = ()
    """The default mixture; empty means the bundled sample's token cache (the CLI builds it)."""
    batch_size: int = 16
    """Sequences per step (global, over all devices)."""
    steps: int = 0
    """Total steps; 0 derives them from the phases' token budgets."""
    seed: int = 0
    """Seeds the initial parameters and the data order."""
    eval_fraction: float = 0.05
    """The last fraction of each training cache's windows is held out for evaluation."""
    eval_data: tuple[str, ...] = ()
    """Further token caches evaluated (bits per byte) alongside the held-out windows: at most
    eval_batches batches at intermediate evaluations, the whole cache at the final one (every
    token after the first scored once, the last partial window included)."""
    eval_names: tuple[str, ...] = field(default=(), metadata={"identity": False})
    """The name of each eval_data cache in the metrics (`eval/<name>/bpb`), in order; empty:
    each cache directory's name. `keel train --eval-data FILE` names a set by FILE's stem. Not
    part of the run's identity: it labels the numbers, it does not change them."""
    eval_every: int = 100
    eval_batches: int = 8
    """Batches per evaluation and cache (at most)."""
    eval_tasks: tuple[str, ...] = field(default=(), metadata={"identity": False})
    """lm-eval tasks scored during training with the current parameters (keel.train.task_scores):
    a bundled task name (gsm8k_sample, wikitext_cloze) or an lm-eval task YAML over local data,
    as `keel eval` takes them; each metric logged as `eval_task/<task>/<metric>`. Empty: none,
    and lm-eval is never imported. Needs the eval extra. Not part of the run's identity: it
    measures the run, it does not change it."""
    eval_tasks_every: int = field(default=0, metadata={"identity": False})
    """Steps between task evaluations (and the last step); 0: eval_every."""
    eval_tasks_limit: int = field(default=100, metadata={"identity": False})
    """Documents per task at each task evaluation (lm-eval's limit, `keel eval --limit`): bounds
    its cost (wikitext_cloze: 4 requests a document); 0: every document."""
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    """The newest checkpoints kept (older ones are deleted as new ones are written)."""
    keep_every: int = field(default=0, metadata={"identity": False})
    """Also keep every checkpoint whose step is a multiple of this, for good (0: none): points a
    branch (`keel train --from RUN:STEP`) can start from later. Not part of the run's identity:
    it says what to keep, not what to train."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the forward and backward pass; parameters and optimizer state stay float32."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Devices per mesh axis (data, fsdp, expert; see keel.model.sharding); the batch is split
    over all of them. Default: every visible device a data-parallel replica."""
    expert_parallel: int = field(default=0, metadata={"legacy": True, "identity": False})
    """Replaced by mesh.expert; a config that still sets it is read as mesh.expert."""
    mask_documents: bool = False
    """Attention stays inside a document; the target after an EOS carries no loss."""
    remat: bool = False
    """Recompute each block's activations in the backward pass (less memory, ~1/3 more FLOPs)."""
    init_from: str = ""
    """A run directory whose last checkpoint's parameters (and router bias) start this run."""
    peak_flops: float = 0.0
    """Peak FLOP/s per device for MFU; 0 looks the device up (GPUs) or measures a matmul (CPU)."""
    telemetry: str = field(default="", metadata={"identity": False})
    """A telemetry store directory or `keel logs serve` URL: each step's metrics are also written
    to its train.metrics namespace (ts, run, step, name, value). Empty: $KEEL_TELEMETRY if set,
    else metrics.jsonl only. Not part of the run's identity: it says where to report, not what."""

    def __post_init__(self) -> None:
        legacy = self.expert_parallel
        if not legacy:
            return
        if self.mesh.expert not in (1, legacy):
            raise ConfigError(
                f"expert_parallel ({legacy}) and mesh.expert ({self.mesh.expert}) disagree: "
                "expert_parallel is replaced by mesh.expert; remove it"
            )
        if legacy > 1:
            logger.warning(
                "expert_parallel is replaced by mesh.expert: read as mesh.expert=%d (write "
                "mesh: {expert: %d} in the config)",
                legacy,
                legacy,
            )
        object.__setattr__(self, "mesh", replace(self.mesh, expert=legacy))
        object.__setattr__(self, "expert_parallel", 0)

    def validate(self) -> TrainConfig:
        self.model.validate()
        self.mesh.validate()
        self.optimizer.validate()
        if not self.phases:
            raise ConfigError("phases is empty: a run needs at least one phase")
        if self.batch_size < 1 or self.steps < 0:
            raise ConfigError("batch_size must be >= 1 and steps >= 0")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        for every in ("eval_every", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, every) < 1:
                raise ConfigError(f"{every} must be at least 1, got {getattr(self, every)}")
        if self.eval_tasks_every < 0 or self.eval_tasks_limit < 0:
            raise ConfigError(
                "eval_tasks_every and eval_tasks_limit must be >= 0 (0: eval_every, every "
                f"document), got {self.eval_tasks_every} and {self.eval_tasks_limit}"
            )
        if self.keep_every < 0:
            raise ConfigError(f"keep_every must be 0 (none) or a step count, got {self.keep_every}")
        for phase in self.phases:
            if phase.seq_len < 1 or phase.tokens < 0:
                raise ConfigError(f"phase {phase.name!r}: seq_len must be >= 1 and tokens >= 0")
            if phase.rope_theta < 0 or phase.rope_factor < 0:
                raise ConfigError(
                    f"phase {phase.name!r}: rope_theta and rope_factor must be > 0 (or 0: the "
                    "model's)"
                )
            if phase.batch_tokens < 0 or phase.batch_tokens % phase.seq_len:
                raise ConfigError(
                    f"phase {phase.name!r}: batch_tokens ({phase.batch_tokens}) must be a "
                    f"multiple of seq_len ({phase.seq_len}) (0: batch_size sequences), e.g. "
                    f"{max(phase.batch_tokens // phase.seq_len, 1) * phase.seq_len}"
                )
            model = phase.model_config(self.model)
            try:
                model.validate()
            except ConfigError as error:
                raise ConfigError(f"phase {phase.name!r}: {error}") from error
            model.check_rope_length(phase.seq_len, f"phase {phase.name!r}")
            for source in phase.mixture or self.data:
                if source.weight <= 0:
                    raise ConfigError(f"phase {phase.name!r}: weight of {source.cache} must be > 0")
        self.eval_set_names()
        self.segments()
        return self

    def eval_set_names(self) -> tuple[str, ...]:
        """The metric name of each eval_data cache (eval_names, or the directory's name)."""
        if self.eval_names and len(self.eval_names) != len(self.eval_data):
            raise ConfigError(
                f"eval_names names {len(self.eval_names)} sets, eval_data has "
                f"{len(self.eval_data)}: give one name per eval_data cache, or none"
            )
        names = self.eval_names or tuple(cache_name(cache) for cache in self.eval_data)
        for name in self.eval_names:
            if not name or "/" in name:
                raise ConfigError(f"eval set name {name!r} must be non-empty and have no '/'")
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ConfigError(
                f"two eval sets are named {repeated[0]!r}: their eval/{repeated[0]}/bpb would "
                "clash; rename one (eval_names, or the file)"
            )
        return names

    def phase_steps(self) -> list[int]:
        """Steps of each phase, in order."""
        budgets = [phase.tokens for phase in self.phases]
        if self.steps:
            if not any(budgets):
                budgets = [1] * len(budgets)
            total = sum(budgets)
            edges = [round(self.steps * sum(budgets[: i + 1]) / total) for i in range(len(budgets))]
            steps = [b - a for a, b in zip([0, *edges], edges, strict=False)]
        else:
            steps = [
                p.tokens // (p.sequences_per_step(self.batch_size) * p.seq_len) for p in self.phases
            ]
        for phase, count in zip(self.phases, steps, strict=True):
            if count < 1:
                raise ConfigError(
                    f"phase {phase.name!r} gets no steps: give it a token budget of at least "
                    f"batch_size x seq_len = "
                    f"{phase.sequences_per_step(self.batch_size) * phase.seq_len} tokens, or set "
                    "steps"
                )
        return steps

    def segments(self) -> list[Segment]:
        """The schedule segment of each phase, on the global step axis."""
        segments, start = [], 0
        for phase, count in zip(self.phases, self.phase_steps(), strict=True):
            segments.append(Segment(start, count, phase.schedule))
            start += count
        return segments

    def warmup_overruns(self) -> list[str]:
        """One line per phase whose warmup is longer than the phase (a short smoke run of a
        preset): allowed, the phase ends while its lr still rises and never reaches the peak."""
        return [
            f"phases.{index}.schedule.warmup_steps ({phase.schedule.warmup_steps}) is longer than "
            f"phase {phase.name!r}'s {count} steps: it ends during warmup, below the peak lr "
            f"(--set phases.{index}.schedule.warmup_steps={max(count // 10, 1)} to warm up in it)"
            for index, (phase, count) in enumerate(
                zip(self.phases, self.phase_steps(), strict=True)
            )
            if phase.schedule.warmup_steps > count
        ]

    def evaluates_tasks(self, step: int) -> bool:
        """Whether the eval_tasks are scored after `step` updates: every eval_tasks_every steps
        (0: eval_every) and at the last step; never without eval_tasks."""
        every = self.eval_tasks_every or self.eval_every
        return bool(self.eval_tasks) and (step % every == 0 or step == self.total_steps)

    @property
    def total_steps(self) -> int:
        return sum(self.phase_steps())

    def identity(self) -> str:
        """The run's identity: SHA-256 of the canonical config, without the fields that only
        label or report (eval_names, telemetry, DataSource.name). Equal identities train the
        same run."""
        return content_hash(self)

    def contradictions(self) -> list[str]:
        """Settings this config holds that another setting makes meaningless, one line each
        naming both (MoE settings on a dense model; a dense width no block uses)."""
        model, default = self.model, ModelConfig()
        if not model.is_moe:
            moe_only = _changed(model, default, _MOE_ONLY, "model")
            moe_only += _changed(model.router, default.router, _ROUTER, "model.router")
            if moe_only:
                what = "an MoE setting" if len(moe_only) == 1 else "MoE settings"
                return [
                    f"{', '.join(moe_only)}: {what}, but model.n_routed_experts is 0 (a dense "
                    "model), so it does nothing; set model.n_routed_experts for an MoE model, or "
                    "remove it"
                ]
        elif model.n_dense_layers == 0 and model.ffn_dim != default.ffn_dim:
            return [
                f"model.ffn_dim={model.ffn_dim} does nothing: model.n_dense_layers is 0, so every "
                "block of this MoE model is MoE (expert_ffn_dim sets their width)"
            ]
        return []

    def with_data(self, caches: tuple[str, ...]) -> TrainConfig:
        """This config drawing from `caches` (equal weights) where it names no data."""
        if self.data or all(phase.mixture for phase in self.phases):
            return self
        return replace(self, data=tuple(DataSource(cache) for cache in caches))


_MOE_ONLY = (
    "top_k", "n_shared_experts", "expert_ffn_dim", "latent_dim", "n_dense_layers",
    "send_capacity", "receive_capacity", "dispatch_waves", "dropless",
)  # fmt: skip
"""ModelConfig fields that only an MoE model (n_routed_experts > 0) uses, besides `router`."""
_ROUTER = tuple(f.name for f in dataclasses.fields(RouterConfig))


def _changed(config: Any, default: Any, names: Sequence[str], where: str) -> list[str]:
    """`where.name=value` for each of `names` whose value in `config` differs from `default`."""
    return [
        f"{where}.{name}={getattr(config, name)}"
        for name in names
        if getattr(config, name) != getattr(default, name)
    ]


def apply_train_overrides(config: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """`config` with each `--set key=value` applied in order (keel.core.config.apply_overrides),
    where a key may also add a list's next item: `data.0.cache=PATH` on an empty `data`,
    `eval_data.0=PATH`, `phases.1.seq_len=512` on one phase. An index past that is a ConfigError
    showing the form that works."""
    for text in overrides:
        config = apply_overrides(config, [_with_list_item(config, text)])
    return config


def _with_list_item(config: TrainConfig, text: str) -> str:
    """`text`, or when it names a list's next item, the override that sets the whole list."""
    keys, value = parse_override(text)
    node: Any = config
    for depth, key in enumerate(keys):
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            if key not in {f.name for f in dataclasses.fields(node)}:
                return text  # apply_overrides names the unknown key
            item_type = _item_type(get_type_hints(type(node))[key])
            node = getattr(node, key)
            continue
        if not (isinstance(node, tuple) and key.isdigit()):
            return text
        index, where = int(key), ".".join(keys[:depth])
        if index < len(node):
            node = node[index]
            continue
        whole = f"--set '{where}=[{_example(item_type)}]'"
        if index > len(node):
            raise ConfigError(
                f"--set {text}: {where} has {len(node)} items: add item {len(node)} next "
                f"(--set {where}.{len(node)}...), or set the list as a whole: {whole}"
            )
        item = value
        for name in reversed(keys[depth + 1 :]):
            item = {name: item}
        items = [to_dict(x) if dataclasses.is_dataclass(x) else x for x in node]
        if dataclasses.is_dataclass(item_type) and not isinstance(item, dict):
            raise ConfigError(f"--set {text}: {where}.{index} is a mapping; e.g. {whole}")
        missing = _missing_keys(item_type, item)
        if missing:
            raise ConfigError(
                f"--set {text}: a new item of {where} needs {', '.join(missing)}: set "
                f"{where}.{index}.{missing[0]} first, or the list as a whole: {whole}"
            )
        return f"{where}={json.dumps([*items, item])}"
    return text


def _item_type(annotation: Any) -> Any:
    """X of a tuple[X, ...] annotation (None for anything else)."""
    args = get_args(annotation)
    return args[0] if len(args) == 2 and args[1] is Ellipsis else None


def _missing_keys(item_type: Any, item: Any) -> list[str]:
    if not (dataclasses.is_dataclass(item_type) and isinstance(item, dict)):
        return []
    return [f.name for f in dataclasses.fields(item_type)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            and f.name not in item]  # fmt: skip


def _example(item_type: Any) -> str:
    """A one-item list body in YAML flow style, e.g. `{cache: PATH}`."""
    if not dataclasses.is_dataclass(item_type):
        return "PATH"
    required = _missing_keys(item_type, {}) or [dataclasses.fields(item_type)[0].name]
    return "{" + ", ".join(f"{name}: ..." if name != "cache" else "cache: PATH"
                           for name in required) + "}"  # fmt: skip
