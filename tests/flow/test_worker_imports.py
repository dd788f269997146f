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
