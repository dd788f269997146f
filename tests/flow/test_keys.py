"""Shuffle keys: integer keys hashed in numpy route exactly as the per-value hash does, and a
reducer's rows come out grouped in input order even when different keys share a hash."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from keel.flow.keys import HASH_COLUMN, ORDER_COLUMN, column_hashes, stable_hash
from keel.flow.shuffle import sort_into_runs


@pytest.mark.parametrize(
    "kind",
    [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32()],
)
def test_integer_keys_hash_as_each_value_does_nulls_included(kind):
    info = np.iinfo(kind.to_pandas_dtype())
    rng = np.random.default_rng(7)
    values = [int(v) for v in rng.integers(info.min, info.max, size=500, endpoint=True)]
    values += [info.min, info.max, 0, 1, None]
    array = pa.array(values, kind)
    expected = [stable_hash(value) for value in values]
    assert column_hashes(array).tolist() == expected
    assert column_hashes(array.slice(3, 100)).tolist() == expected[3:103]


def test_uint64_keys_beyond_int64_hash_as_each_value_does():
    values = [0, 2**63 - 1, 2**63, 2**64 - 1, None, 12345]
    array = pa.array(values, pa.uint64())
    assert column_hashes(array).tolist() == [stable_hash(value) for value in values]


def test_an_integer_key_hashes_alike_in_an_int32_and_an_int64_column():
    """Two map tasks may type one key column differently; its rows must meet in one partition."""
    values = [5, -3, 1_000_000]
    narrow = column_hashes(pa.array(values, pa.int32()))
    wide = column_hashes(pa.array(values, pa.int64()))
    assert narrow.tolist() == wide.tolist()


def _partition(keys: list, hashes: np.ndarray, order: np.ndarray) -> pa.Table:
    return pa.table(
        {
            "key": pa.array(keys, pa.int64()),
            "payload": pa.array(np.arange(len(keys))),
            HASH_COLUMN: pa.array(hashes, pa.uint64()),
            ORDER_COLUMN: pa.array(order, pa.uint64()),
        }
    )


def _by_three_keys(table: pa.Table) -> pa.Table:
    keys = [(HASH_COLUMN, "ascending"), ("key", "ascending"), (ORDER_COLUMN, "ascending")]
    return table.take(pc.sort_indices(table, sort_keys=keys))


@pytest.mark.parametrize("in_input_order", [True, False])
def test_rows_are_grouped_by_key_in_input_order(in_input_order):
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 300, size=5_000).tolist() + [None] * 20
    rng.shuffle(keys)
    order = np.arange(len(keys), dtype=np.uint64)
    table = _partition(keys, column_hashes(pa.array(keys, pa.int64())), order)
    if not in_input_order:
        table = table.take(rng.permutation(len(keys)))
    ordered, starts = sort_into_runs(table, "key")
    assert ordered.equals(_by_three_keys(table))
    assert len(starts) == len(set(keys))


def test_keys_that_share_a_hash_still_form_one_run_each():
    """A 64-bit collision, forced: every key hashes to one of 3 values, keys interleaved."""
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 40, size=2_000).tolist()
    hashes = np.array([key % 3 for key in keys], dtype=np.uint64)
    table = _partition(keys, hashes, np.arange(len(keys), dtype=np.uint64))
    ordered, starts = sort_into_runs(table, "key")
    assert ordered.equals(_by_three_keys(table))
    runs = np.split(ordered.column("key").to_numpy(), starts[1:])
    assert len(runs) == len(set(keys))
    assert all(len(set(run.tolist())) == 1 for run in runs)
    for run in np.split(ordered.column(ORDER_COLUMN).to_numpy(), starts[1:]):
        assert (np.diff(run.astype(np.int64)) > 0).all()  # each key's rows in input order
