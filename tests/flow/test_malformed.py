"""Malformed input through a pipeline: a clear error by default, counted skips when lenient."""

import gzip
import json

import pytest

from keel.flow import TaskFailedError, read_jsonl


@pytest.fixture
def messy(tmp_path):
    good = [json.dumps({"id": i, "text": f"doc {i}"}) for i in range(10)]
    (tmp_path / "a-good.jsonl").write_text("\n".join(good) + "\n")
    (tmp_path / "b-bad.jsonl").write_text(good[0] + "\n{not json\n" + good[1] + "\n")
    data = gzip.compress(("\n".join(good) + "\n").encode())
    (tmp_path / "c-truncated.jsonl.gz").write_bytes(data[: len(data) // 2])
    (tmp_path / "d-empty.jsonl").write_text("")
    return tmp_path


def test_strict_reading_fails_naming_file_and_line(messy, pool):
    with pytest.raises(TaskFailedError) as caught:
        read_jsonl(str(messy / "b-*.jsonl")).count(backend=pool)
    assert "b-bad.jsonl:2: not valid JSON" in str(caught.value)
    assert "after 1 attempt" in str(caught.value)  # a fact about the data: not retried


def test_lenient_reading_skips_and_counts_every_problem(messy, pool):
    result = read_jsonl(str(messy / "*.jsonl*"), lenient=True).write_parquet(
        messy / "out", backend=pool
    )
    assert result.skipped.counts["invalid_json"] == 1
    assert result.skipped.counts["truncated"] == 1
    assert result.skipped.counts["empty_file"] == 1
    where = {(file.rsplit("/", 1)[-1], line) for file, line, _ in result.skipped.sample}
    assert ("b-bad.jsonl", 2) in where and ("d-empty.jsonl", None) in where
    assert result.stages[0].rows_in == result.rows  # every row that was read was written
    assert 10 + 2 <= result.rows < 10 + 2 + 10
