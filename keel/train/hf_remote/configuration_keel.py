"""transformers configuration of a keel model exported with `keel export --format hf` (remote
code: loaded with `trust_remote_code=True`; keel itself never imports this file).

Standard names where transformers has one (hidden_size, num_hidden_layers, ...); keel's own
settings (partial and scaled RoPE, QK-norm, shared experts, latent projection, sigmoid router
scores, dense-first layers) under names of their own, read by modeling_keel.py.
"""

from transformers import PretrainedConfig


class KeelConfig(PretrainedConfig):
    """A decoder-only keel transformer: GQA attention with (partial) RoPE and optional QK-norm,
    RMSNorm, SwiGLU; MoE blocks after the first `first_dense_layers` when num_experts > 0."""

    model_type = "keel"

    def __init__(
        self,
        vocab_size: int = 4096,
        hidden_size: int = 256,
        intermediate_size: int = 768,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int = 64,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 2048,
        qk_norm: bool = True,
        rotary_dim: int = 64,
        rotary_base: float = 10_000.0,
        rotary_scaling: str = "none",
        rotary_factor: float = 1.0,
        rotary_original_length: int = 0,
        yarn_beta_fast: float = 32.0,
        yarn_beta_slow: float = 1.0,
        num_experts: int = 0,
        num_experts_per_tok: int = 2,
        moe_intermediate_size: int = 256,
        shared_expert_intermediate_size: int = 0,
        latent_dim: int = 0,
        first_dense_layers: int = 0,
        router_score: str = "softmax",
        norm_topk_prob: bool = True,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        **kwargs,
    ):
        """Sizes are counts (ids, features, layers, heads, experts); rotary_dim: dimensions per
        head RoPE rotates (even, <= head_dim); rotary_scaling: "none", "linear" or "yarn"
        (keel/model/rope.py); shared_expert_intermediate_size: hidden width of the shared
        experts as one SwiGLU (0: none); latent_dim: routed experts work at this width (0:
        hidden_size); router_score: "softmax" or "sigmoid"."""
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.qk_norm = qk_norm
        self.rotary_dim = rotary_dim
        self.rotary_base = rotary_base
        self.rotary_scaling = rotary_scaling
        self.rotary_factor = rotary_factor
        self.rotary_original_length = rotary_original_length
        self.yarn_beta_fast = yarn_beta_fast
        self.yarn_beta_slow = yarn_beta_slow
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.latent_dim = latent_dim
        self.first_dense_layers = first_dense_layers
        self.router_score = router_score
        self.norm_topk_prob = norm_topk_prob
        self.initializer_range = initializer_range
        self.tie_word_embeddings = tie_word_embeddings
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
