"""The layering of SYSTEM.md holds: import-linter's contract in pyproject.toml is kept."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layers_contract_is_kept():
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports, "import-linter is part of the [test] extra"
    result = subprocess.run(
        [lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_layer_packages_exist():
    for package in (
        "core",
        "steps",
        "flow",
        "telemetry",
        "data",
        "model",
        "cluster",
        "train",
        "scaling",
        "cli",
        "dashboard",
        "experiments",
    ):
        assert (ROOT / "keel" / package / "__init__.py").is_file(), package
