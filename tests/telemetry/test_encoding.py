"""Segments keep dictionaries only for columns whose values repeat; every value reads back the
same, nested columns included."""

from __future__ import annotations

import datetime
import io

import pyarrow as pa
import pyarrow.parquet as pq

from keel.telemetry import StoreOptions, TelemetryStore
from keel.telemetry.encoding import choose_encodings, leaf_paths

ROWS = 4_000


def log_table() -> pa.Table:
    start = datetime.datetime(2024, 5, 1)
    return pa.table(
        {
            "ts": pa.array([start + datetime.timedelta(milliseconds=i) for i in range(ROWS)]),
            "job_id": [f"job-{i % 40:03d}" for i in range(ROWS)],
            "msg": [f"step {i} loss {i * 0.37:.3f} id {i * 7919 % 100003:x}" for i in range(ROWS)],
            "n": pa.array(range(ROWS), pa.int64()),
            "tags": pa.array([{"host": f"h{i % 3}", "ids": [i, i + 1]} for i in range(ROWS)]),
            "flags": pa.array([["a", "b"][: i % 3] for i in range(ROWS)]),
        }
    )


def test_dictionaries_only_where_values_repeat_and_rows_read_back(tmp_path):
    table = log_table()
    options = StoreOptions(background=False, row_group_rows=1_000, flush_rows=10**9)
    with TelemetryStore(tmp_path, options) as store:
        store.write("app.logs", table)
        store.flush()
        back = store.query('SELECT * FROM "app.logs" ORDER BY n')
    assert back.equals(table)
    [segment] = (tmp_path / "app.logs" / "segments").glob("*.parquet")
    group = pq.ParquetFile(segment).metadata.row_group(0)
    chunks = {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}
    assert chunks["job_id"].has_dictionary_page
    assert chunks["tags.host"].has_dictionary_page
    assert not chunks["msg"].has_dictionary_page
    assert not chunks["ts"].has_dictionary_page
    assert "DELTA_BINARY_PACKED" in chunks["ts"].encodings
    assert "DELTA_BINARY_PACKED" in chunks["n"].encodings


def test_leaf_paths_are_the_ones_parquet_writes():
    table = log_table().append_column(
        "attrs", pa.array([{"k": i} for i in range(ROWS)], pa.map_(pa.string(), pa.int64()))
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    schema = pq.ParquetFile(io.BytesIO(buffer.getvalue())).metadata.schema
    written = [schema.column(i).path for i in range(len(schema))]
    assert [p for f in table.schema for p in leaf_paths(f.name, f.type)] == written


def test_an_empty_or_all_null_sample_keeps_a_dictionary():
    table = pa.table({"s": pa.array([None] * 10, pa.string()), "i": pa.array([1] * 10)})
    encodings = choose_encodings(table, 1_000)
    assert encodings.dictionary == ["s", "i"] and not encodings.column_encoding
