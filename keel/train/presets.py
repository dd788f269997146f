"""Named starting points for `keel train --preset NAME`: two that train in minutes on a laptop
CPU (on the bundled sample's 4,096-id token cache), `cpu-speedrun` (the quickest to a given
quality on your own text on a CPU: `keel train --preset cpu-speedrun --data FILE.txt`), and
~100M / ~1B dense and MoE models for one GPU (32,768-id vocabulary, bfloat16 compute).
`tiny-moe` and `tiny-dense` have matched active parameters per token, so they compare MoE
against dense at equal compute.

A config file may start from a preset (`load_run_config`): `preset: tiny-moe` and, on top, any
TrainConfig keys (a mapping merges key by key into the preset's, a list or value replaces it).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import yaml

from keel.core import paths
from keel.core.config import from_dict, load_config, to_dict
from keel.core.errors import ConfigError, UsageError
from keel.model.config import ModelConfig, RouterConfig
from keel.model.sharding import MeshConfig
from keel.train.config import Phase, TrainConfig, apply_train_overrides
from keel.train.optim import OptimizerConfig
from keel.train.schedule import ScheduleConfig

_TINY = ModelConfig(
    vocab_size=4096,
    d_model=128,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    ffn_dim=384,
)
_TINY_MOE = replace(
    _TINY,
    n_routed_experts=8,
    top_k=2,
    n_shared_experts=1,
    expert_ffn_dim=128,
    n_dense_layers=1,
    router=RouterConfig(bias_rate=1e-2),  # a short run: balance within tens of steps
)
_TINY_RUN = TrainConfig(
    batch_size=16,
    steps=300,
    phases=(Phase(seq_len=128, schedule=ScheduleConfig(peak_lr=3e-3, warmup_steps=30)),),
    optimizer=OptimizerConfig(name="adamw"),
    eval_every=100,
    eval_batches=8,
    checkpoint_every=100,
)

# The fastest recipe found to nanoGPT's CPU quality on ~1 MB of English text on 2 cores
# (docs/scaling/cpu-speedrun-search.md): tiny's width and 4,096-id BPE, one layer, 30 steps with
# a 3-step warmup, evaluated once at the end. Most of such a run is fixed cost (tokenizer, start,
# compile, the final evaluation), so fewer, cheaper steps win; 4,096 ids beat 2,048 (2.79 bpb at
# the same steps) and 8,192 (better per step, slower per step and to evaluate).
_CPU_SPEEDRUN = replace(
    _TINY_RUN,
    model=replace(_TINY, n_layers=1),
    steps=30,
    phases=(Phase(seq_len=128, schedule=ScheduleConfig(peak_lr=3e-3, warmup_steps=3)),),
    eval_every=30,
    checkpoint_every=30,
)

_GPU_100M = ModelConfig(
    vocab_size=32768,
    d_model=768,
    n_layers=12,
    n_heads=12,
    n_kv_heads=4,
    head_dim=64,
    ffn_dim=2048,
)
_GPU_1B = ModelConfig(
    vocab_size=32768,
    d_model=2048,
    n_layers=16,
    n_heads=16,
    n_kv_heads=8,
    head_dim=128,
    ffn_dim=5632,
)


def _gpu_run(model: ModelConfig, batch_size: int, seq_len: int, remat: bool) -> TrainConfig:
    return TrainConfig(
        model=model,
        batch_size=batch_size,
        steps=5000,
        phases=(Phase(seq_len=seq_len, schedule=ScheduleConfig(peak_lr=1e-3, warmup_steps=500)),),
        compute_dtype="bfloat16",
        remat=remat,
        eval_every=500,
        checkpoint_every=1000,
    )


def _moe(model: ModelConfig, experts: int, top_k: int, expert_ffn: int) -> ModelConfig:
    return replace(
        model,
        n_routed_experts=experts,
        top_k=top_k,
        n_shared_experts=1,
        expert_ffn_dim=expert_ffn,
        n_dense_layers=1,
    )


# The flagship shape of the system keel models: 48 blocks of width 6144, 384 routed experts (top 8)
# plus 2 shared, the routed experts working in a 3072-wide latent (tokens are projected down before
# the all-to-all and up after it, as in NVIDIA's LatentMoE, Nemotron 3 Super/Ultra). The widths the
# issue leaves open, taken from public models of this class so that model_size() gives 523.5B
# total (-2.1% of 535B) and 23.2B active (+1.0% of 23B):
# - attention: 48 heads x head_dim 128 (query width = d_model) and 8 KV heads, as Nemotron-4's
#   6144-wide models (48 heads, head_dim 128) with the GQA-8 of Nemotron-4 340B; 64 heads (Kimi
#   K2, DeepSeek-V3) would put the active count at 24.4B, 6% over.
# - expert_ffn_dim 3072: each expert a [3072 -> 3072 -> 3072] SwiGLU; the routed experts are
#   48 - 1 layers x 384 x 3 x 3072^2 = 511B of the total. The 2 shared experts run at d_model
#   (as LatentMoE keeps its shared expert at full width), hidden 2 x 3072.
# - n_dense_layers 1 with ffn_dim 18432 (= 3 x d_model): Kimi K2's first_k_dense_replace = 1 and
#   its dense ffn width (18432; DeepSeek-V3 the same).
# - vocab 131072 (Nemotron 3, Mistral NeMo), tied embeddings (untied would add 0.8B active: 24.0B).
# - sigmoid router scores with normalised top-k gates, as DeepSeek-V3 and Kimi K2.
# Sources: Kimi K2 config (NeMo Megatron-Bridge KimiK2Provider: 61 layers, 7168 wide, 384 experts
# top 8, moe_ffn 2048, ffn 18432, 64 heads); DeepSeek-V3 (arXiv:2412.19437); NVIDIA Nemotron 3
# (arXiv:2512.20856) and LatentMoE (Elango et al. 2026): d 4096 -> latent 1024 in Super; Nemotron-4
# 340B config (96 heads, 8 KV heads). Compute bfloat16 with remat; one 4096-token sequence per
# device of a 64-device expert-parallel domain (batch 64): the plan (docs/planning.md) reports
# what that needs per device.
_535B_A23B = ModelConfig(
    vocab_size=131072,
    d_model=6144,
    n_layers=48,
    n_heads=48,
    n_kv_heads=8,
    head_dim=128,
    ffn_dim=18432,
    n_routed_experts=384,
    top_k=8,
    n_shared_experts=2,
    expert_ffn_dim=3072,
    n_dense_layers=1,
    latent_dim=3072,
    router=RouterConfig(score="sigmoid"),
)
_535B_A23B_RUN = replace(
    _gpu_run(_535B_A23B, 64, 4096, remat=True),
    phases=(Phase(seq_len=4096, schedule=ScheduleConfig(peak_lr=2.2e-4, warmup_steps=500)),),
    mesh=MeshConfig(data=1, fsdp=1, expert=64),
)

PRESETS: dict[str, TrainConfig] = {
    "tiny-moe": replace(_TINY_RUN, model=_TINY_MOE),
    "tiny-dense": replace(_TINY_RUN, model=_TINY),
    "cpu-speedrun": _CPU_SPEEDRUN,
    "100m-dense": _gpu_run(_GPU_100M, 32, 1024, remat=False),
    "100m-moe": _gpu_run(_moe(_GPU_100M, 16, 2, 512), 32, 1024, remat=False),
    "1b-dense": _gpu_run(_GPU_1B, 16, 2048, remat=True),
    "1b-moe": _gpu_run(_moe(_GPU_1B, 32, 4, 1024), 16, 2048, remat=True),
    "535b-a23b": _535B_A23B_RUN,
}


def preset(name: str) -> TrainConfig:
    """The preset called `name`; UsageError listing the names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"no preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


