"""keel.flow.readers: JSONL and Parquet files as record batches, bad input reported exactly."""

import gzip
import pickle
import uuid
import zlib
from pathlib import Path

import fsspec
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import zstandard

from keel.flow.readers import (
    SAMPLE_LIMIT,
    MalformedInputError,
    SkipLog,
    parquet_schema,
    read_jsonl,
    read_parquet,
)


def rows_of(count: int, start: int = 0) -> list[dict]:
    return [{"id": i, "name": f"row-{i}", "score": i / 4} for i in range(start, start + count)]


def jsonl_bytes(rows: list[dict]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def compress(name: str, data: bytes) -> bytes:
    if name.endswith(".gz"):
        return gzip.compress(data)
    if name.endswith((".zst", ".zstd")):
        return zstandard.ZstdCompressor().compress(data)
    return data


def write(tmp_path: Path, name: str, data: bytes) -> str:
    """Write `data` (uncompressed JSONL text) compressed as the suffix of `name` says."""
    path = tmp_path / name
    path.write_bytes(compress(name, data))
    return str(path)


def read_rows(path: str, **options) -> list[dict]:
    return [row for batch in read_jsonl(path, **options) for row in batch.to_pylist()]


def strict_error(path: str) -> MalformedInputError:
    with pytest.raises(MalformedInputError) as caught:
        list(read_jsonl(path))
    return caught.value


# --- JSONL: good input ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["plain.jsonl", "zipped.jsonl.gz", "packed.jsonl.zst", "b.zstd"])
def test_jsonl_round_trip_in_chunks(tmp_path, name):
    rows = rows_of(10)
    batches = list(read_jsonl(write(tmp_path, name, jsonl_bytes(rows)), chunk_rows=3))
    assert [batch.num_rows for batch in batches] == [3, 3, 3, 1]
    assert [row for batch in batches for row in batch.to_pylist()] == rows


def test_blank_lines_crlf_and_missing_final_newline(tmp_path):
    data = b'\n{"a": 1}\r\n   \n\t\n{"a": 2}\n\n{"a": 3}'
    assert read_rows(write(tmp_path, "blank.jsonl", data)) == [{"a": 1}, {"a": 2}, {"a": 3}]


def test_byte_order_mark_on_first_line_is_ignored(tmp_path):
    data = b'\xef\xbb\xbf{"a": 1}\n{"a": 2}\n'
    assert read_rows(write(tmp_path, "bom.jsonl", data)) == [{"a": 1}, {"a": 2}]


def test_keys_that_appear_after_the_first_row_are_kept(tmp_path):
    data = b'{"a": 1}\n{"a": 2, "b": "x"}\n{"c": {"d": 1}}\n'
    batch = next(read_jsonl(write(tmp_path, "keys.jsonl", data)))
    assert batch.schema.names == ["a", "b", "c"]
    assert batch.to_pylist()[2] == {"a": None, "b": None, "c": {"d": 1}}


def test_type_conflict_in_a_chunk_splits_it_and_loses_nothing(tmp_path):
    rows = [{"a": 1}, {"a": 2}, {"a": "three"}, {"a": "four"}, {"a": 5}]
    batches = list(read_jsonl(write(tmp_path, "types.jsonl", jsonl_bytes(rows))))
    assert [batch.num_rows for batch in batches] == [2, 2, 1]
    assert [batch.schema.field("a").type for batch in batches] == [
        pa.int64(),
        pa.string(),
        pa.int64(),
    ]
    assert [row for batch in batches for row in batch.to_pylist()] == rows


def test_multi_frame_zstd_is_read_whole(tmp_path):
    frames = [zstandard.ZstdCompressor().compress(jsonl_bytes(rows_of(5, 5 * i))) for i in range(3)]
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(b"".join(frames))
    assert read_rows(str(path), chunk_rows=4) == rows_of(15)


def test_lines_longer_than_a_read_block(tmp_path):
    rows = [{"text": "x" * 3_000_000}, {"text": "y"}]
    assert read_rows(write(tmp_path, "long.jsonl.gz", jsonl_bytes(rows))) == rows


# --- JSONL: malformed input ----------------------------------------------------------------------

GOOD = jsonl_bytes(rows_of(2))  # lines 1-2
AFTER = jsonl_bytes(rows_of(2, start=2))  # two good lines after the bad one (line 3)


@pytest.mark.parametrize(
    ("name", "bad_line", "category", "reason"),
    [
        ("json.jsonl", b'{"id": 9,', "invalid_json", "not valid JSON: unexpected end of data"),
        ("garbage.jsonl.gz", b"hello", "invalid_json", "not valid JSON: "),
        ("array.jsonl", b"[1, 2]", "not_an_object", "expected a JSON object, found an array"),
        ("number.jsonl.zst", b"42", "not_an_object", "expected a JSON object, found a number"),
        ("utf8.jsonl", b'{"name": "ab\xffc"}', "invalid_utf8", "invalid UTF-8 at byte 13"),
        ("big.jsonl", b'{"id": 9223372036854775808}', "schema_mismatch", "record has no Arrow"),
    ],
)
def test_bad_line_strict_and_lenient(tmp_path, name, bad_line, category, reason):
    path = write(tmp_path, name, GOOD + bad_line + b"\n" + AFTER)

    error = strict_error(path)
    assert str(error).startswith(f"{path}:3: {reason}")
    assert (error.file, error.line, error.category) == (path, 3, category)
    assert error.exit_code == 1

    skipped = SkipLog()
    assert read_rows(path, lenient=True, skipped=skipped) == rows_of(4)
    assert skipped.counts == {category: 1}
    assert skipped.total == 1
    assert len(skipped.sample) == 1
    assert skipped.sample[0][:2] == (path, 3)
    assert skipped.sample[0][2].startswith(reason)


def test_invalid_utf8_wins_over_invalid_json(tmp_path):
    path = write(tmp_path, "both.jsonl", b'{"a": 1}\n\xff{oops\n')
    assert str(strict_error(path)) == f"{path}:2: invalid UTF-8 at byte 1"


def test_lenient_records_every_bad_line(tmp_path):
    data = b'{"a": 1}\nnope\n[]\n{"a": 2}\n"s"\n'
    skipped = SkipLog()
    assert read_rows(write(tmp_path, "many.jsonl", data), lenient=True, skipped=skipped) == [
        {"a": 1},
        {"a": 2},
    ]
    assert skipped.counts == {"invalid_json": 1, "not_an_object": 2}
    assert [line for _, line, _ in skipped.sample] == [2, 3, 5]


def cut_gzip(rows: list[dict]) -> tuple[bytes, int]:
    """A gzip file of `rows` cut in the middle, and the line that breaks (first incomplete one)."""
    whole = gzip.compress(jsonl_bytes(rows))
    cut = whole[: len(whole) // 2]
    readable = zlib.decompressobj(wbits=31).decompress(cut)
    return cut, readable.count(b"\n") + 1


def cut_zstd(rows: list[dict], rows_per_frame: int) -> tuple[bytes, int]:
    """A multi-frame zstd file of `rows` cut inside a frame, and the first line of that frame."""
    frames = [
        zstandard.ZstdCompressor().compress(jsonl_bytes(rows[i : i + rows_per_frame]))
        for i in range(0, len(rows), rows_per_frame)
    ]
    middle = len(frames) // 2
    cut = b"".join(frames[:middle]) + frames[middle][: len(frames[middle]) // 2]
    return cut, middle * rows_per_frame + 1


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_truncated_compressed_file(tmp_path, suffix):
    rows = [{"id": i, "text": uuid.UUID(int=i * 7919).hex * 3} for i in range(3000)]
    cut, line = cut_gzip(rows) if suffix == ".gz" else cut_zstd(rows, rows_per_frame=100)
    assert 1 < line < len(rows)
    path = tmp_path / f"cut.jsonl{suffix}"
    path.write_bytes(cut)

    error = strict_error(str(path))
    assert str(error) == f"{path}:{line}: compressed stream ends early (truncated file?)"
    assert error.category == "truncated"

    skipped = SkipLog()
    assert read_rows(str(path), lenient=True, skipped=skipped, chunk_rows=500) == rows[: line - 1]
    assert skipped.counts == {"truncated": 1}
    assert skipped.sample == [(str(path), line, "compressed stream ends early (truncated file?)")]


def test_file_with_wrong_compression_is_unreadable(tmp_path):
    path = tmp_path / "not-really.jsonl.gz"
    path.write_bytes(b'{"a": 1}\n')
    error = strict_error(str(path))
    assert str(error).startswith(f"{path}:1: corrupt compressed data: ")
    assert error.category == "unreadable"


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("zero.jsonl", b""),
        ("zero.jsonl.gz", b""),
        ("empty.jsonl.gz", gzip.compress(b"", mtime=0)),
        ("empty.jsonl.zst", zstandard.ZstdCompressor().compress(b"")),
        ("blank.jsonl", b"\n  \n"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",  # by name: ids the same everywhere
)
def test_empty_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    assert str(strict_error(str(path))) == f"{path}: empty file (no records)"

    skipped = SkipLog()
    assert list(read_jsonl(str(path), lenient=True, skipped=skipped)) == []
    assert skipped.counts == {"empty_file": 1}
    assert skipped.sample == [(str(path), None, "empty file (no records)")]


def test_file_of_only_bad_lines_is_not_called_empty(tmp_path):
    skipped = SkipLog()
    path = write(tmp_path, "bad.jsonl", b"nope\n")
    assert read_rows(path, lenient=True, skipped=skipped) == []
    assert skipped.counts == {"invalid_json": 1}


def test_arguments_are_checked_before_reading(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="SkipLog"):
        read_jsonl(missing, lenient=True)
    with pytest.raises(ValueError, match="chunk_rows"):
        read_jsonl(missing, chunk_rows=0)
    with pytest.raises(ValueError, match="SkipLog"):
        read_parquet(missing, lenient=True)
    with pytest.raises(FileNotFoundError):
        list(read_jsonl(missing))


def test_malformed_input_error_survives_pickling():
    error = MalformedInputError("data/a.jsonl", 7, "invalid UTF-8 at byte 3", "invalid_utf8")
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == "data/a.jsonl:7: invalid UTF-8 at byte 3"
    assert (copy.file, copy.line, copy.reason, copy.category) == (
        "data/a.jsonl",
        7,
        "invalid UTF-8 at byte 3",
        "invalid_utf8",
    )
    assert str(MalformedInputError("a.parquet", None, "empty file", "empty_file")) == (
        "a.parquet: empty file"
    )


# --- SkipLog -------------------------------------------------------------------------------------


def test_skip_log_merge_sums_counts_and_keeps_sample_order():
    first, second = SkipLog(), SkipLog()
    first.add("a", 1, "invalid_json", "x")
    second.add("b", 2, "invalid_json", "y")
    second.add("b", None, "empty_file", "z")
    first.merge(second)
    assert first.counts == {"invalid_json": 2, "empty_file": 1}
    assert first.sample == [("a", 1, "x"), ("b", 2, "y"), ("b", None, "z")]
    assert first.total == 3


def test_skip_log_sample_is_bounded_but_counts_are_not():
    log, other = SkipLog(), SkipLog()
    for line in range(SAMPLE_LIMIT + 5):
        log.add("a", line, "invalid_json", "x")
        other.add("b", line, "truncated", "y")
    log.merge(other)
    assert log.counts == {"invalid_json": SAMPLE_LIMIT + 5, "truncated": SAMPLE_LIMIT + 5}
    assert log.sample == [("a", line, "x") for line in range(SAMPLE_LIMIT)]

    partial = SkipLog()
    partial.add("c", 1, "unreadable", "z")
    partial.merge(other)
    assert len(partial.sample) == SAMPLE_LIMIT
    assert partial.sample[:2] == [("c", 1, "z"), ("b", 0, "y")]


def test_skip_log_rejects_unknown_categories():
    with pytest.raises(ValueError, match="unknown skip category"):
        SkipLog().add("a", 1, "weird", "x")


# --- Parquet -------------------------------------------------------------------------------------


def write_parquet(tmp_path: Path, table: pa.Table, name: str = "t.parquet") -> str:
    path = tmp_path / name
    pq.write_table(table, path, row_group_size=10)
    return str(path)


TABLE = pa.table({"a": list(range(30)), "b": [f"b{i}" for i in range(30)], "c": [0.5] * 30})


def test_parquet_chunks_never_exceed_chunk_rows(tmp_path):
    batches = list(read_parquet(write_parquet(tmp_path, TABLE), chunk_rows=4))
    assert all(0 < batch.num_rows <= 4 for batch in batches)
    assert pa.Table.from_batches(batches).equals(TABLE)


def test_parquet_projection_and_filter(tmp_path):
    path = write_parquet(tmp_path, TABLE)
    batches = list(read_parquet(path, columns=["b", "a"], filter=pc.field("a") >= 25))
    table = pa.Table.from_batches(batches)
    assert table.column_names == ["b", "a"]
    assert table.column("a").to_pylist() == [25, 26, 27, 28, 29]
    # the filter may use a column that is not projected
    only_b = pa.Table.from_batches(read_parquet(path, columns=["b"], filter=pc.field("a") < 2))
    assert only_b.to_pylist() == [{"b": "b0"}, {"b": "b1"}]
    assert list(read_parquet(path, filter=pc.field("a") > 100)) == []


def test_parquet_schema_reads_the_footer(tmp_path):
    path = write_parquet(tmp_path, TABLE)
    assert parquet_schema(path).names == ["a", "b", "c"]
    assert parquet_schema(path, columns=["c", "a"]) == pa.schema(
        [("c", pa.float64()), ("a", pa.int64())]
    )
    with pytest.raises(MalformedInputError, match="no column 'zz'"):
        parquet_schema(path, columns=["zz"])


@pytest.mark.parametrize(
    ("expected", "columns", "difference"),
    [
        (
            pa.schema([("a", pa.int64()), ("b", pa.int64())]),
            ["a", "b"],
            "column 'b' is string, expected int64",
        ),
        (
            pa.schema([("a", pa.int64()), ("x", pa.int64())]),
            None,
            "column 'x' is missing, expected int64",
        ),
        (
            pa.schema([("a", pa.int64()), ("b", pa.string())]),
            None,
            "column 'c' is not in the expected schema",
        ),
    ],
)
def test_parquet_schema_mismatch(tmp_path, expected, columns, difference):
    path = write_parquet(tmp_path, TABLE)
    with pytest.raises(MalformedInputError) as caught:
        list(read_parquet(path, columns=columns, expected_schema=expected))
    assert str(caught.value) == f"{path}: schema differs: {difference}"
    assert caught.value.category == "schema_mismatch"

    skipped = SkipLog()
    assert (
        list(
            read_parquet(
                path, columns=columns, expected_schema=expected, lenient=True, skipped=skipped
            )
        )
        == []
    )
    assert skipped.counts == {"schema_mismatch": 1}
    assert skipped.sample == [(path, None, f"schema differs: {difference}")]


def test_parquet_expected_schema_that_matches_sets_column_order(tmp_path):
    path = write_parquet(tmp_path, TABLE)
    expected = pa.schema([("c", pa.float64()), ("a", pa.int64()), ("b", pa.string())])
    table = pa.Table.from_batches(read_parquet(path, expected_schema=expected))
    assert table.schema == expected
    assert table.num_rows == 30


def test_parquet_missing_projected_column_is_a_mismatch(tmp_path):
    path = write_parquet(tmp_path, TABLE)
    with pytest.raises(
        MalformedInputError, match=r"schema differs: no column 'zz' \(it has: a, b, c\)"
    ):
        list(read_parquet(path, columns=["a", "zz"]))


def test_unreadable_parquet(tmp_path):
    good = Path(write_parquet(tmp_path, TABLE, "good.parquet")).read_bytes()
    path = tmp_path / "cut.parquet"
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(MalformedInputError) as caught:
        list(read_parquet(str(path)))
    assert str(caught.value).startswith(f"{path}: not a readable Parquet file: ")
    assert "magic bytes" in str(caught.value)

    skipped = SkipLog()
    assert list(read_parquet(str(path), lenient=True, skipped=skipped)) == []
    assert skipped.counts == {"unreadable": 1}
    assert skipped.sample[0][:2] == (str(path), None)


def test_parquet_corrupt_inside_a_row_group(tmp_path):
    path = write_parquet(tmp_path, TABLE)
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    offset = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(Path(path).read_bytes())
    data[offset : offset + 8] = b"\xff" * 8
    Path(path).write_bytes(bytes(data))

    with pytest.raises(MalformedInputError, match="not a readable Parquet file"):
        list(read_parquet(path))
    skipped = SkipLog()
    rows = [
        row
        for batch in read_parquet(path, lenient=True, skipped=skipped)
        for row in batch.to_pylist()
    ]
    assert rows == TABLE.to_pylist()[: len(rows)]
    assert skipped.counts == {"unreadable": 1}


def test_empty_and_zero_row_parquet(tmp_path):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(MalformedInputError) as caught:
        list(read_parquet(str(empty)))
    assert str(caught.value) == f"{empty}: empty file (no records)"
    skipped = SkipLog()
    assert list(read_parquet(str(empty), lenient=True, skipped=skipped)) == []
    assert skipped.counts == {"empty_file": 1}

    no_rows = write_parquet(tmp_path, TABLE.slice(0, 0), "no-rows.parquet")
    assert list(read_parquet(no_rows)) == []
    assert parquet_schema(no_rows) == TABLE.schema


# --- fsspec URLs ---------------------------------------------------------------------------------


@pytest.fixture
def memory_dir():
    base = f"memory://keel-readers-{uuid.uuid4().hex}"
    yield base
    fs = fsspec.filesystem("memory")
    fs.rm(base.removeprefix("memory://"), recursive=True)


def test_memory_urls_work_for_both_readers(memory_dir):
    rows = rows_of(5)
    with fsspec.open(f"{memory_dir}/rows.jsonl.gz", "wb") as handle:
        handle.write(gzip.compress(jsonl_bytes(rows)))
    assert read_rows(f"{memory_dir}/rows.jsonl.gz", chunk_rows=2) == rows

    with fsspec.open(f"{memory_dir}/t.parquet", "wb") as handle:
        pq.write_table(TABLE, handle, row_group_size=10)
    url = f"{memory_dir}/t.parquet"
    table = pa.Table.from_batches(read_parquet(url, columns=["a"], filter=pc.field("a") < 3))
    assert table.to_pylist() == [{"a": 0}, {"a": 1}, {"a": 2}]
    assert parquet_schema(url, columns=["b"]) == pa.schema([("b", pa.string())])

    with fsspec.open(f"{memory_dir}/bad.parquet", "wb") as handle:
        handle.write(b"not parquet")
    with pytest.raises(MalformedInputError, match="not a readable Parquet file"):
        list(read_parquet(f"{memory_dir}/bad.parquet"))


def test_parquet_columns_must_agree_with_expected_schema(tmp_path):
    expected = pa.schema([("a", pa.int64())])
    with pytest.raises(ValueError, match="differ from expected_schema"):
        read_parquet(str(tmp_path / "t.parquet"), columns=["b"], expected_schema=expected)
