"""A trained model's scores on token sequences, batched: the summed log-probability of the last
tokens of each sequence, whether greedy decoding would have produced them, and greedy (or
sampled) continuations that stop at given strings. `keel eval` builds its lm-eval adapter and its
bits-per-byte sets on it; nothing here imports lm-eval.

Scoring sorts the sequences by length and pads them on the right to a few bucketed lengths (two
per octave, at most 1.5x the longest input), each length with one row count, so a whole evaluation
compiles one shape per length bucket. Right padding leaves every real position's logits unchanged
(attention is causal; MoE routing without a mesh drops nothing). On a CPU the row count keeps a
batch's logits ([rows, length, vocab] float32) within LOGITS_BUDGET elements: they are most of a
small model's memory traffic, and batches that fit the last-level cache run up to 2x faster per
token. Log-probabilities are natural logarithms (nats), computed in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from keel.model.config import ModelConfig
from keel.model.decode import KVCache, forward_cached, init_cache
from keel.model.generate import sample_token
from keel.model.transformer import ModelParams, forward
from keel.train.trained import TrainedModel

MIN_BUCKET = 32
"""The shortest padded length (tokens)."""
LOGITS_BUDGET = 2**21
"""On a CPU, the most logits (rows x length x vocab, float32: 8 MiB) a scoring batch computes."""
SCORE_STEPS_PER_OCTAVE = 2
"""Scoring pads to lengths 32, 48, 64, 96, 128, 192, ...: at most 1.5x, one shape each."""
DEFAULT_BATCH_SIZE = 8
"""Sequences per forward pass (`keel eval`'s, and the trainer's eval_tasks')."""


@dataclass(frozen=True)
class Scored:
    logprob: float
    """Summed log-probability (nats) of the scored tokens."""
    greedy: bool
    """Every scored token is its position's most likely token."""


@dataclass(frozen=True)
class ScoreRequest:
    tokens: tuple[int, ...]
    """The sequence: the model reads tokens[:-1] and predicts tokens[1:]."""
    n_scored: int
    """How many of the last tokens are scored (1 <= n_scored < len(tokens))."""


def bucket(length: int, per_octave: int = 1) -> int:
    """The padded length for `length` tokens, at least MIN_BUCKET: `per_octave` evenly spaced
    lengths between successive powers of two (1: the next power of two)."""
    if length <= MIN_BUCKET:
        return MIN_BUCKET
    half = 1 << (length - 1).bit_length() - 1  # the power of two below length
    step = max(half // per_octave, 1)
    return half + -(-(length - half) // step) * step


@partial(jax.jit, static_argnames=("config",))
def _target_scores(
    params: ModelParams, router_bias: jax.Array | None, tokens: jax.Array, *, config: ModelConfig
) -> tuple[jax.Array, jax.Array]:
    """tokens [batch, L] -> (log p(tokens[:, 1:]) [batch, L-1] float32, greedy [batch, L-1]).
    log_softmax's arithmetic (logit - max - log sum exp(logits - max)), reading only the
    targets' logits: no second [batch, L-1, vocab] array."""
    logits, _ = forward(params, tokens[:, :-1], config, router_bias)
    targets = tokens[:, 1:]
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    normalizer = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    picked = jnp.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0] - normalizer
    return picked, jnp.argmax(logits, axis=-1) == targets


@partial(jax.jit, static_argnames=("config", "temperature"), donate_argnames=("cache",))
def _next_token(
    params: ModelParams,
    tokens: jax.Array,
    router_bias: jax.Array | None,
    cache: KVCache,
    start: jax.Array,
    last: jax.Array,
    key: jax.Array,
    *,
    config: ModelConfig,
    temperature: float,
) -> tuple[jax.Array, KVCache]:
    """Feed tokens [1, n] at `start` into the cache; the token [1] after position start + last
    (the last real one of a right-padded prompt), drawn with the key of that position."""
    logits, cache = forward_cached(params, tokens, config, router_bias, cache, start)
    position = start + last + 1
    picked = jax.lax.dynamic_index_in_dim(logits, last, axis=1, keepdims=False)
    return sample_token(picked, jax.random.fold_in(key, position), temperature, 1.0), cache


class Scorer:
    """Scores and continues token sequences with one trained model."""

    def __init__(
        self, trained: TrainedModel, max_length: int, batch_size: int = DEFAULT_BATCH_SIZE
    ) -> None:
        """max_length: the most tokens the model reads at once (longer inputs keep their last
        max_length); batch_size: sequences per forward pass at most (on a CPU, fewer where
        their logits would pass LOGITS_BUDGET)."""
        self.trained = trained
        self.max_length = max_length
        self.batch_size = batch_size
        self.logits_budget = LOGITS_BUDGET if jax.default_backend() == "cpu" else None

    def rows(self, width: int) -> int:
        """Sequences per forward pass at padded length `width`: batch_size, or on a CPU as many
        (at least 1) as keep the batch's logits within LOGITS_BUDGET."""
        if self.logits_budget is None:
            return self.batch_size
        per_row = width * self.trained.model.vocab_size
        return max(1, min(self.batch_size, self.logits_budget // per_row))

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        """Each request's scored tokens' summed log-probability, in the requests' order."""
        fitted = [self._fit(request) for request in requests]
        order = sorted(range(len(fitted)), key=lambda i: -len(fitted[i].tokens))
        out: list[Scored | None] = [None] * len(requests)
        first = 0
        while first < len(order):
            # the model reads all tokens but the last: their count is what is bucketed
            width = bucket(len(fitted[order[first]].tokens) - 1, SCORE_STEPS_PER_OCTAVE) + 1
            chunk = order[first : first + self.rows(width)]
            rows = [fitted[i] for i in chunk]
            for index, scored in zip(chunk, self._score_batch(rows, width), strict=True):
                out[index] = scored
            first += len(chunk)
        return out  # type: ignore[return-value]

    def _fit(self, request: ScoreRequest) -> ScoreRequest:
        """The request cut to max_length inputs (the oldest tokens go first)."""
        if not 1 <= request.n_scored < len(request.tokens):
            raise ValueError(
                f"n_scored {request.n_scored} must be in [1, {len(request.tokens)}) tokens"
            )
        tokens = request.tokens[-(self.max_length + 1) :]
        return ScoreRequest(tokens, min(request.n_scored, len(tokens) - 1))

    def _score_batch(self, rows: list[ScoreRequest], width: int) -> list[Scored]:
        """Score `rows` (none longer than `width`) in one forward pass of rows(width) rows."""
        padded = np.zeros((self.rows(width), width), np.int32)
        for i, row in enumerate(rows):
            padded[i, : len(row.tokens)] = row.tokens
        m = self.trained
        logp, greedy = _target_scores(m.params, m.router_bias, jnp.asarray(padded), config=m.model)
        logp, greedy = np.asarray(logp), np.asarray(greedy)
        scored = []
        for i, row in enumerate(rows):
            end = len(row.tokens) - 1  # the last prediction's index
            span = slice(end - row.n_scored, end)
            scored.append(
                Scored(float(logp[i, span].sum(dtype=np.float64)), bool(greedy[i, span].all()))
            )
        return scored

    def continue_ids(
        self,
        prompt: Sequence[int],
        max_new: int,
        stop: Callable[[list[int]], bool],
        temperature: float = 0.0,
        seed: int = 0,
    ) -> list[int]:
        """Up to `max_new` tokens after `prompt` (its last max_length tokens), one jitted step
        each over the key/value cache (keel.model.decode); stops once `stop(new_ids)` is true
        or the end-of-document id comes (not returned). Temperature 0 is greedy."""
        m = self.trained
        prompt = list(prompt)[-self.max_length :]
        # One cache size and few prompt buckets: a whole evaluation compiles a handful of shapes.
        cache = init_cache(m.model, 1, bucket(self.max_length + max_new))
        padded = np.zeros((1, bucket(len(prompt))), np.int32)
        padded[0, : len(prompt)] = prompt
        settings = {"config": m.model, "temperature": temperature}
        key = jax.random.key(seed)
        tokens, start, last = jnp.asarray(padded), 0, len(prompt) - 1
        new: list[int] = []
        while len(new) < max_new:
            token, cache = _next_token(
                m.params,
                tokens,
                m.router_bias,
                cache,
                jnp.int32(start),
                jnp.int32(last),
                key,
                **settings,
            )
            token_id = int(token[0])
            if token_id == m.eos_id:
                break
            new.append(token_id)
            if stop(new):
                break
            tokens, start, last = token[:, None], start + last + 1, 0
        return new


def rolling_requests(ids: Sequence[int], prefix_id: int, max_length: int) -> list[ScoreRequest]:
    """Requests that score every token of `ids` exactly once, each with as much preceding context
    as max_length allows (the first token conditioned on `prefix_id`): lm-eval's rolling
    windows, so the last window reads a full context."""
    full = [prefix_id, *ids]
    requests = []
    for begin in range(0, len(ids), max_length):
        end = min(begin + max_length, len(ids))  # targets ids[begin:end] = full[begin+1:end+1]
        window = full[max(0, end - max_length) : end + 1]
        requests.append(ScoreRequest(tuple(window), end - begin))
    return requests
