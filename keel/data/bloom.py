"""A Bloom filter over 128-bit item hashes, added and queried as numpy arrays.

An item is given by its 128-bit hash (xxh3-128, say), as a row of two uint64 halves (h1, h2): an
array of shape [n, 2]. Its k bit positions come from double hashing (Kirsch and Mitzenmacher,
"Less hashing, same performance", 2006):

    position_i = (h1 mod m + i * (1 + h2 mod (m - 1))) mod m,   i = 0 .. k-1

so one hash per item gives all k positions. The step is never 0, so the k positions of an item
never all coincide.

Sizing, for n expected items and a false-positive rate p:

    m = ceil(-n ln p / (ln 2)^2) bits (rounded up to whole bytes),   k = round(m / n * ln 2)

and after n items the probability that an item never added reads as present is

    p = (1 - exp(-k n / m)) ^ k

(`expected_false_positive_rate`). For p = 1e-6 that is 28.8 bits (3.6 bytes) and k = 20 per item.

The bits live in one numpy uint8 array (bit j is bit j % 8 of byte j // 8). Queries probe the k
positions one at a time and keep probing only the items still possibly present, so an item that
was never added costs about two probes on average, not k. Pickling stores the parameters and the
raw bytes of the bit array, so the filter ships cheaply to worker processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import xxhash

MAX_BITS = 1 << 48
"""Bit positions stay far below 2**64 in the double-hashing arithmetic (k < 64)."""


class BloomFilter:
    """A set of items that answers "maybe present" or "certainly absent".

    `add(hashes)` and `query(hashes)` take uint64 arrays of shape [n, 2], the two 64-bit halves of
    each item's 128-bit hash (see `hash128`). False positives happen at about
    `expected_false_positive_rate()`; false negatives never.
    """

    def __init__(self, num_bits: int, num_hashes: int, bits: np.ndarray | None = None) -> None:
        if not 8 <= num_bits <= MAX_BITS or num_bits % 8:
            raise ValueError(f"num_bits must be a multiple of 8 in [8, 2**48], got {num_bits}")
        if not 1 <= num_hashes < 64:
            raise ValueError(f"num_hashes must be in [1, 63], got {num_hashes}")
        self.num_bits = num_bits
        self.num_hashes = num_hashes
        if bits is None:
            bits = np.zeros(num_bits // 8, dtype=np.uint8)
        if bits.dtype != np.uint8 or bits.shape != (num_bits // 8,):
            raise ValueError(f"bits must be a uint8 array of {num_bits // 8} bytes")
        self.bits = bits
        self.count = 0
        """Items added (each row of each `add` call, repeats included)."""

    @classmethod
    def for_capacity(cls, expected_items: int, false_positive_rate: float) -> BloomFilter:
        """The smallest filter that holds `expected_items` at `false_positive_rate` (module doc)."""
        if not 0.0 < false_positive_rate < 1.0:
            raise ValueError(f"false_positive_rate must be in (0, 1), got {false_positive_rate}")
        items = max(1, expected_items)
        bits = math.ceil(-items * math.log(false_positive_rate) / math.log(2) ** 2)
        bits = max(64, -(-bits // 8) * 8)
        hashes = max(1, round(bits / items * math.log(2)))
        return cls(bits, min(hashes, 63))

    def add(self, hashes: np.ndarray) -> None:
        """Add items given as a uint64 array [n, 2] of 128-bit hashes."""
        start, step = self._start_step(hashes)
        for i in range(self.num_hashes):
            positions = (start + np.uint64(i) * step) % np.uint64(self.num_bits)
            np.bitwise_or.at(self.bits, positions >> np.uint64(3), _bit(positions))
        self.count += len(start)

    def query(self, hashes: np.ndarray) -> np.ndarray:
        """A bool array [n]: True where the item may have been added, False where it was not."""
        start, step = self._start_step(hashes)
        alive = np.arange(len(start))
        for i in range(self.num_hashes):
            if not len(alive):
                break
            positions = (start + np.uint64(i) * step) % np.uint64(self.num_bits)
            present = (self.bits[positions >> np.uint64(3)] & _bit(positions)) != 0
            alive, start, step = alive[present], start[present], step[present]
        found = np.zeros(len(hashes), dtype=bool)
        found[alive] = True
        return found

    def expected_false_positive_rate(self) -> float:
        """(1 - exp(-k n / m)) ^ k for the n = `count` items added so far."""
        k, m = self.num_hashes, self.num_bits
        return (1.0 - math.exp(-k * self.count / m)) ** k

    def fill_ratio(self) -> float:
        """The fraction of bits set (about 0.5 when the filter is at its capacity)."""
        return int(np.unpackbits(self.bits).sum()) / self.num_bits

    def __reduce__(self) -> tuple:
        """Pickle as (parameters, raw bit bytes): about num_bits / 8 bytes."""
        return (_restore, (self.num_bits, self.num_hashes, self.count, self.bits.tobytes()))

    def __repr__(self) -> str:
        return (
            f"BloomFilter(num_bits={self.num_bits}, num_hashes={self.num_hashes}, "
            f"count={self.count})"
        )

    def _start_step(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hashes = np.asarray(hashes)
        if hashes.dtype != np.uint64 or hashes.ndim != 2 or hashes.shape[1] != 2:
            raise ValueError(
                f"hashes must be a uint64 array [n, 2], got {hashes.dtype} {hashes.shape}"
            )
        start = hashes[:, 0] % np.uint64(self.num_bits)
        step = np.uint64(1) + hashes[:, 1] % np.uint64(self.num_bits - 1)
        return start, step


def hash128(items: Iterable[bytes]) -> np.ndarray:
    """One xxh3-128 per item, as a uint64 array [n, 2] (the digest's two 64-bit halves)."""
    digests = b"".join(xxhash.xxh3_128_digest(item) for item in items)
    return np.frombuffer(digests, dtype=">u8").astype(np.uint64).reshape(-1, 2)


def _bit(positions: np.ndarray) -> np.ndarray:
    return np.left_shift(np.uint8(1), (positions & np.uint64(7)).astype(np.uint8))


def _restore(num_bits: int, num_hashes: int, count: int, raw: bytes) -> BloomFilter:
    bloom = BloomFilter(num_bits, num_hashes, np.frombuffer(raw, dtype=np.uint8).copy())
    bloom.count = count
    return bloom
