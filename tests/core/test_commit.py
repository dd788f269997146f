import fsspec
import pytest

from keel.core import paths
from keel.core.commit import commit_directory, is_committed
from keel.core.errors import KeelError

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
