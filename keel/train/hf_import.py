"""`init_from: hf:DIR`: a local Hugging Face checkpoint (Qwen3, Llama, Qwen3-MoE) as a keel
model: its config.json as a ModelConfig, its safetensors as keel's parameters, its tokenizer.json
as the tokenizer the run's data must be encoded with.

The inverse of hf_export.py: every matrix is transposed from transformers' [out, in] to keel's
[in, out], layers are stacked (dense-first, then MoE), and a Qwen3-MoE's experts per layer are
stacked along axis 0. What keel cannot express (another class, attention biases, RoPE scaling,
sliding windows, MoE layers that are not all after the dense ones) is one UsageError naming it.
Reads safetensors with keel's own reader (tensor_file.py): no torch, no transformers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keel.core.errors import UsageError
from keel.data.token_cache import TokenCache
from keel.model.attention import AttentionParams
from keel.model.config import ModelConfig, RouterConfig
from keel.model.layers import MlpParams
from keel.model.moe import ExpertParams, MoeParams
from keel.model.transformer import DenseBlockParams, ModelParams, MoeBlockParams
from keel.train.checkpoint import TrainState
from keel.train.config import TrainConfig
from keel.train.tensor_file import read_safetensors

logger = logging.getLogger(__name__)

PREFIX = "hf:"
SUPPORTED = {"Qwen3ForCausalLM": True, "LlamaForCausalLM": False, "Qwen3MoeForCausalLM": True}
"""Architectures keel imports, with whether they use QK-norm."""
TOKENIZER_FILE = "tokenizer.json"


def hf_directory(init_from: str) -> Path | None:
    """The directory of an `init_from: hf:DIR`, None for another init_from."""
    if not init_from.startswith(PREFIX):
        return None
    directory = Path(init_from[len(PREFIX) :]).expanduser()
    if not (directory / "config.json").is_file():
        raise UsageError(f"init_from: {init_from}: no config.json there (a local HF checkpoint)")
    return directory


def hf_model_config(directory: Path, base: ModelConfig) -> ModelConfig:
    """`base` with the shape of the checkpoint at `directory` (its config.json)."""
    config = json.loads((directory / "config.json").read_text())
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in SUPPORTED:
        raise UsageError(
            f"init_from: hf:{directory} is a {architecture}; keel imports {', '.join(SUPPORTED)}"
        )
    _refuse_misfits(config, directory, architecture)
    rope = config.get("rope_parameters") or {}
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    model = replace(
        base,
        vocab_size=config["vocab_size"],
        d_model=hidden,
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        ffn_dim=config["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
        rope_scaling="none",
        rope_factor=1.0,
        rotary_fraction=1.0,
        qk_norm=SUPPORTED[architecture],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        n_routed_experts=0,
        n_shared_experts=0,
        latent_dim=0,
        n_dense_layers=0,
    )
    if architecture == "Qwen3MoeForCausalLM":
        dense_first = list(config.get("mlp_only_layers") or [])
        model = replace(
            model,
            n_routed_experts=config.get("num_experts") or config["num_local_experts"],
            top_k=config["num_experts_per_tok"],
            expert_ffn_dim=config["moe_intermediate_size"],
            n_dense_layers=len(dense_first),
            router=replace(
                base.router or RouterConfig(),
                score="softmax",
                normalize_gates=bool(config.get("norm_topk_prob", False)),
            ),
        )
    return model.validate()


def _refuse_misfits(config: dict[str, Any], directory: Path, architecture: str) -> None:
    found = []
    if config.get("attention_bias"):
        found.append("attention biases")
    if config.get("mlp_bias"):
        found.append("MLP biases")
    if config.get("hidden_act", "silu") != "silu":
        found.append(f"activation {config['hidden_act']}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        found.append(f"RoPE scaling {rope['rope_type']}")
    if config.get("use_sliding_window"):
        found.append("sliding-window attention")
    if architecture == "Qwen3MoeForCausalLM":
        dense_first = sorted(config.get("mlp_only_layers") or [])
        if (
            dense_first != list(range(len(dense_first)))
            or config.get("decoder_sparse_step", 1) != 1
        ):
            found.append("MoE layers other than all layers after the first dense ones")
    if found:
        raise UsageError(
            f"init_from: hf:{directory} ({architecture}) has what keel cannot express: "
            f"{', '.join(found)}"
        )


def read_weights(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (one model.safetensors or the shards its index names)."""
    single = directory / "model.safetensors"
    if single.is_file():
        return read_safetensors(single)
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        raise UsageError(f"init_from: hf:{directory} holds no model.safetensors (nor an index)")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    weights: dict[str, np.ndarray] = {}
    for shard in shards:
        weights.update(read_safetensors(directory / shard))
    return weights


