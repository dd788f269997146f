"""keel.core.paths.glob_files: a local glob (plain os calls) names the files fsspec's would."""

import fsspec
import pytest

from keel.core import paths


@pytest.mark.parametrize(
    "pattern", ["*.parquet", "**/*.parquet", "a.parquet", "sub", "missing.parquet", "[ab].parquet"]
)
def test_a_local_glob_names_the_files_fsspecs_glob_names(tmp_path, monkeypatch, pattern):
    for name in ("a.parquet", ".hidden.parquet", "b.jsonl", "sub/c.parquet", "sub/deep/d.parquet"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    monkeypatch.chdir(tmp_path)  # a relative pattern comes back absolute, as fsspec spells it
    fs, path = fsspec.core.url_to_fs(pattern)
    wildcard = any(c in pattern for c in "*?[")
    expected = [m for m in (sorted(fs.glob(path)) if wildcard else [path]) if fs.isfile(m)]
    assert paths.glob_files(pattern) == expected
    assert paths.glob_files(f"file://{tmp_path}/{pattern}") == expected


def test_a_url_glob_keeps_its_protocol():
    memory = fsspec.filesystem("memory")
    memory.store.clear()
    for name in ("b/x/1.parquet", "b/x/2.parquet", "b/y.parquet"):
        memory.pipe(f"/{name}", b"x")
    assert paths.glob_files("memory://b/x/*.parquet") == [
        "memory:///b/x/1.parquet",
        "memory:///b/x/2.parquet",
    ]
