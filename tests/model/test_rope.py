"""RoPE scaling: YaRN's frequencies are the published formula, YaRN lets a model trained at 256
tokens read 1024 better than unchanged RoPE, and scaling settings that do not fit are one
error line."""

import math
import subprocess
import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from keel.core.errors import ConfigError
from keel.data.token_cache import TokenCache
from keel.model.config import ModelConfig
from keel.model.loss import cross_entropy
from keel.model.rope import attention_scale, inverse_frequencies, rope_tables
from keel.model.transformer import forward, init_params
from keel.train.config import Phase, TrainConfig


def yarn_reference(dim, base, factor, original, beta_fast=32.0, beta_slow=1.0):
    """YaRN's inverse frequencies and mscale as the paper's reference code writes them
    (Peng et al. 2023; jquesnelle/yarn, LlamaYaRNScaledRotaryEmbedding), in float64 numpy."""

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    mscale = 0.1 * math.log(factor) + 1.0
    return inv_freq, mscale


@pytest.mark.parametrize(
    ("head_dim", "theta", "factor", "original"),
    [(64, 10_000.0, 4.0, 256), (128, 500_000.0, 8.0, 4096), (16, 10_000.0, 2.0, 64)],
)
def test_yarn_frequencies_equal_the_published_formula(head_dim, theta, factor, original):
    config = ModelConfig(
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling="yarn",
        rope_factor=factor,
        rope_original_len=original,
    ).validate()
    expected, mscale = yarn_reference(head_dim, theta, factor, original)
    np.testing.assert_allclose(np.asarray(inverse_frequencies(config)), expected, rtol=2e-6)
    assert attention_scale(config) == pytest.approx(mscale)
    cos, sin = rope_tables(8, config)
    angles = np.arange(8)[:, None] * expected[None, :]
    np.testing.assert_allclose(np.asarray(cos), np.cos(angles) * mscale, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), np.sin(angles) * mscale, rtol=1e-5, atol=1e-6)
    # Fast dimensions keep their frequency, slow ones are divided by the factor.
    plain = np.asarray(inverse_frequencies(replace(config, rope_scaling="none", rope_factor=1.0)))
    got = np.asarray(inverse_frequencies(config))
    assert got[0] == pytest.approx(plain[0])
    assert got[-1] == pytest.approx(plain[-1] / factor)


def test_linear_scaling_divides_every_frequency():
    plain = ModelConfig(head_dim=32)
    linear = replace(plain, rope_scaling="linear", rope_factor=4.0).validate()
    np.testing.assert_allclose(inverse_frequencies(linear), inverse_frequencies(plain) / 4.0)
    assert attention_scale(linear) == 1.0


TINY = ModelConfig(
    vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128
)
TRAIN_LEN, LONG_LEN = 256, 1024


def test_yarn_reads_past_the_trained_length_better_than_unchanged_rope(wikitext_cache):
    """Trained at 256 tokens, evaluated at 1024: positions 256-1023 have a lower mean loss with
    YaRN (factor 4 over 256) than with the RoPE the model was trained with."""
    tokens = TokenCache(wikitext_cache).slice(0, TokenCache(wikitext_cache).total_tokens)
    tokens = np.asarray(tokens, np.int32)
    held_out = tokens[-8 * (LONG_LEN + 1) :].reshape(8, LONG_LEN + 1)
    train_tokens = tokens[: -8 * (LONG_LEN + 1)]
    windows = len(train_tokens) // (TRAIN_LEN + 1)
    train_windows = train_tokens[: windows * (TRAIN_LEN + 1)].reshape(windows, TRAIN_LEN + 1)

    def loss_per_position(params, window, config):
        logits, _ = forward(params, window[:, :-1], config, None)
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(log_probs, window[:, 1:, None], axis=-1)[..., 0]
        return -picked.mean(axis=0)  # [seq]

    def loss_fn(params, window):
        logits, _ = forward(params, window[:, :-1], TINY, None)
        return cross_entropy(logits, window[:, 1:], jnp.ones(window[:, 1:].shape)).cross_entropy

    optimizer = optax.adamw(3e-3)

    @jax.jit
    def step(params, opt_state, window):
        loss, grads = jax.value_and_grad(loss_fn)(params, window)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = init_params(jax.random.key(0), TINY)
    opt_state = optimizer.init(params)
    order = np.random.default_rng(0).permutation(windows)
    batch = 8
    for index in range(100):  # at 100 steps: ~4.19 nats (plain) against ~4.18 (YaRN)
        rows = order[(index * batch) % (windows - batch) :][:batch]
        params, opt_state, loss = step(params, opt_state, jnp.asarray(train_windows[rows]))
    assert float(loss) < 4.5  # it learned something (uniform over 512 ids is 6.2)

    yarn = replace(TINY, rope_scaling="yarn", rope_factor=4.0, rope_original_len=TRAIN_LEN)
    held = jnp.asarray(held_out)
    plain_loss = np.asarray(jax.jit(loss_per_position, static_argnums=2)(params, held, TINY))
    yarn_loss = np.asarray(jax.jit(loss_per_position, static_argnums=2)(params, held, yarn))
    plain_far, yarn_far = plain_loss[TRAIN_LEN:].mean(), yarn_loss[TRAIN_LEN:].mean()
    assert yarn_far < plain_far, (yarn_far, plain_far)


@pytest.mark.parametrize(
    ("model", "phase", "message"),
    [
        ({"rope_scaling": "yarn", "rope_factor": 4.0}, {}, "needs model.rope_original_len"),
        (
            {"rope_scaling": "yarn", "rope_factor": 0.5, "rope_original_len": 256},
            {},
            "rope_factor must be >= 1",
        ),
        ({"rope_factor": 4.0}, {}, "does nothing with model.rope_scaling=none"),
        (
            {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_len": 1024},
            {"seq_len": 1024},
            "rope_original_len (1024) must be below seq_len (1024)",
        ),
        (
            {"rope_scaling": "yarn", "rope_factor": 2.0, "rope_original_len": 256},
            {"seq_len": 1024},
            "set rope_factor to at least 4",
        ),
        (
            {"rope_original_len": 256},
            {"seq_len": 1024, "rope_scaling": "yarn", "rope_factor": 2.0},
            "phase 'main': model.rope_factor 2.0 x rope_original_len 256",
        ),
        (
            {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_len": 256,
             "yarn_beta_fast": 1.0},
            {"seq_len": 1024},
            "model.yarn_beta_slow (1.0) must be > 0 and below model.yarn_beta_fast (1.0)",
        ),
    ],
)  # fmt: skip
def test_scaling_that_does_not_fit_is_a_config_error(model, phase, message):
    config = TrainConfig(
        model=replace(TINY, **model), phases=(Phase(**{"seq_len": 256, **phase}),), steps=2
    )
    with pytest.raises(ConfigError) as caught:
        config.validate()
    assert message in str(caught.value)


def test_bad_yarn_setting_on_the_command_line_is_one_error_line(tmp_path):
    done = subprocess.run(
        [
            sys.executable, "-m", "keel", "train", "--preset", "tiny-dense", "--steps", "2",
            "--set", "model.rope_scaling=yarn", "--set", "model.rope_factor=4",
            "--output", str(tmp_path / "run"),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error:") and "needs model.rope_original_len" in lines[-1]
    assert not (tmp_path / "run" / "checkpoints").exists()
