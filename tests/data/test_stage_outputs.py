"""A stage's output appears whole (documents, side tables and stage.json at once) or not at all,
and a stage refuses input it cannot use before writing anything."""

import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keel.core.errors import UsageError
from keel.data.dedup import run_exact_dedup
from keel.data.documents import STAGE_FILE, write_texts
from keel.flow import RunOptions

KILLED_BEFORE_STAGE_JSON = """
import os, signal, sys
from keel.data import documents
from keel.data.dedup import run_exact_dedup
from keel.flow import RunOptions

def killed(self, directory):  # the process dies where stage.json would be written
    os.kill(os.getpid(), signal.SIGKILL)

documents.StageReport.write = killed
run_exact_dedup(sys.argv[1], sys.argv[2], options=RunOptions(workers=1))
"""


def test_a_kill_before_stage_json_leaves_no_output_that_a_later_stage_accepts(tmp_path):
    docs = write_texts(tmp_path / "docs", ["one", "two", "two"], 1, "t")
    output = tmp_path / "exact"
    killed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLED_BEFORE_STAGE_JSON), docs, str(output)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr
    # all or nothing: no directory without its record
    assert not output.exists() or (output / STAGE_FILE).exists(), sorted(os.listdir(output))
    with pytest.raises(UsageError):
        run_exact_dedup(str(output), str(tmp_path / "next"), options=RunOptions(workers=1))
    # a later run into the same output succeeds and leaves nothing of the killed one behind
    run_exact_dedup(docs, str(output), options=RunOptions(workers=1))
    assert (output / STAGE_FILE).exists() and (output / "removed.parquet").exists()
    assert sorted(os.listdir(tmp_path)) == ["docs", "exact"]


def test_a_committed_output_missing_its_record_is_refused_as_input(tmp_path):
    docs = write_texts(tmp_path / "docs", ["one", "two"], 1, "t")
    output = tmp_path / "exact"
    run_exact_dedup(docs, str(output), options=RunOptions(workers=1))
    (output / STAGE_FILE).unlink()  # e.g. a copy by hand that lost it
    with pytest.raises(UsageError, match=STAGE_FILE):
        run_exact_dedup(str(output), str(tmp_path / "next"), options=RunOptions(workers=1))
    assert not (tmp_path / "next").exists()


def test_exact_dedup_without_a_text_column_is_one_line(tmp_path):
    (tmp_path / "ids").mkdir()
    table = pa.table({"id": ["a", "a", "b"], "body": ["x", "x", "y"]})
    pq.write_table(table, tmp_path / "ids" / "part-00000-of-00001.parquet")
    with pytest.raises(UsageError, match="'text'"):
        run_exact_dedup(str(tmp_path / "ids"), str(tmp_path / "out"), options=RunOptions(workers=1))
    assert not (tmp_path / "out").exists()
