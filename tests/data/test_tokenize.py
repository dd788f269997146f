"""Tokenization into a token cache: round trips, determinism, tokenizer loading, corruption."""

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from keel.core.errors import UsageError
from keel.data.documents import StageReport, document_id
from keel.data.token_cache import (
    CorruptCacheError,
    ShardWriter,
    TokenCache,
    dtype_for_vocab,
)
from keel.data.tokenize import TokenizeConfig, run_tokenize, train_tokenizer
from keel.flow import RunOptions

WORDS = ["the", "of", "lobster", "sea", "claws", "Atlantic", "1996", ",", ".", "(", ")"]
WORDS += ["café", "naïve", "東京", "Ünïcödé", "🙂", "\t"]
CONFIG = TokenizeConfig(vocab_size=600, shard_bytes=4_000)
ONE = RunOptions(workers=1)


def make_documents(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = [
        "\n".join(
            " ".join(rng.choices(WORDS, k=rng.randint(5, 40))) for _ in range(rng.randint(1, 4))
        )
        for _ in range(count)
    ]
    docs[3] = "a literal <|endoftext|> inside a document stays text"
    docs[5] = ""
    return docs


def write_documents(directory: Path, docs: list[str], parts: int = 2) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    size = -(-len(docs) // parts) if docs else 0
    for part in range(parts):
        chunk = docs[part * size : (part + 1) * size]
        table = pa.table(
            {
                "id": pa.array([document_id(t) for t in chunk], pa.string()),
                "text": pa.array(chunk, pa.string()),
                "source": pa.array(["test"] * len(chunk), pa.string()),
            }
        )
        pq.write_table(table, directory / f"part-{part:05d}-of-{parts:05d}.parquet")
    return str(directory)


def files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_documents(300)


@pytest.fixture(scope="module")
def built(tmp_path_factory, docs):
    """A document set and its cache, written with 2 workers."""
    root = tmp_path_factory.mktemp("tokenize")
    source = write_documents(root / "docs", docs)
    report = run_tokenize(source, str(root / "cache"), CONFIG, options=RunOptions(workers=2))
    return root, report


def test_cache_decodes_to_the_documents_in_order(built, docs):
    root, report = built
    cache = TokenCache(str(root / "cache"))
    tokenizer = Tokenizer.from_file(cache.tokenizer_path())
    decoded = [tokenizer.decode(ids.tolist()) for ids in cache.documents()]
    assert decoded == docs
    assert len(cache.shards) > 1  # small shard_bytes: several shards, each whole documents
    manifest = cache.manifest
    assert manifest.documents == len(docs) == report.documents_out
    assert manifest.total_tokens == sum(len(t) for t in cache.tokens) == report.details["tokens"]
    assert manifest.eos_id == tokenizer.token_to_id("<|endoftext|>")
    assert manifest.dtype == "uint16" and cache.tokens[0].dtype == np.dtype("<u2")
    for shard, tokens in zip(cache.shards, cache.tokens, strict=True):
        assert tokens[-1] == manifest.eos_id  # EOS after each document, the last one included
        assert shard.documents == int(np.count_nonzero(tokens == manifest.eos_id))
    tokenizer_bytes = (root / "cache" / "tokenizer.json").read_bytes()
    assert manifest.tokenizer_sha256 == hashlib.sha256(tokenizer_bytes).hexdigest()
    assert StageReport.read(str(root / "cache")).documents_in == len(docs)
    cache.verify()


def test_windows_are_consecutive_slices_across_shard_boundaries(built):
    cache = TokenCache(str(built[0] / "cache"))
    everything = np.concatenate(cache.tokens)
    seq_len = 50
    count = cache.num_windows(seq_len)
    assert count == (len(everything) - 1) // seq_len
    for index in (0, 1, count // 2, count - 1):
        window = cache.window(index, seq_len)
        assert window.shape == (seq_len + 1,)
        assert np.array_equal(window, everything[index * seq_len : index * seq_len + seq_len + 1])
    boundary = cache.shards[0].tokens  # a window that starts in shard 0 and ends in shard 1
    index = (boundary - 1) // seq_len
    assert np.array_equal(
        cache.window(index, seq_len), everything[index * seq_len :][: seq_len + 1]
    )
    with pytest.raises(IndexError):
        cache.window(count, seq_len)


def test_verify_names_a_shard_with_a_flipped_byte(built, tmp_path):
    copy = tmp_path / "cache"
    copy.mkdir()
    for name, data in files(built[0] / "cache").items():
        (copy / name).write_bytes(data)
    shard = copy / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[7] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCacheError, match=r"shard-00001\.bin.*SHA-256"):
        TokenCache(str(copy)).verify()
    shard.write_bytes(bytes(data[:-2]))  # a truncated shard fails when the cache is opened
    with pytest.raises(CorruptCacheError, match=r"shard-00001\.bin"):
        TokenCache(str(copy))


def test_one_and_two_workers_write_identical_caches(built, tmp_path):
    source = str(built[0] / "docs")
    run_tokenize(source, str(tmp_path / "one"), CONFIG, options=ONE)
    one = files(tmp_path / "one")
    assert one == files(built[0] / "cache")
    assert {"manifest.json", "tokenizer.json", "stage.json", "shard-00000.bin"} <= set(one)
    assert not [name for name in one if name.endswith(".parquet")]
    assert json.loads(one["_SUCCESS"]) == {"records": ["stage.json"]}  # the commit marker


def test_training_is_deterministic(docs):
    def train() -> str:
        batches = iter([docs[:100], docs[100:]])
        return train_tokenizer(batches, 500, ("<|endoftext|>", "<|pad|>")).to_str()

    first = train()
    assert first == train()
    vocab = json.loads(first)["model"]["vocab"]
    assert vocab["<|endoftext|>"] == 0 and vocab["<|pad|>"] == 1
    with pytest.raises(UsageError, match="vocab_size"):
        train_tokenizer(iter([docs]), 100)


def test_a_tokenizer_loaded_by_path_is_used_and_copied_byte_for_byte(built, tmp_path, docs):
    trained = Tokenizer.from_str(
        train_tokenizer(iter([docs]), 800, ("<|endoftext|>", "<|pad|>")).to_str()
    )
    path = tmp_path / "my-tokenizer.json"
    trained.save(str(path), pretty=True)
    config = TokenizeConfig(tokenizer_path=str(path), shard_bytes=1 << 20)
    run_tokenize(str(built[0] / "docs"), str(tmp_path / "cache"), config, options=ONE)
    cache = TokenCache(str(tmp_path / "cache"))
    assert (tmp_path / "cache" / "tokenizer.json").read_bytes() == path.read_bytes()
    assert cache.manifest.tokenizer_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert cache.manifest.vocab_size == trained.get_vocab_size()
    first = next(cache.documents())
    assert first.tolist() == trained.encode(docs[0], add_special_tokens=False).ids


def test_missing_tokenizer_or_eos_is_a_usage_error(built, tmp_path):
    source = str(built[0] / "docs")
    missing = TokenizeConfig(tokenizer_path=str(tmp_path / "nope.json"))
    with pytest.raises(UsageError, match=r"nope\.json does not exist"):
        run_tokenize(source, str(tmp_path / "out"), missing, options=ONE)
    no_eos = TokenizeConfig(
        tokenizer_path=str(built[0] / "cache" / "tokenizer.json"), eos_token="</s>"
    )
    with pytest.raises(UsageError, match="'</s>'"):
        run_tokenize(source, str(tmp_path / "out"), no_eos, options=ONE)
    assert not (tmp_path / "out").exists()


def test_empty_input_is_a_usage_error_and_writes_nothing(tmp_path):
    source = write_documents(tmp_path / "docs", [], parts=1)
    with pytest.raises(UsageError, match="no documents"):
        run_tokenize(source, str(tmp_path / "cache"), CONFIG, options=ONE)
    assert not (tmp_path / "cache").exists()


def test_shards_do_not_depend_on_how_documents_were_appended(tmp_path):
    eos = 0
    documents = [np.array([5] * n + [eos], np.uint16) for n in (3, 10, 1, 7, 0, 4)]
    tokens = np.concatenate(documents)
    ends = np.cumsum([len(d) for d in documents])
    writer = ShardWriter(str(tmp_path / "whole"), np.dtype("<u2"), eos, shard_bytes=16)
    writer.append(tokens, ends)
    whole = writer.close()
    writer = ShardWriter(str(tmp_path / "pieces"), np.dtype("<u2"), eos, shard_bytes=16)
    for document in documents:
        writer.append(document, [len(document)])
    assert writer.close() == whole
    assert files(tmp_path / "whole") == files(tmp_path / "pieces")
    # a shard ends at the first document end at or past 16 bytes (8 tokens)
    assert [shard.tokens for shard in whole] == [15, 10, 6]
    assert [shard.documents for shard in whole] == [2, 2, 2]


def test_dtype_follows_the_vocabulary_size():
    assert dtype_for_vocab(65_536) == np.dtype("<u2")
    assert dtype_for_vocab(65_537) == np.dtype("<u4")
