"""`keel sample`: generation over the key/value cache equals generation that recomputes the whole
prefix every token, is the same text for the same seed, and says a wrong run in one line."""

import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keel.model.config import ModelConfig
from keel.model.decode import forward_cached, init_cache
from keel.model.generate import SamplingConfig, generate, sample_token
from keel.model.transformer import forward, init_params, init_router_bias
from keel.train.presets import preset

SMALL_DENSE = replace(preset("tiny-dense").model, vocab_size=256, n_layers=2, init_std=0.3)
SMALL_MOE = replace(preset("tiny-moe").model, vocab_size=256, n_layers=3, init_std=0.3)
"""The presets' shapes (tiny-moe: a dense first layer and a shared expert), fewer ids and layers,
weights large enough that the logits are far from uniform."""
PARTIAL = replace(SMALL_DENSE, qk_norm=False, rotary_fraction=0.5, tied_embeddings=False)


def uncached_generation(params, config, bias, prompt, sampling: SamplingConfig) -> np.ndarray:
    """The reference: the whole sequence through `forward` for every new token (one compiled
    forward over a fixed-length buffer; causal attention keeps the unfilled tail out of every
    filled position), the token at position p drawn with fold_in(key(seed), p) as generate()
    draws it."""
    key = jax.random.key(sampling.seed)
    batch, length = prompt.shape
    tokens = jnp.zeros((batch, length + sampling.max_tokens), jnp.int32)
    tokens = tokens.at[:, :length].set(prompt)
    full_forward = jax.jit(lambda params, tokens, bias: forward(params, tokens, config, bias)[0])
    for position in range(length, length + sampling.max_tokens):
        logits = full_forward(params, tokens, bias)
        position_key = jax.random.fold_in(key, position)
        draw = sample_token(logits[:, position - 1], position_key, *sampling_args(sampling))
        tokens = tokens.at[:, position].set(draw)
    return np.asarray(tokens[:, length:])


def sampling_args(sampling: SamplingConfig) -> tuple[float, float]:
    return sampling.temperature, sampling.top_p


def random_model(config: ModelConfig):
    params = init_params(jax.random.key(0), config)
    bias = init_router_bias(config)
    if bias is not None:  # a router bias that changes which experts win
        bias = 0.1 * jax.random.normal(jax.random.key(1), bias.shape)
    return params, bias


@pytest.mark.parametrize(
    ("config", "sampling"),
    [(SMALL_DENSE, (0.0, 1.0)), (SMALL_MOE, (0.8, 0.9)), (PARTIAL, (1.0, 1.0))],
    ids=["dense-greedy", "moe-top-p", "partial-rope-untied-sampled"],
)
def test_cached_generation_equals_recomputing_the_prefix(config, sampling):
    params, bias = random_model(config)
    prompt = np.asarray([[5, 17, 42, 9, 100], [1, 2, 3, 4, 5]], np.int32)
    settings = SamplingConfig(max_tokens=12, temperature=sampling[0], top_p=sampling[1], seed=3)
    cached = generate(params, config, bias, prompt, settings).tokens
    assert cached.shape == (2, 12)
    expected = uncached_generation(params, config, bias, prompt, settings)
    np.testing.assert_array_equal(cached, expected)


def test_cached_logits_equal_the_full_forward_pass():
    """Prefill 6 tokens, then 4 one at a time: every position's logits are forward's."""
    config = SMALL_MOE
    params, bias = random_model(config)
    tokens = jax.random.randint(jax.random.key(2), (2, 10), 0, config.vocab_size)
    expected, _ = forward(params, tokens, config, bias)
    cached = jax.jit(forward_cached, static_argnums=2)
    cache = init_cache(config, 2, 16)
    logits, cache = cached(params, tokens[:, :6], config, bias, cache, jnp.int32(0))
    steps = [logits]
    for position in range(6, 10):
        logits, cache = cached(
            params, tokens[:, position : position + 1], config, bias, cache, jnp.int32(position)
        )
        steps.append(logits)
    got = jnp.concatenate(steps, axis=1)
    assert float(jnp.max(jnp.abs(got - expected))) <= 1e-4


def sample(run: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    """`keel sample RUN --prompt "The history of" --max-tokens 24 EXTRA...` as a user runs it."""
    args = ["sample", str(run), "--prompt", "The history of", "--max-tokens", "24", *extra]
    result = subprocess.run(
        [sys.executable, "-m", "keel", *args], capture_output=True, text=True, timeout=120
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_the_same_seed_gives_the_same_text(trained_run):
    first, again = sample(trained_run, "--seed", "7"), sample(trained_run, "--seed", "7")
    assert first.stdout.startswith("The history of")
    assert len(first.stdout) > len("The history of\n")
    assert first.stdout == again.stdout
    assert "tokens/s" in first.stderr


def test_another_seed_draws_other_tokens():
    params, bias = random_model(SMALL_DENSE)
    prompt = np.asarray([[5, 17, 42]], np.int32)
    runs = [
        generate(params, SMALL_DENSE, bias, prompt, SamplingConfig(max_tokens=16, seed=seed))
        for seed in (3, 3, 4)
    ]
    np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
    assert not np.array_equal(runs[0].tokens, runs[2].tokens)


def test_a_missing_step_and_a_run_without_checkpoint_are_one_error_line(trained_run, tmp_path):
    missing = sample(trained_run, "--step", "5", check=False)
    assert missing.returncode == 2
    assert error_lines(missing.stderr) == [
        f"error: {trained_run} has no checkpoint at step 5; its checkpoints: 2"
    ]
    empty = tmp_path / "untrained"
    empty.mkdir()
    shutil.copy(trained_run / "config.yaml", empty / "config.yaml")
    result = sample(empty, check=False)
    assert result.returncode == 2
    assert len(error_lines(result.stderr)) == 1
    assert "holds no checkpoint" in result.stderr
    assert "Traceback" not in result.stderr
