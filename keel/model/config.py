"""The model's shape: one frozen dataclass, dense when `n_routed_experts == 0`.

Sizes are counts (ids, features, layers, experts); capacities are factors over the expected
load. `validate()` checks the combination before anything is traced or compiled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args, get_type_hints

from keel.core.errors import ConfigError


@dataclass(frozen=True)
class RouterConfig:
    """How tokens choose experts and how the load is balanced (no auxiliary loss)."""

    score: Literal["softmax", "sigmoid"] = "softmax"
    """Scores from router logits: softmax over experts, or an independent sigmoid per expert."""
    balance: str = "sign"
    """The balancing rule (keel/model/balance.py's registry) that moves the per-expert bias each
    step: "sign" (DeepSeek-V3: b += rate * sign(mean - load)), "quantile" (b moves toward the
    bias that would give each expert tokens * top_k / experts selections, read off per-expert
    score quantiles), "histogram" ("quantile" read off per-expert score-margin histograms summed
    over the last histogram_window batches), "none", or any rule registered with
    register_balance_rule."""
    bias_rate: float = 1e-3
    """Step size of the bias update (score units per step)."""
    normalize_gates: bool = True
    """Divide the top-k gates by their sum (the gates come from unbiased scores)."""
    z_loss_weight: float = 1e-3
    """Weight of the router z-loss mean(logsumexp(router_logits)^2)."""
    histogram_bins: int = 10_000
    """"histogram" rule: bins per expert's score-margin histogram."""
    histogram_window: int = 8
    """"histogram" rule: batches whose histograms are summed (the state holds window * experts *
    bins float32 counts per MoE layer)."""
    seq_balance_weight: float = 0.0
    """Weight alpha of DeepSeek-V3's complementary sequence-wise balance loss, added to the
    training loss (0: off). Per sequence of T tokens: alpha * sum_i f_i * P_i with f_i = E / (K * T)
    * tokens routed to expert i and P_i the mean normalized score of expert i."""


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: GQA attention with (partial) RoPE and optional QK-norm,
    RMSNorm, SwiGLU; MoE blocks after the first `n_dense_layers` when `n_routed_experts > 0`."""

    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    attention: Literal["auto", "blockwise", "xla", "cudnn"] = "auto"
    """Attention implementation (keel.model.attend): "xla" forms the S x S scores, "blockwise" an
    online softmax over key blocks (memory linear in S), "cudnn" the fused kernel on NVIDIA GPUs
    (16-bit compute, no document masks), "auto" cudnn where it can, else blockwise from 2K tokens
    per sequence, else xla."""
    head_dim: int = 64
    ffn_dim: int = 768
    """Hidden width of the dense SwiGLU blocks."""
    rope_theta: float = 10_000.0
    rope_scaling: Literal["none", "linear", "yarn"] = "none"
    """How RoPE stretches past the trained length (keel/model/rope.py): "linear" (position
    interpolation: frequencies / rope_factor) or "yarn" (interpolate the slow dimensions only,
    plus an attention temperature)."""
    rope_factor: float = 1.0
    """The context extension factor s (new length / rope_original_len), >= 1."""
    rope_original_len: int = 0
    """Tokens per sequence the model was trained at before scaling; YaRN needs it."""
    yarn_beta_fast: float = 32.0
    """YaRN: dimensions turning more than this many times over rope_original_len are kept."""
    yarn_beta_slow: float = 1.0
    """YaRN: dimensions turning fewer than this many times are interpolated (/ rope_factor)."""
    rotary_fraction: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates (partial RoPE below 1)."""
    qk_norm: bool = True
    tied_embeddings: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02
    n_routed_experts: int = 0
    top_k: int = 2
    n_shared_experts: int = 0
    """Experts every token goes through, run as one SwiGLU of width
    n_shared_experts * expert_ffn_dim."""
    expert_ffn_dim: int = 256
    send_capacity: float = 1.10
    """Expert parallel: slots per destination device, as a factor of the even share
    (tokens_per_device * top_k / devices)."""
    receive_capacity: float = 1.15
    """Expert parallel: rows a device computes, as a factor of tokens_per_device * top_k."""
    dispatch_waves: int = 1
    """Expert parallel: the exchange split into this many all-to-alls of equal size, one after
    another; the receiver runs its experts per wave, so only one wave's rows are alive."""
    dropless: Literal["off", "pools", "ragged"] = "off"
    """Expert parallel without capacity drops: "pools" sizes the send and receive pools to the
    worst case (every assignment to one device; runs everywhere, ~N x the memory of capacity
    1.0), "ragged" exchanges exactly the routed rows with jax.lax.ragged_all_to_all (GPU and
    TPU only; XLA:CPU does not implement it). "off": send_capacity and receive_capacity apply."""
    latent_dim: int = 0
    """When > 0, tokens are projected to this width before the exchange and experts work there."""
    grouped_matmul: Literal["auto", "ragged", "blocks"] = "auto"
    """How routed experts multiply their rows: "ragged" (jax.lax.ragged_dot), "blocks"
    (expert-aligned blocks), "auto" (ragged on TPU, blocks elsewhere; see grouped.py)."""
    n_dense_layers: int = 0
    """The first layers use a dense SwiGLU even in an MoE model."""
    router: RouterConfig = field(default_factory=RouterConfig)
    z_loss_weight: float = 1e-4
    """Weight of the output z-loss mean(logsumexp(logits)^2)."""

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers if self.is_moe else 0

    @property
    def n_dense_blocks(self) -> int:
        return self.n_layers - self.n_moe_layers

    @property
    def rotary_dim(self) -> int:
        """Dimensions per head that RoPE rotates: even, at most head_dim."""
        return int(self.head_dim * self.rotary_fraction) // 2 * 2

    def validate(self) -> ModelConfig:
        """Raise ConfigError naming the first inconsistent setting; return self."""
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be at least 1, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention"
            )
        self._validate_attention()
        if not 0.0 <= self.rotary_fraction <= 1.0:
            raise ConfigError(
                f"model.rotary_fraction must be in [0, 1], got {self.rotary_fraction}"
            )
        self._validate_rope()
        if self.n_routed_experts < 0:
            raise ConfigError(f"model.n_routed_experts must be >= 0, got {self.n_routed_experts}")
        if not self.is_moe:
            if self.ffn_dim < 1:
                raise ConfigError(f"model.ffn_dim must be at least 1, got {self.ffn_dim}")
            return self
        if not 1 <= self.top_k <= self.n_routed_experts:
            raise ConfigError(
                f"model.top_k ({self.top_k}) must be between 1 and model.n_routed_experts "
                f"({self.n_routed_experts})"
            )
        if not 0 <= self.n_dense_layers < self.n_layers:
            raise ConfigError(
                f"model.n_dense_layers ({self.n_dense_layers}) must leave at least one MoE layer "
                f"of model.n_layers ({self.n_layers})"
            )
        if self.n_dense_layers and self.ffn_dim < 1:
            raise ConfigError(f"model.ffn_dim must be at least 1, got {self.ffn_dim}")
        if self.expert_ffn_dim < 1 or self.n_shared_experts < 0 or self.latent_dim < 0:
            raise ConfigError(
                "model.expert_ffn_dim must be >= 1, and model.n_shared_experts and "
                "model.latent_dim >= 0"
            )
        if self.send_capacity <= 0 or self.receive_capacity <= 0 or self.dispatch_waves < 1:
            raise ConfigError(
                "model.send_capacity and model.receive_capacity must be > 0 and "
                "model.dispatch_waves >= 1"
            )
        if self.dropless not in ("off", "pools", "ragged"):
            raise ConfigError(
                f"model.dropless must be 'off', 'pools' or 'ragged', got {self.dropless!r}"
            )
        if self.dropless == "ragged" and _jax_backend() == "cpu":
            raise ConfigError(
                "model.dropless: ragged needs jax.lax.ragged_all_to_all, which XLA:CPU does not "
                "implement; use model.dropless: pools on CPU"
            )
        from keel.model.balance import balance_rule  # the registry imports jax

        balance_rule(self.router.balance)
        if self.router.bias_rate < 0:
            raise ConfigError(f"model.router.bias_rate must be >= 0, got {self.router.bias_rate}")
        router = self.router
        if router.histogram_bins < 2 or router.histogram_window < 1:
            raise ConfigError(
                "model.router.histogram_bins must be >= 2 and model.router.histogram_window >= 1"
            )
        if router.seq_balance_weight < 0:
            raise ConfigError(
                f"model.router.seq_balance_weight must be >= 0, got {router.seq_balance_weight}"
            )
        return self

    def _validate_rope(self) -> None:
        """RoPE base and scaling: a factor that stretches, and the lengths YaRN needs."""
        if self.rope_theta <= 1.0:
            raise ConfigError(f"model.rope_theta must be > 1, got {self.rope_theta}")
        if self.rope_scaling not in ("none", "linear", "yarn"):
            raise ConfigError(
                f"model.rope_scaling must be none, linear or yarn, got {self.rope_scaling!r}"
            )
        if self.rope_scaling == "none":
            if self.rope_factor != 1.0:
                raise ConfigError(
                    f"model.rope_factor={self.rope_factor} does nothing with model.rope_scaling="
                    "none: set model.rope_scaling=linear or yarn, or remove it"
                )
            return
        if self.rope_factor < 1.0:
            raise ConfigError(
                f"model.rope_factor must be >= 1 (new length / original length), got "
                f"{self.rope_factor}"
            )
        if self.rope_original_len < 0:
            raise ConfigError(f"model.rope_original_len must be >= 0, got {self.rope_original_len}")
        if self.rope_scaling == "yarn":
            if self.rope_original_len < 1:
                raise ConfigError(
                    "model.rope_scaling=yarn needs model.rope_original_len: the sequence length "
                    "(tokens) the model was trained at"
                )
            if not 0 < self.yarn_beta_slow < self.yarn_beta_fast:
                raise ConfigError(
                    f"model.yarn_beta_slow ({self.yarn_beta_slow}) must be > 0 and below "
                    f"model.yarn_beta_fast ({self.yarn_beta_fast})"
                )

    def check_rope_length(self, seq_len: int, where: str) -> None:
        """Raise ConfigError when this model's RoPE scaling does not fit sequences of `seq_len`
        tokens: the original length must be below it, and original length x factor reach it."""
        original = self.rope_original_len
        if self.rope_scaling == "none" or original == 0:
            return
        if original >= seq_len:
            raise ConfigError(
                f"{where}: model.rope_original_len ({original}) must be below seq_len "
                f"({seq_len}): scaling is for sequences longer than the model was trained at; "
                "use rope_scaling=none at this length"
            )
        if original * self.rope_factor < seq_len:
            raise ConfigError(
                f"{where}: model.rope_factor {self.rope_factor} x rope_original_len {original} "
                f"= {original * self.rope_factor:g} tokens is below seq_len ({seq_len}): set "
                f"rope_factor to at least {seq_len / original:g}"
            )

    def _validate_attention(self) -> None:
        """An implementation keel knows, and cudnn only where JAX runs on a GPU."""
        known = get_args(get_type_hints(ModelConfig)["attention"])
        if self.attention not in known:
            raise ConfigError(
                f"model.attention: unknown implementation {self.attention!r}; known: "
                f"{', '.join(known)}"
            )
        if self.attention == "cudnn" and _jax_backend() != "gpu":
            raise ConfigError(
                f"model.attention=cudnn needs an NVIDIA GPU, but JAX runs on {_jax_backend()}; "
                "use model.attention=blockwise or auto"
            )


def _jax_backend() -> str:
    """The platform JAX runs on ("cpu", "gpu", "tpu"), for settings only some backends implement
    (JAX is imported only when such a setting is asked for)."""
    import jax

    return jax.default_backend()
