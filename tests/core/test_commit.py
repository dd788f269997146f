import os
import subprocess

import fsspec
import pytest

from keel.core import paths
from keel.core.commit import (
    COMMITTING,
    STAGING_INFIX,
    commit_directory,
    is_committed,
    missing_records,
    staged_output,
)
from keel.core.errors import KeelError
from keel.core.output_checks import OutputRefusedError
from keel.core.process import process_start

MARKER = ".keel/done.json"


def _stage(root, name, content):
    staging = paths.join(root, name)
    paths.make_dirs(paths.join(staging, "sub"))
    with paths.open_file(paths.join(staging, "sub", "data.txt"), "w") as handle:
        handle.write(content)
    paths.write_text(paths.join(staging, ".keel", "done.json"), "{}")
    return staging


def test_local_commit_moves_staging_into_place_and_replaces_the_old_output(tmp_path):
    final = str(tmp_path / "out")
    commit_directory(_stage(str(tmp_path), "s1", "one"), final, marker=MARKER)
    assert is_committed(final, marker=MARKER)
    commit_directory(_stage(str(tmp_path), "s2", "two"), final, marker=MARKER)
    assert (tmp_path / "out" / "sub" / "data.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or aside left


def test_object_store_commit_copies_everything_and_writes_the_marker(tmp_path):
    fsspec.filesystem("memory").store.clear()
    final = "memory://bucket/out"
    commit_directory(_stage("memory://bucket", "stage", "hello"), final, marker=MARKER)
    assert is_committed(final, marker=MARKER)
    assert paths.read_text("memory://bucket/out/sub/data.txt") == "hello"
    assert not paths.exists("memory://bucket/stage")


def test_commit_without_marker_is_refused(tmp_path):
    staging = tmp_path / "s"
    staging.mkdir()
    with pytest.raises(KeelError, match="marker"):
        commit_directory(str(staging), str(tmp_path / "out"), marker=MARKER)
    assert not (tmp_path / "out").exists()


# -- what an output may replace, checked before any work --------------------------------------
def _tree(root):
    """Every path under root -> its bytes (None for directories)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def _refused(final, inputs=(), marker=MARKER):
    with (
        pytest.raises(OutputRefusedError) as caught,
        staged_output(final, marker=marker, kind="test output", inputs=inputs),
    ):
        raise AssertionError("the block must not run")
    return str(caught.value)


def test_a_directory_of_other_files_a_file_and_an_input_are_refused_untouched(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    (tmp_path / "notes.txt").write_text("notes")
    data = tmp_path / "data" / "docs"
    data.mkdir(parents=True)
    (data / "part-0.parquet").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "data")
    before = _tree(tmp_path)
    assert "not a previous test output" in _refused(str(tmp_path / "mine"))
    assert "is a file" in _refused(str(tmp_path / "notes.txt"))
    assert "is the input" in _refused(str(data), inputs=[str(data)])
    assert "contains the input" in _refused(str(tmp_path / "data"), inputs=str(data / "*.parquet"))
    assert "contains the input" in _refused(str(tmp_path / "link"), inputs=[str(data)])  # symlink
    assert "contains the input" in _refused(f"{data}/../..", inputs=[str(data)])
    assert _tree(tmp_path) == before  # nothing made, moved or removed


def test_missing_empty_and_previous_outputs_are_replaced(tmp_path):
    for name in ("new", "empty", "previous"):
        final = tmp_path / name
        if name == "empty":
            final.mkdir()
        for content in ("one", "two"):  # the second commit replaces a previous output
            with staged_output(str(final), marker=MARKER, kind="test output") as staging:
                _stage(staging, "", content)
            assert (final / "sub" / "data.txt").read_text() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new", "previous"]


def test_an_output_beside_a_glob_input_is_allowed(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.jsonl").write_text("{}\n")
    final = tmp_path / "raw" / "out"
    inputs = str(tmp_path / "raw" / "*.jsonl")
    with staged_output(str(final), marker=MARKER, kind="t", inputs=inputs) as staging:
        _stage(staging, "", "beside")
    assert (final / "sub" / "data.txt").read_text() == "beside"


def test_object_store_outputs_are_compared_by_normalised_url():
    fsspec.filesystem("memory").store.clear()
    paths.write_text("memory://bucket/in/part-0.parquet", "x")
    message = _refused("memory://bucket/in/", inputs=["memory:///bucket//in/*.parquet"])
    assert "is the input" in message
    assert "contains the input" in _refused("memory://bucket", inputs=["memory://bucket/in"])


def test_a_failed_block_leaves_no_staging_and_a_killed_owners_staging_is_removed(tmp_path):
    final = tmp_path / "out"
    with (
        pytest.raises(ValueError),
        staged_output(str(final), marker=MARKER, kind="t") as staging,
    ):
        _stage(staging, "", "half")
        raise ValueError("the stage failed")
    assert list(tmp_path.iterdir()) == []
    dead = subprocess.Popen(["sleep", "30"])
    start = process_start(dead.pid)
    dead.kill()
    dead.wait()
    left = tmp_path / f"out{STAGING_INFIX}{dead.pid}-{start}-abcd1234"
    left.mkdir()
    live = tmp_path / f"out{STAGING_INFIX}{os.getpid()}-{process_start(os.getpid())}-abcd1234"
    live.mkdir()
    with staged_output(str(final), marker=MARKER, kind="t") as staging:
        _stage(staging, "", "whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name])


def test_an_interrupted_object_store_copy_is_replaced_by_the_next_commit():
    fsspec.filesystem("memory").store.clear()
    paths.write_text("memory://bucket/out/sub/data.txt", "half")
    paths.write_text(f"memory://bucket/out/{COMMITTING}", "")  # a copy commit that died
    commit_directory(_stage("memory://bucket", "s", "whole"), "memory://bucket/out", marker=MARKER)
    assert paths.read_text("memory://bucket/out/sub/data.txt") == "whole"
    assert not paths.exists(f"memory://bucket/out/{COMMITTING}")


def test_records_are_listed_by_the_marker_and_missing_ones_reported(tmp_path):
    final = tmp_path / "out"
    with staged_output(str(final), marker="_SUCCESS", kind="t", records=["r.json"]) as staging:
        paths.write_text(paths.join(staging, "r.json"), "{}")
    assert missing_records(str(final), "_SUCCESS") == []
    (final / "r.json").unlink()
    assert missing_records(str(final), "_SUCCESS") == ["r.json"]
