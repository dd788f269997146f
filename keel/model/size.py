"""Parameter counts and training FLOPs, computed from the config alone (no arrays).

Active parameters are those one token passes through: the routed experts count top_k of
n_routed_experts. FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B): 6 x the
active matmul parameters (forward 2, backward 4; the output projection included, the embedding
lookup not) plus 12 x layers x heads x head_dim x seq for attention scores and values.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.model.config import ModelConfig


@dataclass(frozen=True)
class ModelSize:
    total: int
    """Every parameter, embeddings included."""
    active: int
    """Parameters one token uses (embeddings included, top_k of the routed experts)."""
    active_matmul: int
    """Active parameters in matrix products: active minus the embedding table and norm scales
    (the output projection counts, tied or not)."""


def model_size(config: ModelConfig) -> ModelSize:
    d, hd = config.d_model, config.head_dim
    attention = d * hd * (2 * config.n_heads + 2 * config.n_kv_heads)
    norms_per_block = 2 * d + (2 * hd)
    dense_mlp = 3 * d * config.ffn_dim
    expert_width = config.latent_dim or d
    expert = 3 * expert_width * config.expert_ffn_dim
    latent = 2 * d * config.latent_dim
    shared = 3 * d * config.n_shared_experts * config.expert_ffn_dim
    router = d * config.n_routed_experts
    moe_common = attention + router + latent + shared
    dense_layers, moe_layers = config.n_dense_blocks, config.n_moe_layers
    blocks_total = dense_layers * (attention + dense_mlp) + moe_layers * (
        moe_common + config.n_routed_experts * expert
    )
    blocks_active = dense_layers * (attention + dense_mlp) + moe_layers * (
        moe_common + config.top_k * expert
    )
    embed = config.vocab_size * d
    unembed = 0 if config.tied_embeddings else config.vocab_size * d
    norms = config.n_layers * norms_per_block + d
    return ModelSize(
        total=embed + unembed + blocks_total + norms,
        active=embed + unembed + blocks_active + norms,
        active_matmul=blocks_active + config.vocab_size * d,
    )


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at this sequence length."""
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * seq_len
    return 6.0 * model_size(config).active_matmul + attention
