"""`init_from: hf:DIR`: a tiny random Qwen3 and Qwen3-MoE built with transformers, imported,
give transformers' logits (float32, max abs <= 1e-4); a run started from the Qwen3 trains and
its loss falls; a checkpoint of a class keel does not import is one `error:` line, exit 2.

Needs the `interop` extra (torch, transformers); skipped cleanly without it."""

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mesh_support import small_dense

from keel.data.token_cache import TokenCache
from keel.model.transformer import forward
from keel.train.hf_import import hf_model_config, hf_params
from keel.train.presets import preset
from keel.train.trainer import train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
TOKENS = np.asarray([[5, 17, 42, 9, 100, 7, 300, 2, 64, 511, 0, 33]], np.int32)
SHAPE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "initializer_range": 0.2, "tie_word_embeddings": False}  # fmt: skip
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "mlp_only_layers": [0], "norm_topk_prob": True}  # fmt: skip


def hf_checkpoint(directory: Path, config, cache: str):
    """A random transformers model saved at `directory` with the test cache's tokenizer."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    shutil.copy(TokenCache(cache).tokenizer_path(), directory / "tokenizer.json")
    return model


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe"])
def test_an_imported_checkpoint_gives_transformers_logits(tmp_path, wikitext_cache, kind):
    config = (transformers.Qwen3Config(**SHAPE) if kind == "qwen3"
              else transformers.Qwen3MoeConfig(**SHAPE, **MOE))  # fmt: skip
    hf_model = hf_checkpoint(tmp_path / "hf", config, wikitext_cache)
    with torch.no_grad():
        want = hf_model(torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()
    model = hf_model_config(tmp_path / "hf", preset("tiny-moe").model)
    assert model.is_moe == (kind == "qwen3-moe")
    params, bias = hf_params(tmp_path / "hf", model)
    got, _ = forward(params, jnp.asarray(TOKENS), model, bias)
    assert np.abs(np.asarray(got) - want).max() <= TOLERANCE


def test_training_continues_from_an_imported_qwen3_and_its_loss_falls(tmp_path, wikitext_cache):
    hf_checkpoint(tmp_path / "hf", transformers.Qwen3Config(**{**SHAPE, "initializer_range": 0.02}),
                  wikitext_cache)  # fmt: skip
    config = small_dense(f"data=[{{cache: {wikitext_cache}}}]", "steps=8",
                         f"init_from=hf:{tmp_path / 'hf'}", "phases.0.schedule.warmup_steps=1",
                         "checkpoint_every=8")  # fmt: skip
    train(replace(config, eval_every=1000), str(tmp_path / "run"), devices=jax.devices()[:1])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    assert losses[-1] < losses[0] - 0.1, losses
    written = (tmp_path / "run" / "config.yaml").read_text()
    assert "d_model: 64" in written and "n_layers: 2" in written  # the checkpoint's shape


def test_a_checkpoint_of_an_unsupported_class_is_one_error_line(tmp_path, wikitext_cache):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    result = subprocess.run(
        [sys.executable, "-m", "keel", "train", "--preset", "tiny-dense", "--set",
         f"data=[{{cache: {wikitext_cache}}}]", "--set", f"init_from=hf:{tmp_path / 'hf'}",
         "--output", str(tmp_path / "run"), "--steps", "1", "--quiet"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "GPT2LMHeadModel" in lines[0] and "Qwen3ForCausalLM" in lines[0]
