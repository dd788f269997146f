"""The same input and pipeline give byte-identical files for any worker count and either backend."""

import gzip
import json
from pathlib import Path

import pytest

from keel.flow import LocalBackend, read_jsonl


def write_inputs(root: Path) -> str:
    """Five gzipped JSONL files with duplicated ids; returns their glob."""
    for shard in range(5):
        with gzip.open(root / f"docs-{shard}.jsonl.gz", "wt") as handle:
            for i in range(1500):
                n = shard * 1500 + i
                row = {"id": f"doc{n % 2000}", "n": n, "text": f"text of {n % 2000} " * (n % 5 + 1)}
                handle.write(json.dumps(row) + "\n")
    return str(root / "*.jsonl.gz")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("inputs"))


def _pipeline(pattern: str):
    return (
        read_jsonl(pattern)
        .map(lambda d: {**d, "words": len(d["text"].split())})
        .deduplicate("id", num_shards=4)
        .group_by(
            lambda d: d["words"],
            lambda words, docs: {"words": words, "docs": len(docs), "ids": [d["id"] for d in docs]},
            num_shards=3,
        )
    )


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _run(pattern: str, out: Path, backend, **options) -> dict[str, bytes]:
    _pipeline(pattern).write_parquet(out, backend=backend, chunk_rows=500, **options)
    return _files(out)


def test_one_two_and_four_workers_write_identical_files(inputs, tmp_path):
    outputs = []
    for workers in (1, 2, 4):
        with LocalBackend(workers=workers) as backend:
            outputs.append(_run(inputs, tmp_path / f"w{workers}", backend))
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0]) == 4  # three parts and _SUCCESS


def test_a_smaller_memory_budget_spills_but_writes_the_same_files(inputs, tmp_path):
    with LocalBackend(workers=2) as backend:
        roomy = _run(inputs, tmp_path / "roomy", backend)
        tight = _run(inputs, tmp_path / "tight", backend, memory_budget=20_000)
    assert roomy == tight
