"""The data loader: Feistel order, pure (seed, step) batches, mixtures, splits, bytes per token."""

import random

import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from keel.core.errors import ConfigError, UsageError
from keel.data.documents import write_texts
from keel.data.token_cache import TokenCache
from keel.data.tokenize import TokenizeConfig, run_tokenize
from keel.flow import RunOptions
from keel.train.loader import (
    MixtureLoader,
    WindowRange,
    check_cache,
    eval_batches,
    feistel_permute,
    split_windows,
)
from keel.train.token_bytes import byte_level_alphabet, token_byte_lengths

WORDS = ["the", "sea", "lobster", "claws", "of", "1996", ",", ".", "café", "naïve", "日本", "🙂"]
SEQ_LEN = 16
ONE = RunOptions(workers=1)


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 30))) for _ in range(count)]


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, str]:
    """Cache "a" (a trained tokenizer, several shards), "b" (other documents, a's tokenizer),
    "other" (a tokenizer with a different vocabulary)."""
    root = tmp_path_factory.mktemp("loader")
    a, b, other = (str(root / name) for name in ("a", "b", "other"))
    docs = write_texts(root / "docs-a", texts(300, seed=0))
    run_tokenize(docs, a, TokenizeConfig(vocab_size=400, shard_bytes=3_000), ONE)
    tokenizer = f"{a}/tokenizer.json"
    docs = write_texts(root / "docs-b", texts(200, seed=1))
    run_tokenize(docs, b, TokenizeConfig(tokenizer_path=tokenizer), ONE)
    run_tokenize(docs, other, TokenizeConfig(vocab_size=300), ONE)
    return {"a": a, "b": b, "other": other}


@pytest.mark.parametrize("n", [1, 2, 3, 1000, 4097])
def test_feistel_is_a_keyed_permutation(n):
    orders = [feistel_permute(np.arange(n), n, key).tolist() for key in (0, 1, 2**63 + 5)]
    for order in orders:
        assert sorted(order) == list(range(n))
    if n >= 1000:
        assert orders[0] != orders[1] != orders[2] != orders[0]
    again = feistel_permute(np.arange(n).reshape(-1, 1), n, 1)
    assert again.shape == (n, 1) and again.ravel().tolist() == orders[1]


def test_batches_are_a_pure_function_of_seed_and_step(caches):
    train, _ = split_windows(caches["a"], SEQ_LEN, 0.1)
    loader = MixtureLoader([(train, 1.0)], batch_size=4, seed=7)
    batches = [loader.batch(step) for step in (0, 5, 3)]
    fresh = MixtureLoader([(train, 1.0)], batch_size=4, seed=7)
    assert np.array_equal(fresh.batch(3), batches[2])  # no state: step 3 first, same batch
    assert np.array_equal(fresh.batch(0), batches[0])
    assert not np.array_equal(MixtureLoader([(train, 1.0)], 4, seed=8).batch(0), batches[0])
    assert batches[0].shape == (4, SEQ_LEN + 1) and batches[0].dtype == np.int32
    cache = TokenCache(caches["a"])
    _, windows = loader.indices(5)
    for row, window in zip(batches[1], windows, strict=True):
        assert np.array_equal(row, cache.window(int(window), SEQ_LEN))


