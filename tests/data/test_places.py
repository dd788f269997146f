"""PlaceTable: rows keyed by place, written once per input shard and read by the tasks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from keel.data import documents
from keel.data.dedup import run_exact_dedup
from keel.data.fuzzy import FuzzyDedupConfig, run_fuzzy_dedup
from keel.data.inputs import POSITION_COLUMN
from keel.data.places import PlaceTable
from keel.flow import RunOptions
from keel.flow.keys import ROW_BITS


def place(shard: int, row: int) -> int:
    return (shard << ROW_BITS) | row


def test_rows_at_finds_a_batchs_places_in_its_shards_file_only(tmp_path):
    places = [place(0, 3), place(0, 9), place(2, 0), place(2, 5), place(2, 6)]
    table = pa.table(
        {
            POSITION_COLUMN: pa.array(places, pa.uint64()),
            "label": ["a", "b", "c", "d", "e"],
        }
    )
    written = PlaceTable.write(str(tmp_path), table)
    files = sorted(path.name for path in (tmp_path / written.directory.rsplit("/", 1)[1]).iterdir())
    assert files == ["schema.arrow", "shard-000000.arrow", "shard-000002.arrow"]

    batch = np.array([place(2, 6), place(2, 1), place(2, 0)], dtype=np.uint64)
    rows, found = written.rows_at(batch)
    assert found.tolist() == [True, False, True]
    assert rows.column("label").to_pylist() == ["e", "c"]  # in the batch's order

    # a shard with no rows has no file: nothing found, the schema's columns
    rows, found = written.rows_at(np.array([place(1, 3)], dtype=np.uint64))
    assert not found.any() and rows.num_rows == 0 and rows.column_names == table.column_names

    # places of two shards in one batch (not what a source task gives, but handled)
    mixed = np.array([place(2, 5), place(0, 3), place(0, 4)], dtype=np.uint64)
    rows, found = written.rows_at(mixed)
    assert found.tolist() == [True, True, False]
    assert rows.column("label").to_pylist() == ["d", "a"]
    assert written.has(mixed).tolist() == [True, True, False]


def test_each_write_gets_a_directory_of_its_own(tmp_path):
    """Workers cache a shard's rows by directory: a second table under the same parent must not
    be read as the first."""
    first = PlaceTable.of_places(str(tmp_path), np.array([place(0, 1)], dtype=np.uint64))
    second = PlaceTable.of_places(str(tmp_path), np.array([place(0, 2)], dtype=np.uint64))
    assert first.directory != second.directory
    probe = np.array([place(0, 1), place(0, 2)], dtype=np.uint64)
    assert first.has(probe).tolist() == [True, False]
    assert second.has(probe).tolist() == [False, True]


def test_dedup_stages_leave_no_place_tables_in_their_output(tmp_path):
    texts = ["the same seven words come here again"] * 3 + [
        f"document number {n} has words of its own {n * 7} {n * 13}" for n in range(6)
    ]
    source = documents.write_texts(tmp_path / "docs", texts, parts=2)
    options = RunOptions(workers=2)
    exact = run_exact_dedup(source, str(tmp_path / "exact"), options=options)
    fuzzy = run_fuzzy_dedup(
        source, str(tmp_path / "fuzzy"), FuzzyDedupConfig(max_source_drop=1.0), options
    )
    assert exact.dropped == {"exact_duplicate": 2} and fuzzy.documents_out == 7
    for output in ("exact", "fuzzy"):
        names = [path.name for path in (tmp_path / output).iterdir()]
        assert not [name for name in names if name.startswith("_places")], names
