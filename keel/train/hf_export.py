"""`keel export --format hf`: a trained model as a Hugging Face checkpoint directory that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`
load: model.safetensors (float32), config.json, tokenizer.json and tokenizer_config.json.

The stock class is chosen where its mathematics is keel's exactly (ARCHITECTURES, first that fits):
    Qwen3ForCausalLM     dense, QK-norm
    LlamaForCausalLM     dense, no QK-norm
    Qwen3MoeForCausalLM  MoE with softmax scores, no shared experts, no latent projection, a zero
                         router bias, QK-norm; keel's dense-first layers are its `mlp_only_layers`
Every one needs full, unscaled RoPE (NeoX half-split, as keel's) and SwiGLU. Any other model
(shared experts, latent projection, partial or scaled RoPE, sigmoid scores, a non-zero router
bias) exports as KeelForCausalLM: keel's own modeling file (keel/train/hf_remote/, copied into
the directory; config.json's auto_map names it), loaded with `trust_remote_code=True`. The
router bias travels with the weights (model.layers.<i>.mlp.router_bias). A stock class asked
for by name that cannot express the model is refused with the features named.

Weights: keel keeps matrices [in, out] and torch's Linear [out, in], so every matrix is
transposed; per-layer stacks are split into model.layers.<i>.*; experts are written one by one
(model.layers.<i>.mlp.experts.<e>.{gate,up,down}_proj.weight), the layout of Qwen3-MoE
checkpoints that transformers 4 and 5 both read (and KeelForCausalLM's).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from keel.core.commit import staged_output
from keel.core.errors import UsageError
from keel.model.config import ModelConfig
from keel.train.tensor_file import write_safetensors
from keel.train.trained import TrainedModel, as_numpy

WEIGHTS_FILE = "model.safetensors"
REMOTE_CODE = Path(__file__).with_name("hf_remote")
"""KeelForCausalLM's configuration_keel.py and modeling_keel.py (package data, never imported
by keel), copied into exports of that class."""
HF_CONFIG_FILE = "config.json"
"""The model's config.json, also the export's commit marker (keel.core.commit)."""


@dataclass(frozen=True)
class HfArchitecture:
    """A transformers class keel exports to: its name, model_type, what of keel's it cannot
    express (an empty list: it fits), its config.json keys beyond the common ones, and whether
    it is keel's own remote code."""

    name: str
    model_type: str
    misfits: Callable[[ModelConfig, np.ndarray | None], list[str]]
    extra_config: Callable[[ModelConfig], dict[str, Any]]
    remote_code: bool = False


def _common_misfits(config: ModelConfig) -> list[str]:
    found = ["partial RoPE (rotary_fraction < 1)"] if config.rotary_fraction < 1 else []
    if config.rope_scaling != "none":
        found.append(f"RoPE scaling (rope_scaling={config.rope_scaling})")
    return found


def _dense_misfits(qk_norm: bool) -> Callable[[ModelConfig, np.ndarray | None], list[str]]:
    def misfits(config: ModelConfig, bias: np.ndarray | None) -> list[str]:
        found = _common_misfits(config)
        if config.is_moe:
            found.append("routed experts (a dense class)")
        if config.qk_norm != qk_norm:
            found.append("QK-norm" if config.qk_norm else "no QK-norm")
        return found

    return misfits


def _moe_misfits(config: ModelConfig, bias: np.ndarray | None) -> list[str]:
    found = _common_misfits(config)
    if not config.is_moe:
        return [*found, "no routed experts (an MoE class)"]
    if not config.qk_norm:
        found.append("no QK-norm")
    if config.n_shared_experts:
        found.append(f"shared experts (n_shared_experts={config.n_shared_experts})")
    if config.latent_dim:
        found.append(f"latent projection (latent_dim={config.latent_dim})")
    if config.router.score != "softmax":
        found.append(f"{config.router.score} router scores")
    if bias is not None and np.any(bias != 0):
        found.append("a non-zero router bias")
    return found


def _rope_config(config: ModelConfig) -> dict[str, Any]:
    return {
        "rope_theta": config.rope_theta,  # transformers 4
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},  # 5
    }


def _moe_config(config: ModelConfig) -> dict[str, Any]:
    return {
        **_rope_config(config),
        "num_experts": config.n_routed_experts,
        "num_experts_per_tok": config.top_k,
        "moe_intermediate_size": config.expert_ffn_dim,
        "norm_topk_prob": config.router.normalize_gates,
        "mlp_only_layers": list(range(config.n_dense_layers)),
        "decoder_sparse_step": 1,
        "output_router_logits": False,
    }