def test_one_source_visits_every_train_window_once_per_epoch(caches):
    cache = TokenCache(caches["a"])
    assert len(cache.shards) > 1  # windows that cross a shard boundary are read too
    train, _ = split_windows(cache, SEQ_LEN, 0.1)
    n = len(train)
    loader = MixtureLoader([(train, 1.0)], batch_size=7, seed=0)
    steps = -(-2 * n // 7)
    visited = np.concatenate([loader.indices(step)[1] for step in range(steps)])
    first, second = visited[:n], visited[n : 2 * n]
    assert sorted(first.tolist()) == list(range(train.start, train.stop))
    assert sorted(second.tolist()) == list(range(train.start, train.stop))
    assert first.tolist() != second.tolist()  # each epoch a fresh order
    assert first.tolist() != sorted(first.tolist())
    everything = np.concatenate([np.asarray(t) for t in cache.tokens])
    rows = np.concatenate([loader.batch(step) for step in range(steps)])
    for row, window in zip(rows[:: max(1, n // 50)], visited[:: max(1, n // 50)], strict=True):
        start = int(window) * SEQ_LEN
        assert np.array_equal(row, everything[start : start + SEQ_LEN + 1])


def test_a_mixture_follows_its_weights_deterministically(caches):
    a, _ = split_windows(caches["a"], SEQ_LEN, 0.1)
    b, _ = split_windows(caches["b"], SEQ_LEN, 0.1)
    loader = MixtureLoader([(a, 3.0), (b, 1.0)], batch_size=32, seed=3)
    plans = [loader.indices(step) for step in range(128)]
    sources = np.concatenate([source for source, _ in plans])
    windows = np.concatenate([window for _, window in plans])
    assert abs(np.mean(sources == 0) - 0.75) < 0.03
    fresh = MixtureLoader([(a, 0.75), (b, 0.25)], batch_size=32, seed=3)
    for step in (0, 77, 127):
        source, window = fresh.indices(step)
        assert np.array_equal(source, plans[step][0]) and np.array_equal(window, plans[step][1])
    for index, window_range in enumerate((a, b)):
        picked = windows[sources == index]
        assert ((picked >= window_range.start) & (picked < window_range.stop)).all()
        epoch = picked[: len(window_range)]  # no window twice before all were visited
        assert len(np.unique(epoch)) == len(epoch)
    assert len(picked) > len(b)  # source b went past its first epoch here
    batch = loader.batch(9)
    source, window = loader.indices(9)
    row = int(np.flatnonzero(source == 1)[0])
    assert np.array_equal(batch[row], TokenCache(caches["b"]).window(int(window[row]), SEQ_LEN))


@pytest.mark.parametrize("position", [(0, 0), (37, 1000)])
def test_steps_served_from_a_worked_out_block_equal_each_step_alone(caches, position):
    """indices works out a block of steps at once: any step, in any order and on either side of
    a block's edge or of a resumed loader's first step, gets what its own sequences address."""
    a, _ = split_windows(caches["a"], SEQ_LEN, 0.1)
    b, _ = split_windows(caches["b"], SEQ_LEN, 0.1)
    loader = MixtureLoader([(a, 3.0), (b, 1.0)], batch_size=24, seed=5, position=position)
    first_step, first_sequence = position
    block = loader._steps_per_block
    steps = [first_step + s for s in (0, block - 1, block, 3 * block + 2, 1, 2 * block)]
    for step in steps:
        g = first_sequence + (step - first_step) * 24 + np.arange(24, dtype=np.int64)
        alone = loader._sequence_indices(g)
        served = loader.indices(step)
        assert np.array_equal(served[0], alone[0]) and np.array_equal(served[1], alone[1])
        served[1][:] = -1  # the caller's copy: the loader's block is untouched
        assert np.array_equal(loader.indices(step)[1], alone[1])


def test_split_and_eval_batches(caches):
    cache = TokenCache(caches["a"])
    n = cache.num_windows(SEQ_LEN)
    train, held_out = split_windows(cache, SEQ_LEN, 0.1)
    assert (train.start, train.stop, held_out.stop) == (0, held_out.start, n)
    assert len(held_out) == -(-n // 10) and len(train) + len(held_out) == n
    assert len(split_windows(cache, SEQ_LEN, 1e-9)[1]) == 1
    no_eval = split_windows(cache, SEQ_LEN, 0.0)[1]
    assert len(no_eval) == 0 and list(eval_batches(no_eval, batch_size=5)) == []
    batches = list(eval_batches(held_out, batch_size=5))
    assert [len(b) for b in batches[:-1]] == [5] * (len(batches) - 1) and 0 < len(batches[-1]) <= 5
    expected = [cache.window(i, SEQ_LEN) for i in range(held_out.start, held_out.stop)]
    assert np.array_equal(np.concatenate(batches), np.stack(expected))
    assert len(list(eval_batches(held_out, batch_size=5, max_batches=2))) == 2
    with pytest.raises(ConfigError, match=rf"{cache.total_tokens} tokens.*need"):
        split_windows(cache, cache.total_tokens, 0.1)


def test_mistakes_are_caught_before_training(caches, tmp_path):
    a, _ = split_windows(caches["a"], SEQ_LEN, 0.1)
    other, _ = split_windows(caches["other"], SEQ_LEN, 0.1)
    with pytest.raises(ConfigError, match=r"different vocabularies") as error:
        MixtureLoader([(a, 1.0), (other, 1.0)], batch_size=2, seed=0)
    assert caches["a"] in str(error.value) and caches["other"] in str(error.value)
    shorter = WindowRange(caches["b"], SEQ_LEN // 2, 0, 10)
    with pytest.raises(ConfigError, match="seq_len"):
        MixtureLoader([(a, 1.0), (shorter, 1.0)], batch_size=2, seed=0)
    with pytest.raises(ConfigError, match="weight"):
        MixtureLoader([(a, 0.0)], batch_size=2, seed=0)
    with pytest.raises(ConfigError, match="out of range"):
        MixtureLoader([(WindowRange(caches["a"], SEQ_LEN, 0, 10**9), 1.0)], 2, seed=0)
    with pytest.raises(UsageError, match="does not exist") as error:
        check_cache(str(tmp_path / "missing"), 400)
    assert not isinstance(error.value, ConfigError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="not a token cache"):
        check_cache(str(tmp_path / "empty"), 400)
    vocab = TokenCache(caches["a"]).manifest.vocab_size
    assert check_cache(caches["a"], vocab).manifest.vocab_size == vocab
    with pytest.raises(ConfigError, match=rf"vocabulary of {vocab} ids, the model has 512"):
        check_cache(caches["a"], 512)


def test_token_byte_lengths_count_utf8_bytes(caches):
    cache = TokenCache(caches["a"])
    vocab = cache.manifest.vocab_size
    lengths = token_byte_lengths(cache.tokenizer_path(), vocab + 3)  # a padded model vocabulary
    assert lengths.shape == (vocab + 3,) and lengths.dtype == np.int32
    assert lengths[cache.eos_id] == 0 and (lengths[vocab:] == 0).all()
    assert set(byte_level_alphabet()) == set(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer.from_file(cache.tokenizer_path())
    tokenizer.encode_special_tokens = True  # as the caches encode: "<|endoftext|>" is text
    checked = 0
    for ids in cache.documents():
        text = tokenizer.decode(ids.tolist())
        if tokenizer.encode(text, add_special_tokens=False).ids == ids.tolist():
            assert int(lengths[ids].sum()) == len(text.encode())
            checked += 1
    assert checked > 100
    for text in ("café naïve 日本", "🙂 the sea", "\x00tab\there <|endoftext|>"):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert int(lengths[ids].sum()) == len(text.encode())
    assert any(lengths[i] >= 2 for i in range(256, vocab))  # merged tokens are multi-byte
    with pytest.raises(UsageError, match=r"model\.vocab_size"):
        token_byte_lengths(cache.tokenizer_path(), vocab - 1)
