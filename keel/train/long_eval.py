"""Long-context evaluation: held-out loss by position bucket, and a passkey retrieval check.

Position buckets: [0, 1K), [1K, 4K), [4K, 16K), ... (each 4x the last), clipped to the length
evaluated; a length under 1K has one bucket, [0, length). Each bucket's loss is the mean
next-token loss (nats) of the scored targets at those positions, reported as
`eval/loss_by_position/<start>-<end>` (e.g. `0-1K`, `1K-4K`, `4K-8K` when clipped at 8K).

Passkey: a five-digit number stated once in filler text at some depth, then asked for at the
end ("What is the pass key? The pass key is"). The model passes a row when its greedy
prediction of every answer token (the key's tokens, teacher-forced) is right;
`eval/passkey_accuracy` is the fraction of rows that pass. One batch of rows, the key at depths
spread evenly from the start to the end of the filler; the keys are a function of the run's
seed, so evaluations of one run ask the same questions.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

FIRST_BUCKET = 1024
"""Tokens in the first position bucket."""
BUCKET_GROWTH = 4
"""Each further bucket ends this many times further out than the previous one."""
BUCKET_METRIC = "eval/loss_by_position/"
PASSKEY_METRIC = "eval/passkey_accuracy"

_INTRO = "There is a pass key hidden in this long text. Find it and remember it."
_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back."
_QUESTION = " What is the pass key? The pass key is"


def position_buckets(
    seq_len: int, first: int = FIRST_BUCKET, growth: int = BUCKET_GROWTH
) -> list[tuple[int, int]]:
    """[(start, end)] token positions of each bucket, the last clipped at `seq_len`."""
    buckets, start, end = [], 0, first
    while start < seq_len:
        buckets.append((start, min(end, seq_len)))
        start, end = end, end * growth
    return buckets


def bucket_label(start: int, end: int) -> str:
    """ "0-1K", "1K-4K", "0-256": K for a whole number of 1024 tokens."""

    def tokens(n: int) -> str:
        return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)

    return f"{tokens(start)}-{tokens(end)}"


def bucket_of_position(seq_len: int) -> np.ndarray:
    """[seq_len, n_buckets] float32 one-hot: which bucket each position falls in."""
    buckets = position_buckets(seq_len)
    positions = np.arange(seq_len)
    return np.stack(
        [((positions >= start) & (positions < end)) for start, end in buckets], axis=1
    ).astype(np.float32)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits [batch, seq, vocab], targets [batch, seq] -> negative log likelihood [batch, seq]
    (nats, float32)."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


@dataclass(frozen=True)
class PasskeyBatch:
    windows: np.ndarray
    """[rows, seq_len + 1] int32 token ids."""
    weights: np.ndarray
    """[rows, seq_len] float32: 1 on the targets that are the answer's tokens."""


def passkey_batch(tokenizer: Tokenizer, seq_len: int, rows: int, seed: int) -> PasskeyBatch | None:
    """`rows` passkey prompts of exactly seq_len + 1 tokens, or None when seq_len is too short
    to hide a key (the fixed text would leave less filler than itself)."""
    rng = np.random.default_rng(seed)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    intro, question, filler = encode(_INTRO), encode(_QUESTION), encode(_FILLER)
    windows = np.zeros((rows, seq_len + 1), np.int32)
    weights = np.zeros((rows, seq_len), np.float32)
    for row in range(rows):
        key = str(rng.integers(10_000, 100_000))
        answer = encode(" " + key)
        statement = encode(" The pass key is") + answer + encode(". Remember it.")
        fixed = len(intro) + len(statement) + len(question) + len(answer)
        room = seq_len + 1 - fixed
        if room < fixed:
            return None
        padding = (filler * (room // len(filler) + 1))[:room]
        depth = round(room * (row + 0.5) / rows)
        ids = intro + padding[:depth] + statement + padding[depth:] + question + answer
        windows[row] = ids
        weights[row, seq_len - len(answer) :] = 1.0
    return PasskeyBatch(windows, weights)


def passkey_accuracy(row_correct: np.ndarray, row_targets: np.ndarray) -> float:
    """Fraction of rows whose every scored target was the model's greedy prediction."""
    return float(np.mean(row_correct == row_targets))


class LongContextTotals:
    """Sums of evaluate's long-context outputs over an evaluation's batches, and the metrics."""

    def __init__(self) -> None:
        self.seq_len = 0
        self.nats: np.ndarray | None = None
        self.targets: np.ndarray | None = None

    def add(self, seq_len: int, long_context: dict[str, jax.Array]) -> None:
        """Add one batch's sums; `seq_len` is its windows' length (tokens, targets)."""
        nats = np.asarray(long_context["bucket_nats"], np.float64)
        targets = np.asarray(long_context["bucket_targets"], np.float64)
        if self.nats is None or seq_len != self.seq_len:
            self.seq_len = seq_len
            self.nats, self.targets = np.zeros_like(nats), np.zeros_like(nats)
        self.nats += nats
        self.targets += targets

    def metrics(self) -> dict[str, float]:
        """`eval/loss_by_position/<bucket>`: mean nats per scored target, buckets that scored."""
        if self.nats is None or self.targets is None:
            return {}
        out = {}
        for (start, end), nats, targets in zip(
            position_buckets(self.seq_len), self.nats, self.targets, strict=True
        ):
            if targets > 0:
                out[BUCKET_METRIC + bucket_label(start, end)] = float(nats / targets)
        return out