def hf_params(directory: Path, model: ModelConfig) -> tuple[ModelParams, jnp.ndarray | None]:
    """The checkpoint's parameters as keel's (float32) and a zero router bias (None: dense)."""
    weights = read_weights(directory)

    def take(name: str) -> np.ndarray:
        if name not in weights:
            raise UsageError(f"init_from: hf:{directory} has no tensor {name}")
        return weights[name]

    def attention(i: int) -> AttentionParams:
        p = f"model.layers.{i}.self_attn."
        ones = np.ones((model.head_dim,), np.float32)
        return AttentionParams(
            wq=take(p + "q_proj.weight").T,
            wk=take(p + "k_proj.weight").T,
            wv=take(p + "v_proj.weight").T,
            wo=take(p + "o_proj.weight").T,
            q_norm=take(p + "q_norm.weight") if model.qk_norm else ones,
            k_norm=take(p + "k_norm.weight") if model.qk_norm else ones,
        )

    def norms(i: int) -> tuple[np.ndarray, np.ndarray]:
        p = f"model.layers.{i}."
        return take(p + "input_layernorm.weight"), take(p + "post_attention_layernorm.weight")

    def dense(i: int) -> DenseBlockParams:
        m = f"model.layers.{i}.mlp."
        mlp = MlpParams(
            take(m + "gate_proj.weight").T, take(m + "up_proj.weight").T,
            take(m + "down_proj.weight").T,
        )  # fmt: skip
        return DenseBlockParams(norms(i)[0], attention(i), norms(i)[1], mlp)

    def moe(i: int) -> MoeBlockParams:
        m = f"model.layers.{i}.mlp."
        experts = range(model.n_routed_experts)
        stacked = ExpertParams(
            *(
                np.stack([take(f"{m}experts.{e}.{name}.weight").T for e in experts])
                for name in ("gate_proj", "up_proj", "down_proj")
            )
        )
        block = MoeParams(take(m + "gate.weight").T, stacked, None, None, None)
        return MoeBlockParams(norms(i)[0], attention(i), norms(i)[1], block)

    def stack(blocks: list[Any]) -> Any:
        if not blocks:
            return None
        return jax.tree.map(lambda *leaves: jnp.asarray(np.stack(leaves)), *blocks)

    n_dense = model.n_dense_blocks
    params = ModelParams(
        embed=jnp.asarray(take("model.embed_tokens.weight")),
        dense=stack([dense(i) for i in range(n_dense)]),
        moe=stack([moe(i) for i in range(n_dense, model.n_layers)]),
        final_norm=jnp.asarray(take("model.norm.weight")),
        unembed=None if model.tied_embeddings else jnp.asarray(take("lm_head.weight").T),
    )
    bias = None
    if model.is_moe:
        bias = jnp.zeros((model.n_moe_layers, model.n_routed_experts), jnp.float32)
    return params, bias


def hf_tokenizer(directory: Path) -> Path:
    """The checkpoint's tokenizer.json; UsageError when it has none."""
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise UsageError(
            f"init_from: hf:{directory} has no {TOKENIZER_FILE}: the run's data must be encoded "
            "with the checkpoint's own tokenizer"
        )
    return path


def with_hf_model(config: TrainConfig) -> TrainConfig:
    """For `init_from: hf:DIR`: the config with the checkpoint's model shape, after checking
    every token cache of the run was encoded with the checkpoint's tokenizer.json. Any other
    config as it is."""
    directory = hf_directory(config.init_from)
    if directory is None:
        return config
    model = hf_model_config(directory, config.model)
    want = hashlib.sha256(hf_tokenizer(directory).read_bytes()).hexdigest()
    sources = config.data or tuple(s for phase in config.phases for s in phase.mixture)
    for source in sources:
        manifest = TokenCache(source.cache).manifest
        if manifest.tokenizer_sha256 != want:
            raise UsageError(
                f"init_from: hf:{directory}: the token cache {source.cache} was encoded with "
                f"another tokenizer; encode the text with {directory / TOKENIZER_FILE} "
                "(keel train --data TEXT --tokenizer that file)"
            )
    if model != config.model:
        logger.info("init_from hf:%s: the model takes the checkpoint's shape", directory)
    return replace(config, model=model)


def hf_start_state(directory: Path, model: ModelConfig, fresh: TrainState) -> TrainState:
    """Fresh optimizer state and step with the checkpoint's parameters, placed as `fresh`'s."""
    params, bias = hf_params(directory, model)

    def placed(new: jax.Array, like: jax.Array) -> jax.Array:
        if new.shape != like.shape:
            raise UsageError(f"init_from: hf:{directory}: a tensor of shape {new.shape} where "
                             f"the model has {like.shape}")  # fmt: skip
        return jax.device_put(new.astype(like.dtype), like.sharding)

    params = jax.tree.map(placed, params, fresh.params)
    if bias is not None:
        bias = placed(bias, fresh.router_bias)
    return TrainState(params, fresh.opt_state, bias, fresh.step, fresh.rng, fresh.balance_state)
