"""The training data loader: fixed-length windows of token caches, addressed by index.

The batch at step k is a pure function of (seed, k): resuming needs no loader state.

- Sequence j of step k has the global index g = k * batch_size + j.
- Its source (in a mixture) comes from a stratified keyed hash of (seed, g): the global indices
  fall in blocks of MIX_BLOCK; within a block, a keyed Feistel permutation gives each index a
  distinct point of a grid of MIX_BLOCK points in [0, 1), which falls in one source's share of the
  cumulative normalised weights. So each source gets a fixed count of sequences per block (its
  weight to 1 / MIX_BLOCK), in a pseudo-random order.
- Within source s, g_s is the number of earlier global indices that chose s (block * count_s plus
  the rank of g among the block's indices that chose s, computed from the block alone), so g_s
  runs 0, 1, 2, ... as g grows. Epoch e = g_s // len_s, and the window is
  start_s + feistel_permute(g_s mod len_s, len_s, key=hash(seed, s, e)): each epoch of a source
  visits every one of its windows exactly once, in a fresh order.

A window holds seq_len + 1 tokens: inputs w[:-1], targets w[1:] (see keel/data/token_cache.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from keel.core import paths
from keel.core.errors import ConfigError, UsageError
from keel.data.token_cache import TokenCache

MIX_BLOCK = 1 << 16
"""Global indices per stratification block of a mixture: weights resolve to 1 / MIX_BLOCK."""
STEP_BLOCK_SEQUENCES = 4096
"""MixtureLoader.indices works out this many sequences' windows at once (whole steps, at least
one) and serves the following steps from them: at batch 8 a step's indices alone cost ~0.8 ms of
numpy calls on tiny arrays, a sixth of a small model's step on a CPU."""

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# domain tags, so the hashes of different purposes never coincide
_TAG_ROUND, _TAG_MIX, _TAG_WINDOW = 0x5EED0001, 0x5EED0002, 0x5EED0003


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (wrapping arithmetic): a bijection of 64 bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _as_u64(value: int | np.ndarray) -> np.ndarray:
    """An int (any sign or size, taken mod 2^64) or an integer array as a uint64 array."""
    if isinstance(value, np.ndarray):
        if value.dtype == np.uint64:
            return value
        return value.astype(np.int64, copy=False).view(np.uint64)
    return np.array([int(value) & _MASK64], np.uint64)


def _hash(*parts: int | np.ndarray) -> np.ndarray:
    """A 64-bit hash of a sequence of ints and integer arrays (broadcast): uint64 array."""
    state = np.zeros(1, np.uint64)
    for part in parts:
        state = _mix64((state ^ _as_u64(part)) + _GOLDEN)
    return state


def _half_bits(n: int) -> int:
    """The smallest h with 4^h >= n: a balanced Feistel network's half width in bits."""
    return ((n - 1).bit_length() + 1) // 2


def _feistel_round_trip(x: np.ndarray, half: int, round_keys: list[np.ndarray]) -> np.ndarray:
    """One pass of the balanced Feistel network over [0, 4^half): uint64 in, uint64 out."""
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = x >> shift, x & mask
    for key in round_keys:
        left, right = right, left ^ (_mix64(right ^ key) & mask)
    return (left << shift) | right


def _permute(indices: np.ndarray, n: int, keys: np.ndarray, rounds: int) -> np.ndarray:
    """feistel_permute with a key per index (`keys` uint64, broadcast against `indices`)."""
    half = _half_bits(n)
    x = np.ascontiguousarray(indices, dtype=np.int64).view(np.uint64)
    keys = np.broadcast_to(keys, x.shape)
    round_keys = [_hash(_TAG_ROUND, keys, r) for r in range(rounds)]
    out = _feistel_round_trip(x, half, round_keys)
    todo = np.flatnonzero(out >= np.uint64(n))
    while todo.size:  # cycle walking: a permutation's cycle returns below n, so this ends
        out[todo] = _feistel_round_trip(out[todo], half, [k[todo] for k in round_keys])
        todo = todo[out[todo] >= np.uint64(n)]
    return out.view(np.int64)


