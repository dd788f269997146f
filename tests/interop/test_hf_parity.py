"""`keel export --format hf` to stock classes: the directory loads in transformers with no edits
and its logits are keel's (float32, max abs <= 1e-4); keel's own class: test_hf_remote.py.

Needs the `interop` extra (torch, transformers); skipped cleanly without it."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hf_support import random_trained

from keel.model.transformer import forward
from keel.train.hf_export import export_hf
from keel.train.presets import preset
from keel.train.trained import TrainedModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
TOKENS = np.asarray([[5, 17, 42, 9, 100, 7, 300, 2, 64, 511, 0, 33]], np.int32)


def hf_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def keel_logits(trained: TrainedModel, tokens: np.ndarray) -> np.ndarray:
    logits, _ = forward(trained.params, jnp.asarray(tokens), trained.model, trained.router_bias)
    return np.asarray(logits)


@pytest.mark.parametrize(
    ("overrides", "architecture"),
    [
        ({"qk_norm": False}, "LlamaForCausalLM"),
        ({"tied_embeddings": False}, "Qwen3ForCausalLM"),
        ({"n_shared_experts": 0, "n_layers": 3}, "Qwen3MoeForCausalLM"),  # dense first layer
    ],
    ids=["llama", "qwen3-untied", "qwen3-moe"],
)
def test_each_stock_class_gives_keels_logits(tmp_path, wikitext_cache, overrides, architecture):
    base = preset("tiny-moe" if "n_shared_experts" in overrides else "tiny-dense").model
    model = replace(base, vocab_size=512, init_std=0.2, **overrides)
    trained = random_trained(model, wikitext_cache)
    assert export_hf(trained, str(tmp_path / "hf")).name == architecture
    got = hf_logits(tmp_path / "hf", TOKENS)
    assert np.abs(got - keel_logits(trained, TOKENS)).max() <= TOLERANCE


def test_an_exported_run_loads_with_its_tokenizer_and_gives_keels_logits(trained_run, tmp_path):
    from keel.train.trained import load_trained

    output = tmp_path / "hf"
    result = subprocess.run(
        [sys.executable, "-m", "keel", "export", str(trained_run), "--format", "hf",
         "--output", str(output)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Qwen3ForCausalLM" in result.stdout
    tokenizer = transformers.AutoTokenizer.from_pretrained(output)
    trained = load_trained(str(trained_run))
    from tokenizers import Tokenizer

    text = "The history of the city"
    ids = tokenizer(text)["input_ids"]
    assert ids == Tokenizer.from_file(trained.tokenizer_path).encode(text).ids
    assert tokenizer.eos_token_id == trained.eos_id
    assert json.loads((output / "config.json").read_text())["model_type"] == "qwen3"
    tokens = np.asarray([ids], np.int32)
    assert np.abs(hf_logits(output, tokens) - keel_logits(trained, tokens)).max() <= TOLERANCE
