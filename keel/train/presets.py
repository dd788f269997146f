"""Named starting points for `keel train --preset NAME`: two that train in minutes on a laptop
CPU (on the bundled sample's 4,096-id token cache) and ~100M / ~1B dense and MoE models for one
GPU (32,768-id vocabulary, bfloat16 compute). `tiny-moe` and `tiny-dense` have matched active
parameters per token, so they compare MoE against dense at equal compute."""

from __future__ import annotations

from dataclasses import replace

from keel.core.errors import UsageError
from keel.model.config import ModelConfig, RouterConfig
from keel.train.config import Phase, TrainConfig
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


PRESETS: dict[str, TrainConfig] = {
    "tiny-moe": replace(_TINY_RUN, model=_TINY_MOE),
    "tiny-dense": replace(_TINY_RUN, model=_TINY),
    "100m-dense": _gpu_run(_GPU_100M, 32, 1024, remat=False),
    "100m-moe": _gpu_run(_moe(_GPU_100M, 16, 2, 512), 32, 1024, remat=False),
    "1b-dense": _gpu_run(_GPU_1B, 16, 2048, remat=True),
    "1b-moe": _gpu_run(_moe(_GPU_1B, 32, 4, 1024), 16, 2048, remat=True),
}


def preset(name: str) -> TrainConfig:
    """The preset called `name`; UsageError listing the names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"no preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