def feistel_permute(indices: np.ndarray, n: int, key: int, rounds: int = 4) -> np.ndarray:
    """A keyed bijection of [0, n), applied to `indices` (int64, any shape, each in [0, n)).

    A balanced Feistel network over [0, 4^h), the smallest such domain >= n, with splitmix64
    round functions keyed by (key, round), and cycle walking until the value is below n.
    Deterministic across runs and machines; the same shape of int64 comes back."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    indices = np.asarray(indices, dtype=np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= n):
        raise ValueError(f"indices must lie in [0, {n})")
    flat = _permute(indices.reshape(-1), n, _as_u64(key), rounds)
    return flat.reshape(indices.shape)


@dataclass(frozen=True)
class WindowRange:
    """Windows [start, stop) of `seq_len + 1` tokens of the token cache at `cache` (a path)."""

    cache: str
    seq_len: int
    start: int
    stop: int

    def __len__(self) -> int:
        return max(0, self.stop - self.start)


def split_windows(
    cache: TokenCache | str, seq_len: int, eval_fraction: float
) -> tuple[WindowRange, WindowRange]:
    """(train, eval) ranges of a cache's windows: the last ceil(eval_fraction * n) windows (at
    least one when eval_fraction > 0) are held out for evaluation, the rest train. The last train
    window's final target is the first eval window's first input (windows share one token)."""
    cache = cache if isinstance(cache, TokenCache) else TokenCache(cache)
    if not 0 <= eval_fraction < 1:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = cache.num_windows(seq_len)
    needed_windows = 2 if eval_fraction > 0 else 1
    if n < needed_windows:
        raise ConfigError(
            f"token cache {cache.path} has {cache.total_tokens} tokens; {needed_windows} "
            f"window(s) of seq_len {seq_len} need {needed_windows * seq_len + 1}: use a larger "
            "cache or a smaller seq_len"
        )
    held_out = 0
    if eval_fraction > 0:
        held_out = min(n - 1, max(1, math.ceil(eval_fraction * n - 1e-9)))
    split = n - held_out
    return (
        WindowRange(cache.path, seq_len, 0, split),
        WindowRange(cache.path, seq_len, split, n),
    )


def check_cache(path: str, vocab_size: int) -> TokenCache:
    """Open a token cache for a model with `vocab_size` ids, before anything compiles.
    UsageError when it is missing or not a cache; ConfigError when its vocabulary differs. A
    cache of fewer ids than the model's passes when its tokenizer could not learn more (a BPE
    trained on a small text stops early): the model's extra ids are never seen, as in a padded
    vocabulary."""
    if not paths.exists(path):
        raise UsageError(
            f"token cache {path} does not exist: check the path, or make it with keel data tokenize"
        )
    cache = TokenCache(path)
    requested = cache.manifest.details.get("tokenizer", {}).get("requested_vocab_size")
    fits = cache.manifest.vocab_size == vocab_size or (
        requested == vocab_size and cache.manifest.vocab_size < vocab_size
    )
    if not fits:
        raise ConfigError(
            f"cache {cache.path} was tokenized with a vocabulary of {cache.manifest.vocab_size} "
            f"ids, the model has {vocab_size}: retokenize or set model.vocab_size"
        )
    return cache


def read_windows(cache: TokenCache, windows: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows `windows` [m] of a cache: [m, seq_len + 1] int32, gathered shard by shard from
    the memmaps (a window that crosses a shard boundary is read with TokenCache.slice)."""
    windows = np.asarray(windows, dtype=np.int64)
    out = np.empty((len(windows), seq_len + 1), np.int32)
    counts = [shard.tokens for shard in cache.shards]
    shard_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    starts = windows * seq_len
    shard = np.searchsorted(shard_starts, starts, side="right") - 1
    inside = starts + seq_len + 1 <= shard_starts[np.minimum(shard + 1, len(counts))]
    offsets = np.arange(seq_len + 1, dtype=np.int64)
    for index in np.unique(shard[inside]).tolist():
        rows = np.flatnonzero(inside & (shard == index))
        local = starts[rows] - shard_starts[index]
        out[rows] = cache.tokens[index][local[:, None] + offsets]
    for row in np.flatnonzero(~inside).tolist():
        out[row] = cache.slice(int(starts[row]), int(starts[row]) + seq_len + 1)
    return out


def _check_range(cache: TokenCache, window_range: WindowRange, allow_empty: bool = False) -> None:
    count = cache.num_windows(window_range.seq_len)
    start, stop = window_range.start, window_range.stop
    if not (0 <= start <= stop <= count and (allow_empty or start < stop)):
        raise ConfigError(
            f"windows [{start}, {stop}) of {cache.path} are empty or out of range: it has "
            f"{count} windows of seq_len {window_range.seq_len}"
        )


