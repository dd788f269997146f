"""keel's transformer in torch, as transformers remote code (`trust_remote_code=True`): what
`keel export --format hf` ships for models no stock class expresses. keel itself never imports
this file; the mathematics is keel/model's (transformer.py, attention.py, rope.py, moe.py,
router.py), in the order keel computes it, so float32 logits match keel's to rounding.

    tokens [batch, seq] -> embed -> blocks -> RMSNorm -> logits [batch, seq, vocab]

A block is pre-norm: h += attention(norm(h)); h += mlp_or_moe(norm(h)). Attention: GQA (query
head i reads key/value head i // (heads / kv_heads)), optional QK-norm over head_dim before RoPE,
RoPE on the first rotary_dim dimensions of each head (NeoX half split; linear or YaRN scaling,
YaRN's temperature multiplied into cos and sin), softmax(q k^T / sqrt(head_dim)). MoE blocks
(after the first `first_dense_layers`): router scores (softmax or sigmoid) of float32 logits;
the top-k experts chosen on scores + router_bias (a buffer, read from the checkpoint), weighted
by the unbiased scores (divided by their sum when norm_topk_prob); routed experts run on
x @ latent_down when latent_dim > 0 and their sum goes back through latent_up; the shared
experts (one SwiGLU) run on x. Every token reaches its k experts: nothing is dropped, as in
keel's single-device path (sample, eval). Weights are [out, in] (torch Linear).
"""

import math
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_keel import KeelConfig


