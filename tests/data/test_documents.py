"""The document-set conventions every DataKit stage shares."""

import pytest

from keel.data.documents import (
    DROPPED_SAMPLE,
    StageReport,
    document_id,
    normalize_text,
    parquet_glob,
    write_texts,
)


def test_document_id_is_xxh3_128_hex_and_depends_only_on_the_text():
    first = document_id("The same text.")
    assert first == document_id("The same text.") and len(first) == 32
    assert int(first, 16) >= 0 and first == first.lower()
    assert document_id("The same text!") != first


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("cafe\u0301", "caf\u00e9"),  # NFC
        ("a\r\nb\rc\u2028d", "a\nb\nc\nd"),  # newline conventions
        ("tab\tkept\x00\x07 bell gone\x7f", "tab\tkept bell gone"),
        ("trailing space \n\n", "trailing space"),
    ],
)
def test_normalize_text(raw, clean):
    assert normalize_text(raw) == clean


def test_stage_report_counts_and_samples_drops(tmp_path):
    report = StageReport("dedup", documents_in=100, documents_out=60)
    report.drop("exact_duplicate", [f"id{i}" for i in range(30)])
    report.drop("exact_duplicate", ["more"], count=10)
    assert report.dropped == {"exact_duplicate": 40}
    assert len(report.dropped_sample["exact_duplicate"]) == DROPPED_SAMPLE
    report.write(str(tmp_path))
    assert StageReport.read(str(tmp_path)) == report


def test_parquet_glob_reads_parts_only():
    assert parquet_glob("/data/set") == "/data/set/part-*.parquet"
    assert parquet_glob("/data/*.parquet") == "/data/*.parquet"
    assert parquet_glob(["/a", "/b/x.parquet"]) == ["/a/part-*.parquet", "/b/x.parquet"]
    assert parquet_glob("s3://bucket/set") == "s3://bucket/set/part-*.parquet"


def test_write_texts_makes_a_document_set_of_contiguous_parts(tmp_path):
    import pyarrow.parquet as pq

    directory = write_texts(tmp_path / "set", ["a", "b", "c"], parts=2, source="unit")
    parts = sorted((tmp_path / "set").glob("part-*.parquet"))
    assert [p.name for p in parts] == ["part-00000-of-00002.parquet", "part-00001-of-00002.parquet"]
    rows = [row for part in parts for row in pq.read_table(part).to_pylist()]
    assert rows == [{"id": document_id(t), "text": t, "source": "unit"} for t in "abc"]
    assert directory == str(tmp_path / "set")


def test_write_texts_gives_an_empty_trailing_part_the_document_schema(tmp_path):
    from keel.flow import read_parquet

    texts = [f"text {i}" for i in range(13)]  # 2 per part: the eighth part is empty
    directory = write_texts(tmp_path / "set", texts, parts=8)
    assert read_parquet(parquet_glob(directory)).count(workers=1) == 13