PRESET_KEY = "preset"
"""The key of a config file that names the preset it starts from."""


def load_run_config(source: str, overrides: Sequence[str] = ()) -> TrainConfig:
    """The TrainConfig in a .yaml/.yml/.json file, then `--set` overrides (list items by index
    too: apply_train_overrides). A file with `preset: NAME` starts from that preset: its other
    keys go on top, a mapping merged key by key (`model: {top_k: 1}` changes top_k only), a list
    or a value replacing the preset's; so `preset: tiny-moe` + `model: {top_k: 1}` is
    `--preset tiny-moe --set model.top_k=1`."""
    data = _mapping(source)
    if data is None or PRESET_KEY not in data:
        return apply_train_overrides(load_config(source, TrainConfig), overrides)
    name = data[PRESET_KEY]
    if not isinstance(name, str) or name not in PRESETS:
        raise UsageError(f"{source}: no preset {name!r}; choose one of: {', '.join(PRESETS)}")
    rest = {key: value for key, value in data.items() if key != PRESET_KEY}
    try:
        config = from_dict(TrainConfig, _merged(to_dict(PRESETS[name]), rest))
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from err
    return apply_train_overrides(config, overrides)


def _mapping(source: str) -> Mapping[str, Any] | None:
    """The file's top-level mapping; None when it cannot be read as one (load_config then says
    why in one line)."""
    suffix = pathlib.PurePosixPath(os.fspath(source)).suffix.lower()
    if suffix not in (".yaml", ".yml", ".json") or not paths.exists(source):
        return None
    try:
        data = yaml.safe_load(paths.read_text(source))  # JSON is YAML here too
    except yaml.YAMLError:
        return None
    return data if isinstance(data, Mapping) else None


def _merged(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `top`'s keys on it: mappings merged recursively, anything else replaced."""
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        both = isinstance(below, Mapping) and isinstance(value, Mapping)
        merged[key] = _merged(below, value) if both else value
    return merged