class MixtureLoader:
    """Batches of windows from one or more token caches, mixed by weight; the batch at a step
    is a pure function of (seed, step). See the module docstring for the exact addressing."""

    def __init__(
        self,
        sources: Sequence[tuple[WindowRange, float]],
        batch_size: int,
        seed: int,
        position: tuple[int, int] = (0, 0),
    ) -> None:
        """`position` = (step, sequence): the batch at `step` starts at global sequence index
        `sequence` (default: step 0 at sequence 0). A run whose batch size changed at step r
        continues at (r, the sequences drawn before r), so no sequence is drawn twice or
        skipped across the change."""
        if not sources:
            raise ConfigError("a loader needs at least one source (a window range and a weight)")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        self.ranges = [window_range for window_range, _ in sources]
        weights = [float(weight) for _, weight in sources]
        for window_range, weight in zip(self.ranges, weights, strict=True):
            if not (math.isfinite(weight) and weight > 0):
                raise ConfigError(
                    f"source {window_range.cache} has weight {weight}: weights must be > 0"
                )
        self.seq_len = self.ranges[0].seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.position = position
        opened: dict[str, TokenCache] = {}
        for window_range in self.ranges:
            if window_range.seq_len != self.seq_len:
                raise ConfigError(
                    f"sources {self.ranges[0].cache} and {window_range.cache} have seq_len "
                    f"{self.seq_len} and {window_range.seq_len}: all sources must share one"
                )
            if window_range.cache not in opened:
                opened[window_range.cache] = TokenCache(window_range.cache)
            _check_range(opened[window_range.cache], window_range)
        self.caches = [opened[window_range.cache] for window_range in self.ranges]
        """The cache of each source (a cache named by several sources is opened once)."""
        first = self.caches[0]
        for cache in self.caches[1:]:
            a, b = first.manifest, cache.manifest
            if (a.tokenizer_sha256, a.vocab_size) != (b.tokenizer_sha256, b.vocab_size):
                raise ConfigError(
                    f"caches {first.path} and {cache.path} have different vocabularies "
                    f"(tokenizer {a.tokenizer_sha256[:12]} with {a.vocab_size} ids vs "
                    f"{b.tokenizer_sha256[:12]} with {b.vocab_size}): tokenize both with one "
                    "tokenizer"
                )
        self.vocab_size = first.manifest.vocab_size
        self.eos_id = first.eos_id
        self.lengths = np.array([len(r) for r in self.ranges], np.int64)
        total = sum(weights)
        cumulative = np.cumsum([w / total for w in weights])
        bounds = np.rint(cumulative * MIX_BLOCK).astype(np.int64)
        bounds[-1] = MIX_BLOCK
        self._bounds = np.concatenate([[0], bounds])
        """Grid points [bounds[s], bounds[s + 1]) of a block choose source s."""
        self._counts = np.diff(self._bounds)
        if np.any(self._counts == 0):
            small = self.ranges[int(np.argmin(self._counts))].cache
            raise ConfigError(
                f"source {small}'s weight is below 1/{MIX_BLOCK} of the total: raise it or drop "
                "the source"
            )
        self._block_memo: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._steps_per_block = max(1, STEP_BLOCK_SEQUENCES // batch_size)
        self._step_memo: tuple[int, np.ndarray, np.ndarray] | None = None
        """(first step, source [steps, batch_size], window [steps, batch_size]) of the steps
        worked out last."""

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source [MIX_BLOCK], rank of each index among the block's indices of its source)."""
        if block not in self._block_memo:
            grid = _permute(
                np.arange(MIX_BLOCK, dtype=np.int64),
                MIX_BLOCK,
                _hash(_TAG_MIX, self.seed, block),
                4,
            )
            source = np.searchsorted(self._bounds[1:], grid, side="right")
            order = np.argsort(source, kind="stable")  # each source's indices, ascending
            rank = np.empty(MIX_BLOCK, np.int64)
            rank[order] = np.arange(MIX_BLOCK, dtype=np.int64) - self._bounds[source[order]]
            if len(self._block_memo) >= 4:
                self._block_memo.pop(next(iter(self._block_memo)))
            self._block_memo[block] = (source, rank)
        return self._block_memo[block]

    def indices(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source [batch_size] int64, window [batch_size] int64) of each sequence of a step."""
        if step < 0:
            raise UsageError(f"step must be at least 0, got {step}")
        first_step, first_sequence = self.position
        if step < first_step:
            raise UsageError(f"step {step} is before this loader's first step {first_step}")
        block_start = step - (step - first_step) % self._steps_per_block
        memo = self._step_memo
        if memo is None or memo[0] != block_start:
            g = (
                first_sequence
                + (block_start - first_step) * self.batch_size
                + np.arange(self._steps_per_block * self.batch_size, dtype=np.int64)
            )
            source, window = self._sequence_indices(g)
            shape = (self._steps_per_block, self.batch_size)
            memo = self._step_memo = (block_start, source.reshape(shape), window.reshape(shape))
        return memo[1][step - block_start].copy(), memo[2][step - block_start].copy()

    def _sequence_indices(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of global sequence indices `g` (int64 [m]): the addressing of the
        module docstring, which depends on each index alone."""
        if len(self.ranges) == 1:
            source, g_s = np.zeros_like(g), g
        else:
            block, position = g // MIX_BLOCK, g % MIX_BLOCK
            source, g_s = np.empty_like(g), np.empty_like(g)
            for b in np.unique(block).tolist():
                rows = np.flatnonzero(block == b)
                block_source, block_rank = self._block(b)
                source[rows] = block_source[position[rows]]
                g_s[rows] = b * self._counts[source[rows]] + block_rank[position[rows]]
        window = np.empty_like(g)
        for s in np.unique(source).tolist():
            rows = np.flatnonzero(source == s)
            n = int(self.lengths[s])
            keys = _hash(_TAG_WINDOW, self.seed, s, g_s[rows] // n)
            window[rows] = self.ranges[s].start + _permute(g_s[rows] % n, n, keys, 4)
        return source, window

    def batch(self, step: int, rows: slice = slice(None)) -> np.ndarray:
        """The batch of a step, [batch_size, seq_len + 1] int32 token ids, or only its `rows`
        (a process reads just the sequences its devices take)."""
        source, window = self.indices(step)
        source, window = source[rows], window[rows]
        out = np.empty((len(source), self.seq_len + 1), np.int32)
        for s in np.unique(source).tolist():
            rows = np.flatnonzero(source == s)
            out[rows] = read_windows(self.caches[s], window[rows], self.seq_len)
        return out


def eval_batches(
    window_range: WindowRange, batch_size: int, max_batches: int | None = None
) -> Iterator[np.ndarray]:
    """The windows of a range in order, as [b, seq_len + 1] int32 batches of `batch_size` (the
    last may be smaller), at most `max_batches` of them (None: all); none for an empty range."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    cache = TokenCache(window_range.cache)
    _check_range(cache, window_range, allow_empty=True)
    starts = range(window_range.start, window_range.stop, batch_size)
    for count, start in enumerate(starts):
        if max_batches is not None and count >= max_batches:
            return
        stop = min(start + batch_size, window_range.stop)
        yield read_windows(cache, np.arange(start, stop, dtype=np.int64), window_range.seq_len)


def scored_batches(
    window_range: WindowRange,
    batch_size: int,
    max_batches: int | None = None,
    *,
    tail: bool = False,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The windows of a range in order as (windows [batch_size, seq_len + 1] int32, weights
    [batch_size, seq_len] float32: 1 for each target to score, 0 for padding), at most
    `max_batches` batches (None: all). With `tail` the cache's tokens after the range's last
    window (fewer than seq_len + 1, the range must end at the cache's last window) come too, as
    one zero-padded row whose padding weighs 0, when every window of the range was yielded: the
    whole cache's windows plus the tail score every token after the first exactly once."""
    cache = TokenCache(window_range.cache)
    seq_len = window_range.seq_len
    pending: tuple[np.ndarray, np.ndarray] | None = None  # held back: the tail may join it
    read = 0
    for batch in eval_batches(window_range, batch_size, max_batches):
        if pending is not None:
            yield _padded(*pending, batch_size)
        pending = batch, np.ones((len(batch), seq_len), np.float32)
        read += len(batch)
    last = _tail_row(cache, window_range) if tail and read == len(window_range) else None
    if last is not None:
        if pending is not None and len(pending[0]) < batch_size:
            pending = np.concatenate([pending[0], last[0]]), np.concatenate([pending[1], last[1]])
        else:
            if pending is not None:
                yield _padded(*pending, batch_size)
            pending = last
    if pending is not None:
        yield _padded(*pending, batch_size)


def _padded(
    windows: np.ndarray, weights: np.ndarray, batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows padded to `batch_size` with zero windows that weigh 0."""
    out = np.zeros((batch_size, windows.shape[1]), np.int32)
    out_weights = np.zeros((batch_size, weights.shape[1]), np.float32)
    out[: len(windows)] = windows
    out_weights[: len(weights)] = weights
    return out, out_weights


def _tail_row(cache: TokenCache, window_range: WindowRange) -> tuple[np.ndarray, np.ndarray] | None:
    """The tokens after the cache's last whole window as ([1, seq_len + 1] zero-padded window,
    [1, seq_len] weights of its real targets), or None when they hold no target."""
    seq_len = window_range.seq_len
    if window_range.stop != cache.num_windows(seq_len):
        raise ConfigError(
            f"windows [{window_range.start}, {window_range.stop}) of {cache.path} stop before its "
            f"last window ({cache.num_windows(seq_len)}): only a range to the end has a tail"
        )
    start = window_range.stop * seq_len
    tokens = cache.slice(start, cache.total_tokens)
    if len(tokens) < 2:
        return None
    window = np.zeros((1, seq_len + 1), np.int32)
    window[0, : len(tokens)] = tokens
    weights = np.zeros((1, seq_len), np.float32)
    weights[0, : len(tokens) - 1] = 1.0
    return window, weights