def _keel_config(config: ModelConfig) -> dict[str, Any]:
    """configuration_keel.KeelConfig's keys beyond the common ones, and the auto_map that
    points transformers at the remote code."""
    return {
        "auto_map": {
            "AutoConfig": "configuration_keel.KeelConfig",
            "AutoModelForCausalLM": "modeling_keel.KeelForCausalLM",
        },
        "qk_norm": config.qk_norm,
        "rotary_dim": config.rotary_dim,
        "rotary_base": config.rope_theta,
        "rotary_scaling": config.rope_scaling,
        "rotary_factor": config.rope_factor,
        "rotary_original_length": config.rope_original_len,
        "yarn_beta_fast": config.yarn_beta_fast,
        "yarn_beta_slow": config.yarn_beta_slow,
        "num_experts": config.n_routed_experts,
        "num_experts_per_tok": config.top_k,
        "moe_intermediate_size": config.expert_ffn_dim,
        "shared_expert_intermediate_size": config.n_shared_experts * config.expert_ffn_dim,
        "latent_dim": config.latent_dim,
        "first_dense_layers": config.n_dense_layers if config.is_moe else 0,
        "router_score": config.router.score,
        "norm_topk_prob": config.router.normalize_gates,
    }


KEEL_ARCHITECTURE = HfArchitecture(
    "KeelForCausalLM", "keel", lambda config, bias: [], _keel_config, remote_code=True
)
"""keel's own class (keel/train/hf_remote/): expresses every keel model."""

ARCHITECTURES: tuple[HfArchitecture, ...] = (
    HfArchitecture("Qwen3ForCausalLM", "qwen3", _dense_misfits(True), _rope_config),
    HfArchitecture("LlamaForCausalLM", "llama", _dense_misfits(False), _rope_config),
    HfArchitecture("Qwen3MoeForCausalLM", "qwen3_moe", _moe_misfits, _moe_config),
    KEEL_ARCHITECTURE,
)
"""In order of preference: the stock classes, then keel's (which always fits)."""


def choose_architecture(
    config: ModelConfig, bias: np.ndarray | None, requested: str | None = None
) -> HfArchitecture:
    """The class named `requested`, or (None) the first of ARCHITECTURES that expresses the
    model exactly: a stock class where one fits, else KeelForCausalLM. UsageError for an
    unknown name, or a requested class that cannot express the model (naming the features)."""
    if requested is None:
        return next(a for a in ARCHITECTURES if not a.misfits(config, bias))
    by_name = {architecture.name: architecture for architecture in ARCHITECTURES}
    if requested not in by_name:
        raise UsageError(f"--architecture {requested!r}: known classes are {', '.join(by_name)}")
    architecture = by_name[requested]
    features = ", ".join(architecture.misfits(config, bias))
    if features:
        fits = choose_architecture(config, bias)
        how = " (load it with trust_remote_code=True)" if fits.remote_code else ""
        raise UsageError(
            f"{requested} cannot express this model ({features}); without --architecture it "
            f"exports as {fits.name}{how}"
        )
    return architecture


def hf_config(trained: TrainedModel, architecture: HfArchitecture) -> dict[str, Any]:
    """config.json's contents."""
    model = trained.model
    max_len = max(phase.seq_len for phase in trained.config.phases)
    return {
        "architectures": [architecture.name],
        "model_type": architecture.model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_len,
        "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tied_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "eos_token_id": trained.eos_id,
        "bos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "initializer_range": model.init_std,
        "use_cache": True,
        **architecture.extra_config(model),
    }


def hf_weights(
    trained: TrainedModel, architecture: HfArchitecture | None = None
) -> dict[str, np.ndarray]:
    """Hugging Face parameter name -> float32 array ([out, in] for every matrix); for keel's
    own class also each MoE layer's router bias, shared experts and latent projection."""
    params = as_numpy(trained.params)
    model = trained.model
    weights = {"model.embed_tokens.weight": params.embed, "model.norm.weight": params.final_norm}
    if params.unembed is not None:
        weights["lm_head.weight"] = params.unembed.T
    stacks = [(params.dense, 0)] if params.dense is not None else []
    if params.moe is not None:
        stacks.append((params.moe, model.n_dense_blocks))
    remote_code = architecture is not None and architecture.remote_code
    for stack, first in stacks:
        for index in range(stack.attn_norm.shape[0]):
            prefix = f"model.layers.{first + index}."
            weights.update(_layer(stack, index, prefix, model))
            if remote_code and hasattr(stack, "moe"):
                bias = np.asarray(trained.router_bias)[index]
                weights.update(_keel_moe_extras(stack.moe, index, bias, prefix + "mlp."))
    return {name: np.ascontiguousarray(w, np.float32) for name, w in weights.items()}


