"""The token cache: a tokenized document set as flat binary shards that numpy memory-maps.

A token cache is a directory holding
    manifest.json      written last: the cache exists once it does (see Manifest)
    tokenizer.json     the tokenizer that produced the ids, byte for byte
    shard-00000.bin    little-endian token ids (uint16 when the vocabulary has <= 65,536 ids,
                       else uint32), one document after another, each FOLLOWED by the EOS id:
                       `doc0 EOS doc1 EOS ... docN EOS`. A shard holds whole documents.
Windows for training are read over the concatenation of all shards (they may cross a shard
boundary): window i is tokens [i * seq_len, i * seq_len + seq_len + 1), inputs and shifted
targets in one array, so consecutive windows share one token and none is wasted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import numpy as np

from keel.core import paths
from keel.core.errors import KeelError, UsageError

FORMAT = "keel-token-cache/1"
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
VERIFY_BLOCK_BYTES = 16 * 1024 * 1024
UINT16_MAX_VOCAB = 65_536
"""A vocabulary of at most this many ids is stored as uint16, a larger one as uint32."""


class CorruptCacheError(KeelError):
    """A shard does not match the manifest (size, checksum or document count)."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype that holds every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= UINT16_MAX_VOCAB else np.dtype("<u4")


@dataclass(frozen=True)
class ShardInfo:
    file: str
    """Name relative to the cache directory: shard-00000.bin."""
    tokens: int
    documents: int
    bytes: int
    sha256: str
    """Hex SHA-256 of the shard's bytes."""


@dataclass(frozen=True)
class Manifest:
    """manifest.json: what the shards hold and how to check them."""

    tokenizer_sha256: str
    """Hex SHA-256 of tokenizer.json's bytes: the tokenizer's identity."""
    vocab_size: int
    """Ids in the vocabulary, added tokens included; every id is below it."""
    dtype: str
    """"uint16" or "uint32", little-endian."""
    eos_id: int
    eos_token: str
    total_tokens: int
    """All ids in all shards, EOS ids included."""
    documents: int
    shards: tuple[ShardInfo, ...] = ()
    format: str = FORMAT
    details: dict[str, Any] = field(default_factory=dict)
    """What made the cache (tokenizer trained or loaded, its settings); not checked."""

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype).newbyteorder("<")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise UsageError(f"manifest format {data.get('format')!r} is not {FORMAT!r}")
        data["shards"] = tuple(ShardInfo(**shard) for shard in data["shards"])
        return cls(**data)


