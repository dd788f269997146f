"""`keel export --format hf` of models no stock class expresses: KeelForCausalLM, keel's own
modeling file loaded with `trust_remote_code=True`, gives keel's float32 logits (max abs <= 1e-4)
and, on a trained tiny-moe, keel's greedy tokens up to the first near-tie.

Needs the `interop` extra (torch, transformers); skipped cleanly without it. Offline: the
remote code is read from the export directory (conftest sets HF_HUB_OFFLINE)."""

import json
import subprocess
import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_support import random_trained
from mesh_support import tiny_moe
from test_hf_parity import TOKENS, TOLERANCE, keel_logits
from tokenizers import Tokenizer

from keel.core.config import apply_overrides
from keel.model.config import RouterConfig
from keel.model.generate import SamplingConfig, generate
from keel.model.transformer import forward
from keel.train.hf_export import export_hf
from keel.train.presets import preset
from keel.train.trained import load_trained
from keel.train.trainer import train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY_MOE = replace(preset("tiny-moe").model, vocab_size=512, init_std=0.2, n_layers=3)
"""tiny-moe's shape (a dense first layer, a shared expert, 8 experts top 2), 3 layers."""
LATENT_SIGMOID = replace(
    TINY_MOE,
    latent_dim=32,
    rotary_fraction=0.5,
    router=RouterConfig(score="sigmoid"),
    n_dense_layers=0,
    qk_norm=False,
    tied_embeddings=False,
)
"""Latent projection, partial RoPE, sigmoid scores, no QK-norm, untied embeddings."""
DENSE_YARN = replace(
    preset("tiny-dense").model,
    vocab_size=512,
    init_std=0.2,
    n_layers=2,
    rotary_fraction=0.5,
    rope_scaling="yarn",
    rope_factor=4.0,
    rope_original_len=4,
)
"""A dense model with partial RoPE under YaRN scaling (sequences of TOKENS are 3x its original
length)."""
GREEDY_TOKENS = 24
NEAR_TIE = 1e-3
"""Greedy tokens are compared up to the first position where keel's top-2 logit margin is below
this: there float rounding may pick either token."""


def load(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, trust_remote_code=True, dtype=torch.float32
    )


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def with_bias(trained, scale: float):
    """`trained` with a random router bias of this size (score units): it changes which experts
    win."""
    bias = scale * jax.random.normal(jax.random.key(1), trained.router_bias.shape)
    return replace(trained, router_bias=bias)