def _layer(stack: Any, i: int, prefix: str, model: ModelConfig) -> dict[str, np.ndarray]:
    attn = stack.attn
    layer = {
        prefix + "input_layernorm.weight": stack.attn_norm[i],
        prefix + "post_attention_layernorm.weight": stack.mlp_norm[i],
        prefix + "self_attn.q_proj.weight": attn.wq[i].T,
        prefix + "self_attn.k_proj.weight": attn.wk[i].T,
        prefix + "self_attn.v_proj.weight": attn.wv[i].T,
        prefix + "self_attn.o_proj.weight": attn.wo[i].T,
    }
    if model.qk_norm:
        layer[prefix + "self_attn.q_norm.weight"] = attn.q_norm[i]
        layer[prefix + "self_attn.k_norm.weight"] = attn.k_norm[i]
    mlp = prefix + "mlp."
    if hasattr(stack, "mlp"):
        layer[mlp + "gate_proj.weight"] = stack.mlp.w_gate[i].T
        layer[mlp + "up_proj.weight"] = stack.mlp.w_up[i].T
        layer[mlp + "down_proj.weight"] = stack.mlp.w_down[i].T
        return layer
    moe = stack.moe
    layer[mlp + "gate.weight"] = moe.router[i].T
    for e in range(model.n_routed_experts):
        expert = f"{mlp}experts.{e}."
        layer[expert + "gate_proj.weight"] = moe.experts.w_gate[i, e].T
        layer[expert + "up_proj.weight"] = moe.experts.w_up[i, e].T
        layer[expert + "down_proj.weight"] = moe.experts.w_down[i, e].T
    return layer


def _keel_moe_extras(moe: Any, i: int, bias: np.ndarray, mlp: str) -> dict[str, np.ndarray]:
    """What KeelForCausalLM's MoE layer holds beyond Qwen3-MoE's: the router bias [experts],
    the shared experts (one SwiGLU) and the latent projection, when the model has them."""
    extras = {mlp + "router_bias": bias}
    if moe.shared is not None:
        extras[mlp + "shared_expert.gate_proj.weight"] = moe.shared.w_gate[i].T
        extras[mlp + "shared_expert.up_proj.weight"] = moe.shared.w_up[i].T
        extras[mlp + "shared_expert.down_proj.weight"] = moe.shared.w_down[i].T
    if moe.latent_down is not None:
        extras[mlp + "latent_down.weight"] = moe.latent_down[i].T
        extras[mlp + "latent_up.weight"] = moe.latent_up[i].T
    return extras


def _tokenizer_config(trained: TrainedModel) -> dict[str, Any]:
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(trained.tokenizer_path).id_to_token(trained.eos_id)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "model_max_length": max(phase.seq_len for phase in trained.config.phases),
        "clean_up_tokenization_spaces": False,
    }


def export_hf(
    trained: TrainedModel, output: str, architecture_name: str | None = None
) -> HfArchitecture:
    """Write the Hugging Face directory `output` (missing or empty; written in a staging
    directory beside it and published whole by keel.core.commit) as the class named
    `architecture_name` (None: choose_architecture's pick); the class it exports to."""
    bias = None if trained.router_bias is None else np.asarray(trained.router_bias)
    architecture = choose_architecture(trained.model, bias, architecture_name)
    final = Path(output).expanduser().resolve()
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise UsageError(f"--output {output} exists and is not empty; choose a new directory")
    with staged_output(
        final, marker=HF_CONFIG_FILE, kind="Hugging Face export", inputs=[trained.run]
    ) as staging_dir:
        staging = Path(staging_dir)
        weights = hf_weights(trained, architecture)
        write_safetensors(staging / WEIGHTS_FILE, weights, {"format": "pt"})
        files = {
            HF_CONFIG_FILE: hf_config(trained, architecture),
            "tokenizer_config.json": _tokenizer_config(trained),
            "generation_config.json": {"eos_token_id": trained.eos_id},
        }
        for name, content in files.items():
            (staging / name).write_text(json.dumps(content, indent=2) + "\n")
        shutil.copyfile(trained.tokenizer_path, staging / "tokenizer.json")
        if architecture.remote_code:
            for source in sorted(REMOTE_CODE.glob("*.py")):
                shutil.copyfile(source, staging / source.name)
    return architecture
