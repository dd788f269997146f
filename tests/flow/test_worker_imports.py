"""Local workers import the modules the coordinator imports, whatever the working directory holds:
a `keel` directory where a run is started (a checkout of another version, say) is not the keel its
workers run."""

import json
import subprocess
import sys
import textwrap

COORDINATOR = """
import json
import keel
from keel.flow import from_items


def where(row):
    import keel
    return {"keel": keel.__file__}


table = from_items([{"n": n} for n in range(8)]).map(where).to_table(workers=2)
print(json.dumps({"coordinator": keel.__file__, "workers": sorted(set(table["keel"].to_pylist()))}))
"""


def test_workers_import_the_coordinators_keel_not_one_in_the_working_directory(tmp_path):
    shadow = tmp_path / "run_here" / "keel"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the keel of the working directory')\n")
    script = tmp_path / "coordinator.py"
    script.write_text(textwrap.dedent(COORDINATOR))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=shadow.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["workers"] == [result["coordinator"]]
    assert not result["coordinator"].startswith(str(shadow))


def _imported(batch):
    import sys

    import pyarrow as pa

    names = ("fsspec", "pyarrow.dataset")
    return pa.RecordBatch.from_pylist([{name: name in sys.modules for name in names}])


def test_a_local_parquet_pass_does_not_import_fsspec_or_pyarrow_dataset_in_workers(tmp_path):
    """A worker's start is part of every cold run: fsspec (with asyncio and ssl) and
    pyarrow.dataset (which imports pandas wherever it is installed) cost ~0.05-0.25 s a process
    and a local Parquet read, shuffle and write need neither."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from keel.flow import LocalBackend, RunOptions, read_parquet

    for part in range(2):
        rows = [{"key": n % 5, "text": f"t{n}"} for n in range(part * 50, part * 50 + 50)]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"part-{part}.parquet")
    documents = read_parquet(str(tmp_path / "part-*.parquet"))
    with LocalBackend(workers=2) as pool:  # the same two workers do both passes
        options = RunOptions(backend=pool)
        documents.deduplicate("key", num_shards=2).write_parquet(
            str(tmp_path / "out"), options=options
        )
        seen = documents.map_batches(_imported).to_table(options=options)
    assert seen.num_rows == 2
    assert not any(seen.column("fsspec").to_pylist())
    assert not any(seen.column("pyarrow.dataset").to_pylist())