class KeelRMSNorm(nn.Module):
    """x / rms(x) * weight over the last axis, computed in float32, returned in x's dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def inverse_frequencies(config: KeelConfig, device: torch.device) -> torch.Tensor:
    """Radians per position of each rotated pair [rotary_dim // 2] float32, after scaling."""
    half = config.rotary_dim // 2
    exponents = -torch.arange(half, dtype=torch.float32, device=device) / max(half, 1)
    base = torch.tensor(config.rotary_base, dtype=torch.float32, device=device) ** exponents
    if config.rotary_scaling == "none":
        return base
    if config.rotary_scaling == "linear":
        return base / config.rotary_factor
    if config.rotary_scaling != "yarn":
        raise ValueError(f"rotary_scaling must be none, linear or yarn: {config.rotary_scaling!r}")
    ramp = torch.tensor(yarn_ramp(config), dtype=torch.float32, device=device)
    return base / config.rotary_factor * ramp + base * (1.0 - ramp)


def yarn_ramp(config: KeelConfig) -> list[float]:
    """YaRN's ramp per rotated pair: 0 for pairs turning more than beta_fast times over the
    original length (kept), 1 for fewer than beta_slow turns (interpolated), linear between."""

    def correction_dim(turns: float) -> float:
        length = config.rotary_original_length
        return (
            config.rotary_dim
            * math.log(length / (turns * 2 * math.pi))
            / (2 * math.log(config.rotary_base))
        )

    low = max(math.floor(correction_dim(config.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(config.yarn_beta_slow)), config.rotary_dim - 1)
    if low == high:
        high += 0.001
    return [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(config.rotary_dim // 2)]


def rotary_tables(config: KeelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [batch, seq] -> cos, sin [batch, 1, seq, rotary_dim // 2] float32 (YaRN's
    temperature 0.1 ln(factor) + 1 multiplied into both)."""
    inverse = inverse_frequencies(config, positions.device)
    angles = positions.float()[..., None] * inverse
    scale = 1.0
    if config.rotary_scaling == "yarn" and config.rotary_factor > 1.0:
        scale = 0.1 * math.log(config.rotary_factor) + 1.0
    return (torch.cos(angles) * scale)[:, None], (torch.sin(angles) * scale)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of x [batch, heads, seq, head_dim]; the rest pass."""
    half = cos.shape[-1]
    if half == 0:
        return x
    x32 = x.float()
    first, second, rest = x32[..., :half], x32[..., half : 2 * half], x32[..., 2 * half :]
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)
    return rotated.to(x.dtype)


class KeelAttention(nn.Module):
    def __init__(self, config: KeelConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, config.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, config.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, config.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, d, bias=False)
        if config.qk_norm:
            self.q_norm = KeelRMSNorm(hd, config.rms_norm_eps)
            self.k_norm = KeelRMSNorm(hd, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        visible: torch.Tensor,
        cache: Cache | None,
    ) -> torch.Tensor:
        """x [batch, seq, hidden]; visible [batch, 1, seq, keys] bool (keys: the cached
        positions and these) -> [batch, seq, hidden]."""
        batch, seq, _ = x.shape
        config, hd = self.config, self.config.head_dim
        q = self.q_proj(x).view(batch, seq, config.num_attention_heads, hd)
        k = self.k_proj(x).view(batch, seq, config.num_key_value_heads, hd)
        v = self.v_proj(x).view(batch, seq, config.num_key_value_heads, hd)
        if config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        group = config.num_attention_heads // config.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
        out = (torch.softmax(scores, dim=-1) @ v.float()).to(x.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class KeelMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), [..., size] -> [..., size]."""

    def __init__(self, size: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(size, hidden, bias=False)
        self.up_proj = nn.Linear(size, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class KeelMoE(nn.Module):
    """Routed SwiGLU experts (at latent_dim when > 0) plus optional shared experts."""

    def __init__(self, config: KeelConfig):
        super().__init__()
        self.config = config
        d, n = config.hidden_size, config.num_experts
        width = config.latent_dim or d
        self.gate = nn.Linear(d, n, bias=False)
        self.register_buffer("router_bias", torch.zeros(n))
        self.experts = nn.ModuleList(KeelMLP(width, config.moe_intermediate_size) for _ in range(n))
        if config.shared_expert_intermediate_size:
            self.shared_expert = KeelMLP(d, config.shared_expert_intermediate_size)
        if config.latent_dim:
            self.latent_down = nn.Linear(d, config.latent_dim, bias=False)
            self.latent_up = nn.Linear(config.latent_dim, d, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (experts [tokens, k] int64 chosen on biased scores, gates
        [tokens, k] float32 from the unbiased ones)."""
        config = self.config
        logits = x.float() @ self.gate.weight.float().T
        if config.router_score == "softmax":
            scores = torch.softmax(logits, dim=-1)
        elif config.router_score == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            raise ValueError(f"router_score must be softmax or sigmoid: {config.router_score!r}")
        biased = scores + self.router_bias.float()
        experts = torch.topk(biased, config.num_experts_per_tok, dim=-1).indices
        gates = scores.gather(-1, experts)
        if config.norm_topk_prob:
            gates = gates / gates.sum(-1, keepdim=True)
        return experts, gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        experts, gates = self.route(flat)
        h = self.latent_down(flat) if self.config.latent_dim else flat
        routed = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for expert in experts.unique().tolist():
            rows, slots = torch.nonzero(experts == expert, as_tuple=True)
            out = self.experts[expert](h[rows]).float() * gates[rows, slots, None]
            routed.index_add_(0, rows, out)
        y = routed.to(x.dtype)
        if self.config.latent_dim:
            y = self.latent_up(y)
        if self.config.shared_expert_intermediate_size:
            y = y + self.shared_expert(flat)
        return y.reshape(shape)


class KeelDecoderLayer(nn.Module):
    def __init__(self, config: KeelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = KeelRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = KeelAttention(config, layer_idx)
        self.post_attention_layernorm = KeelRMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.num_experts and layer_idx >= config.first_dense_layers:
            self.mlp = KeelMoE(config)
        else:
            self.mlp = KeelMLP(config.hidden_size, config.intermediate_size)

    def forward(self, h, rotary, visible, cache):
        h = h + self.self_attn(self.input_layernorm(h), rotary, visible, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class KeelPreTrainedModel(PreTrainedModel):
    config_class = KeelConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["KeelDecoderLayer"]


class KeelModel(KeelPreTrainedModel):
    def __init__(self, config: KeelConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            KeelDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = KeelRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """attention_mask: [batch, cached + seq] of 1 (a token) and 0 (padding), or None;
        position_ids [batch, seq] (default: the cached length onward). The key/value cache
        comes as `cache` (transformers >= 5.24) or `past_key_values` (earlier)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, seq, _ = h.shape
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=h.device)[None].expand(batch, -1)
        rotary = rotary_tables(self.config, position_ids)
        visible = causal_visibility(attention_mask, batch, seq, past, h.device)
        for layer in self.layers:
            h = layer(h, rotary, visible, cache)
        return _output(
            BaseModelOutputWithPast,
            last_hidden_state=self.norm(h),
            cache=cache if use_cache else None,
        )


def causal_visibility(
    attention_mask: torch.Tensor | None, batch: int, seq: int, past: int, device: torch.device
) -> torch.Tensor:
    """[batch, 1, seq, past + seq] bool: query i (cache slot past + i) sees key slots <= its own
    that the 2D attention_mask does not mark as padding."""
    keys = past + seq
    slots = torch.arange(keys, device=device)
    visible = slots[None, :] <= (past + torch.arange(seq, device=device))[:, None]
    visible = visible[None, None].expand(batch, 1, seq, keys)
    if attention_mask is None:
        return visible
    if attention_mask.dim() != 2:
        raise ValueError("KeelModel takes a 2D attention_mask [batch, keys] of 1s and 0s")
    return visible & attention_mask[:, None, None, -keys:].bool()


def _output(kind: type, cache: Cache | None, **fields):
    """A transformers output with the cache under the name this version uses (`cache` from
    5.24, `past_key_values` before)."""
    name = "cache" if "cache" in kind.__dataclass_fields__ else "past_key_values"
    return kind(**fields, **{name: cache})


class KeelForCausalLM(KeelPreTrainedModel, GenerationMixin):
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KeelConfig):
        super().__init__(config)
        self.model = KeelModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """logits [batch, seq, vocab] (the last `logits_to_keep` positions when > 0); with
        labels [batch, seq], the mean next-token cross-entropy over labels != -100."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        h = out.last_hidden_state
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        cache = out["cache"] if "cache" in out else out.get("past_key_values")
        return _output(CausalLMOutputWithPast, loss=loss, logits=logits, cache=cache)