class ShardWriter:
    """Appends documents' tokens to shard-NNNNN.bin files under `directory`, starting a new shard
    at the first document end at or past `shard_bytes`, so shards hold whole documents and their
    layout depends only on the token stream, never on how it was chunked."""

    def __init__(self, directory: str, dtype: np.dtype, eos_id: int, shard_bytes: int) -> None:
        if shard_bytes < 1:
            raise UsageError(f"shard_bytes must be at least 1, got {shard_bytes}")
        self.directory = directory
        self.dtype = np.dtype(dtype)
        self.eos_id = eos_id
        self.shard_bytes = shard_bytes
        self.shards: list[ShardInfo] = []
        self._handle: IO[bytes] | None = None
        self._hash = hashlib.sha256()
        self._tokens = 0
        self._documents = 0

    def append(self, tokens: np.ndarray, ends: np.ndarray) -> None:
        """Append documents: `tokens` [n] ids, each document ending with EOS; `ends` [documents]
        the exclusive end index of each document in `tokens` (ascending, last == n)."""
        tokens = np.asarray(tokens, dtype=self.dtype)
        ends = np.asarray(ends, dtype=np.int64)
        if len(ends) == 0:
            return
        if ends[-1] != len(tokens) or np.any(tokens[ends - 1] != self.eos_id):
            raise ValueError("every document must end with the EOS id, and ends[-1] == len(tokens)")
        start, first = 0, 0
        while first < len(ends):
            room = max(1, -(-self.shard_bytes // self.dtype.itemsize) - self._tokens)
            # the first document whose end reaches the room left closes the shard
            last = int(np.searchsorted(ends[first:] - start, room, side="left")) + first
            closes = last < len(ends)
            last = min(last, len(ends) - 1)
            self._write(tokens[start : ends[last]], last - first + 1)
            if closes:
                self._close_shard()
            start, first = int(ends[last]), last + 1

    def close(self) -> list[ShardInfo]:
        """Finish the open shard; the shards written, in order."""
        if self._handle is not None:
            self._close_shard()
        return self.shards

    def _write(self, tokens: np.ndarray, documents: int) -> None:
        if self._handle is None:
            path = paths.join(self.directory, shard_name(len(self.shards)))
            self._handle = paths.open_file(path, "wb")
        data = tokens.tobytes()
        self._handle.write(data)
        self._hash.update(data)
        self._tokens += len(tokens)
        self._documents += documents

    def _close_shard(self) -> None:
        self._handle.close()
        self._handle = None
        info = ShardInfo(
            shard_name(len(self.shards)),
            self._tokens,
            self._documents,
            self._tokens * self.dtype.itemsize,
            self._hash.hexdigest(),
        )
        self.shards.append(info)
        self._hash, self._tokens, self._documents = hashlib.sha256(), 0, 0


def write_manifest(directory: str, manifest: Manifest) -> None:
    """Write manifest.json (atomically): the last file of a cache."""
    paths.write_text(paths.join(directory, MANIFEST_FILE), manifest.to_json())


class TokenCache:
    """A token cache on local disk: its manifest, each shard as a read-only memmap, and windows
    of `seq_len + 1` tokens addressed by index over the concatenation of the shards."""

    def __init__(self, path: str) -> None:
        if not paths.is_local(path):
            raise UsageError(f"TokenCache reads local directories (memmap); copy {path} locally")
        self.path = paths.normalize(path)
        manifest_path = paths.join(self.path, MANIFEST_FILE)
        if not paths.exists(manifest_path):
            raise UsageError(
                f"{self.path} is not a token cache: it has no {MANIFEST_FILE} "
                "(not written by run_tokenize, or the run did not finish); run it again"
            )
        self.manifest = Manifest.from_json(paths.read_text(manifest_path))
        dtype = self.manifest.numpy_dtype
        self.tokens: list[np.ndarray] = [
            _map_shard(self._shard_path(s), s, dtype) for s in self.shards
        ]
        """One read-only memmap of token ids per shard, in order."""
        counts = [shard.tokens for shard in self.manifest.shards]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    @property
    def shards(self) -> tuple[ShardInfo, ...]:
        return self.manifest.shards

    @property
    def total_tokens(self) -> int:
        return self.manifest.total_tokens

    @property
    def eos_id(self) -> int:
        return self.manifest.eos_id

    def tokenizer_path(self) -> str:
        return paths.join(self.path, TOKENIZER_FILE)

    def num_windows(self, seq_len: int) -> int:
        """Windows of `seq_len + 1` tokens that fit: (total_tokens - 1) // seq_len."""
        if seq_len < 1:
            raise UsageError(f"seq_len must be at least 1, got {seq_len}")
        return max(0, self.total_tokens - 1) // seq_len

    def window(self, index: int, seq_len: int) -> np.ndarray:
        """Tokens [index * seq_len, index * seq_len + seq_len + 1) of the concatenated shards:
        [seq_len + 1] ids, inputs `w[:-1]` and targets `w[1:]`. A copy, safe to keep."""
        count = self.num_windows(seq_len)
        if not 0 <= index < count:
            raise IndexError(f"window {index} out of range: {count} windows of {seq_len} tokens")
        return self.slice(index * seq_len, index * seq_len + seq_len + 1)

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated shards, as one array (a copy)."""
        if not 0 <= start <= stop <= self.total_tokens:
            raise IndexError(f"tokens [{start}, {stop}) out of range: {self.total_tokens} tokens")
        pieces = []
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            offset = start - int(self._starts[shard])
            take = min(stop - start, len(self.tokens[shard]) - offset)
            pieces.append(self.tokens[shard][offset : offset + take])
            start += take
            shard += 1
        return np.concatenate(pieces) if pieces else np.empty(0, self.manifest.numpy_dtype)

    def documents(self) -> Iterator[np.ndarray]:
        """Each document's ids, without its EOS, in order (documents never cross shards)."""
        for shard in self.tokens:
            ends = np.flatnonzero(shard == self.eos_id)
            start = 0
            for end in ends.tolist():
                yield np.asarray(shard[start:end])
                start = end + 1

    def verify(self) -> None:
        """Check every shard against the manifest: size, SHA-256, and one EOS per document (one
        sequential read of each shard).
        Raises CorruptCacheError naming the first shard that does not match."""
        manifest, dtype = self.manifest, self.manifest.numpy_dtype
        tokens, documents = (
            sum(s.tokens for s in self.shards),
            sum(s.documents for s in self.shards),
        )
        if (tokens, documents) != (manifest.total_tokens, manifest.documents):
            raise CorruptCacheError(
                f"{self.path}/{MANIFEST_FILE}: its shards hold {tokens} tokens and {documents} "
                f"documents, its totals say {manifest.total_tokens} and {manifest.documents}"
            )
        for shard in self.shards:
            path = self._shard_path(shard)
            size = _file_size(path)
            if size != shard.bytes or shard.bytes != shard.tokens * dtype.itemsize:
                raise CorruptCacheError(
                    f"{path}: {size} bytes, manifest says {shard.bytes} ({shard.tokens} tokens "
                    f"of {dtype.name}); the shard is truncated or replaced: rebuild the cache"
                )
            digest, documents = hashlib.sha256(), 0
            with paths.open_file(path, "rb") as handle:
                while block := handle.read(VERIFY_BLOCK_BYTES):
                    digest.update(block)
                    documents += int(np.count_nonzero(np.frombuffer(block, dtype) == self.eos_id))
            if digest.hexdigest() != shard.sha256:
                raise CorruptCacheError(
                    f"{path}: SHA-256 {digest.hexdigest()} does not match the manifest's "
                    f"{shard.sha256}; the shard is corrupt: rebuild the cache"
                )
            if documents != shard.documents:
                raise CorruptCacheError(
                    f"{path}: {documents} EOS ids, manifest says {shard.documents} documents: "
                    "rebuild the cache"
                )

    def _shard_path(self, shard: ShardInfo) -> str:
        return paths.join(self.path, shard.file)


def _map_shard(path: str, shard: ShardInfo, dtype: np.dtype) -> np.ndarray:
    size = _file_size(path)
    if size != shard.tokens * dtype.itemsize:
        raise CorruptCacheError(
            f"{path}: {size} bytes, manifest says {shard.tokens} tokens of {dtype.name}; "
            "the shard is truncated or replaced: rebuild the cache"
        )
    if shard.tokens == 0:
        return np.empty(0, dtype)  # numpy cannot map an empty file
    return np.memmap(paths.local_path(path), dtype=dtype, mode="r", shape=(shard.tokens,))


def _file_size(path: str) -> int:
    try:
        return paths.local_path(path).stat().st_size
    except FileNotFoundError as error:
        raise CorruptCacheError(
            f"{path}: listed in the manifest but missing: rebuild the cache"
        ) from error