@pytest.mark.parametrize(
    "model", [TINY_MOE, LATENT_SIGMOID, DENSE_YARN], ids=["tiny-moe", "latent-sigmoid", "yarn"]
)
def test_the_keel_class_gives_keels_logits(tmp_path, wikitext_cache, model):
    trained = random_trained(model, wikitext_cache)
    if model.is_moe:
        trained = with_bias(trained, 0.05)
    assert export_hf(trained, str(tmp_path / "hf")).name == "KeelForCausalLM"
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["architectures"] == ["KeelForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_keel.KeelForCausalLM"
    loaded = load(tmp_path / "hf")
    assert type(loaded).__name__ == "KeelForCausalLM"
    expected = keel_logits(trained, TOKENS)
    assert np.abs(torch_logits(loaded, TOKENS) - expected).max() <= TOLERANCE
    if not model.is_moe:
        return
    # The bias came with the model and steers the routing: without it the logits move.
    moe_layers = [layer.mlp for layer in loaded.model.layers if hasattr(layer.mlp, "router_bias")]
    biases = np.stack([mlp.router_bias.numpy() for mlp in moe_layers])
    np.testing.assert_array_equal(biases, np.asarray(trained.router_bias))
    for mlp in moe_layers:
        mlp.router_bias.zero_()
    assert np.abs(torch_logits(loaded, TOKENS) - expected).max() > 100 * TOLERANCE


@pytest.fixture(scope="module")
def trained_moe(wikitext_cache, tmp_path_factory):
    """tiny-moe (4 layers: a dense first one, a shared expert) trained 20 steps on the test
    cache with tiny-moe's own bias step, so the balancing rule moves the router bias."""
    config = apply_overrides(tiny_moe(wikitext_cache), ["model.router.bias_rate=0.01"])
    output = tmp_path_factory.mktemp("trained-moe") / "run"
    train(
        replace(config, eval_every=1000, checkpoint_every=20),
        str(output),
        devices=jax.devices()[:1],
    )
    return load_trained(str(output))


def test_greedy_generation_matches_keel_on_a_trained_moe(trained_moe, tmp_path):
    assert np.abs(np.asarray(trained_moe.router_bias)).max() > 0.05
    assert_same_greedy_tokens(trained_moe, tmp_path / "hf")


def test_greedy_generation_matches_keel_on_a_random_moe(wikitext_cache, tmp_path):
    """Large random weights: greedy tokens that change every position (a 20-step model repeats
    one or two)."""
    assert_same_greedy_tokens(with_bias(random_trained(TINY_MOE, wikitext_cache), 0.05), tmp_path)


def assert_same_greedy_tokens(trained, directory) -> None:
    """transformers' greedy `generate` on the export of `trained` gives keel's greedy tokens (the
    function `keel sample --temperature 0` calls) up to the first near-tie, at least 16 of
    GREEDY_TOKENS compared per prompt."""
    assert export_hf(trained, str(directory)).name == "KeelForCausalLM"
    prompt = np.asarray([[5, 17, 42, 9, 100, 7], [64, 3, 200, 11, 8, 90]], np.int32)
    sampling = SamplingConfig(max_tokens=GREEDY_TOKENS, temperature=0.0)
    ours = generate(trained.params, trained.model, trained.router_bias, prompt, sampling).tokens
    model = load(directory)
    model.generation_config.eos_token_id = None  # exactly GREEDY_TOKENS, as keel's
    model.generation_config.pad_token_id = trained.eos_id
    ids = torch.from_numpy(prompt.astype(np.int64))
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=GREEDY_TOKENS,
            do_sample=False,
        )
    theirs = out[:, prompt.shape[1] :].numpy()
    # keel's top-2 margin at each position that chose a generated token.
    sequence = jnp.asarray(np.concatenate([prompt, ours], axis=1))
    logits, _ = forward(trained.params, sequence, trained.model, trained.router_bias)
    chosen = np.sort(np.asarray(logits[:, prompt.shape[1] - 1 : -1]), axis=-1)
    margins = chosen[..., -1] - chosen[..., -2]  # [batch, GREEDY_TOKENS]
    for row in range(len(prompt)):
        near_ties = np.flatnonzero(margins[row] < NEAR_TIE)
        compared = near_ties[0] if near_ties.size else GREEDY_TOKENS
        assert compared >= 16, (row, margins[row])
        np.testing.assert_array_equal(theirs[row, :compared], ours[row, :compared])


def test_the_command_says_how_to_load_a_keel_class_export_and_its_tokenizer_loads(
    trained_run, tmp_path
):
    """`keel export --architecture KeelForCausalLM` prints the trust_remote_code reminder and no
    Orbax read-only warnings; with the flag, AutoTokenizer loads the run's tokenizer without
    asking (stdin closed: a prompt would print its question)."""
    output = tmp_path / "hf"
    command = [sys.executable, "-m", "keel", "export", str(trained_run)]
    done = subprocess.run(
        [*command, "--architecture", "KeelForCausalLM", "--output", str(output)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    reminder = f"AutoModelForCausalLM.from_pretrained('{output}', trust_remote_code=True)"
    assert reminder in done.stdout
    assert "absl" not in done.stderr
    text = "The tower is 330 metres tall."
    load = (
        "import sys, transformers\n"
        "t = transformers.AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "print(t(sys.argv[2])['input_ids'])"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", load, str(output), text],
        capture_output=True, text=True, timeout=120, check=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert "Do you wish to run" not in loaded.stdout + loaded.stderr
    run_tokenizer = Tokenizer.from_file(str(output / "tokenizer.json"))
    assert loaded.stdout.strip() == str(run_tokenizer.encode(text).ids)
