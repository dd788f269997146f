"""Long-context evaluation (keel.train.long_eval): the loss by position bucket is the mean of the
per-position losses, the passkey check scores the model's greedy answer, and both are logged at
evaluation steps."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mesh_support import small_dense
from tokenizers import Tokenizer

from keel.data.token_cache import TokenCache
from keel.model.transformer import forward
from keel.train.layout import initial_state
from keel.train.long_eval import (
    BUCKET_METRIC,
    PASSKEY_METRIC,
    LongContextTotals,
    passkey_accuracy,
    passkey_batch,
    position_buckets,
)
from keel.train.schedule import piecewise_lr
from keel.train.step import build_step_functions
from keel.train.trainer import train

SEQ = 2048


def test_buckets_grow_4x_from_1k_and_clip_at_the_length():
    assert position_buckets(20_000) == [(0, 1024), (1024, 4096), (4096, 16384), (16384, 20000)]
    assert position_buckets(256) == [(0, 256)]


@pytest.fixture(scope="module")
def evaluated(wikitext_cache):
    """A fresh tiny model's evaluate at 2048 tokens: (config, state, outputs for a batch of
    random windows with some padding, outputs for a passkey batch, the passkey batch)."""
    config = small_dense(f"phases.0.seq_len={SEQ}", "batch_size=2").with_data((wikitext_cache,))
    learning_rate = piecewise_lr(config.segments())
    state, optimizer, layout = initial_state(config, learning_rate, jax.devices()[:1])
    evaluate = build_step_functions(
        config, optimizer, learning_rate, jnp.ones(512, jnp.int32), 0, layout
    ).evaluate
    rng = np.random.default_rng(0)
    windows = jnp.asarray(rng.integers(1, 512, (2, SEQ + 1)), jnp.int32)
    weights = jnp.asarray(rng.random((2, SEQ)) < 0.9, jnp.float32)  # padding weighs 0
    cache = TokenCache(wikitext_cache)
    tokenizer = Tokenizer.from_file(cache.tokenizer_path())
    passkey = passkey_batch(tokenizer, SEQ, 2, seed=0)
    assert passkey is not None
    outputs = evaluate(state.params, state.router_bias, windows, weights)
    passkey_outputs = evaluate(
        state.params, state.router_bias, jnp.asarray(passkey.windows), jnp.asarray(passkey.weights)
    )
    return config, state, (windows, weights, outputs), (passkey, passkey_outputs)


def _logits(config, state, windows):
    run = jax.jit(forward, static_argnums=2)
    logits, _ = run(state.params, windows[:, :-1], config.model, state.router_bias)
    return np.asarray(logits, np.float64)


def test_bucket_losses_are_the_means_of_the_per_position_losses(evaluated):
    config, state, (windows, weights, outputs), _ = evaluated
    logits = _logits(config, state, windows)
    log_probs = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))[..., None]
        - logits.max(-1, keepdims=True)
    )
    targets = np.asarray(windows[:, 1:])
    nll = -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [batch, seq]
    weights = np.asarray(weights)
    totals = LongContextTotals()
    totals.add(SEQ, outputs[3])
    metrics = totals.metrics()
    assert set(metrics) == {BUCKET_METRIC + "0-1K", BUCKET_METRIC + "1K-2K"}
    for label, (start, end) in (("0-1K", (0, 1024)), ("1K-2K", (1024, 2048))):
        part = weights[:, start:end]
        want = (nll[:, start:end] * part).sum() / part.sum()
        assert metrics[BUCKET_METRIC + label] == pytest.approx(want, rel=1e-4)
    assert float(outputs[0]) / float(outputs[2]) == pytest.approx(
        (nll * weights).sum() / weights.sum(), rel=1e-4
    )


def test_passkey_scores_the_greedy_answer_tokens(evaluated):
    config, state, _, (passkey, outputs) = evaluated
    for row, weights in zip(passkey.windows, passkey.weights, strict=True):
        answer = row[1:][weights == 1]  # the key's tokens, also stated once in the filler
        stated = [i for i in range(SEQ - len(answer)) if (row[i : i + len(answer)] == answer).all()]
        assert len(answer) >= 1 and len(stated) == 1 and stated[0] < SEQ - 100
    greedy = _logits(config, state, jnp.asarray(passkey.windows)).argmax(-1)
    hits = ((greedy == passkey.windows[:, 1:]) * passkey.weights).sum(-1)
    long_context = outputs[3]
    np.testing.assert_array_equal(long_context["row_correct"], hits)
    np.testing.assert_array_equal(long_context["row_targets"], passkey.weights.sum(-1))
    assert passkey_accuracy(np.array([3.0, 2.0]), np.array([3.0, 3.0])) == 0.5


def test_training_logs_buckets_and_passkey_at_evaluation_steps(wikitext_cache, tmp_path):
    config = small_dense("phases.0.seq_len=256", "steps=2", "eval_every=1", "eval_batches=1")
    train(config.with_data((wikitext_cache,)), str(tmp_path), devices=jax.devices()[:1])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert 0.0 <= line[PASSKEY_METRIC] <= 1.0
        assert line[BUCKET_METRIC + "0-256"] == pytest.approx(line["eval_loss"], rel=1e-5)
