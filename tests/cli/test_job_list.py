"""`keel job list` shows the submitted jobs with their states; `--backend ray` without Ray
installed is one line saying how to install it."""

import json
import subprocess
import sys
import time

from cli_support import keel


def listed(cwd, *args):
    return json.loads(keel("job", "list", "--json", *args, cwd=cwd).stdout)["jobs"]


def test_job_list_shows_submitted_jobs_with_their_states(tmp_path):
    assert listed(tmp_path) == []  # no controller state yet: nothing, and nothing created
    assert not (tmp_path / "keel-out").exists()
    quick = keel("job", "run", "--name", "quick", "--", "true", cwd=tmp_path).stdout.strip()
    slow = keel("job", "run", "--", "sleep", "60", cwd=tmp_path).stdout.strip()
    try:
        deadline = time.monotonic() + 60
        while {j["id"]: j["state"] for j in listed(tmp_path)} != {
            quick: "succeeded",
            slow: "running",
        }:
            assert time.monotonic() < deadline, listed(tmp_path)
            time.sleep(0.3)
        jobs = listed(tmp_path)
        assert [(j["id"], j["name"]) for j in jobs] == [(slow, "sleep"), (quick, "quick")]
        assert jobs[0]["cluster"] == "local" and jobs[0]["priority"] == "batch"
        assert [j["id"] for j in listed(tmp_path, "--state", "running")] == [slow]
        table = keel("job", "list", cwd=tmp_path).stdout
        assert "succeeded" in table and "running" in table and quick in table
    finally:
        keel("job", "cancel", slow, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while listed(tmp_path, "--state", "cancelled") == []:
        assert time.monotonic() < deadline, listed(tmp_path)
        time.sleep(0.3)
    keel("cluster", "stop", cwd=tmp_path)
    bad = keel("job", "list", "--state", "done", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --state 'done': use one of")


# `keel ARGS...` in an interpreter where `import ray` fails, as it does without Ray installed.
WITHOUT_RAY = """
import runpy, sys
sys.modules["ray"] = None
sys.argv = ["keel", *sys.argv[1:]]
runpy.run_module("keel", run_name="__main__")
"""


def test_backend_ray_without_ray_installed_is_one_line_with_the_install_command(tmp_path):
    (tmp_path / "exp.py").write_text("")
    for args in (
        ["run", "exp.py", "--backend", "ray"],
        ["data", "filter", "--input", "in", "--output", "out", "--backend", "ray"],
    ):
        result = subprocess.run(
            [sys.executable, "-c", WITHOUT_RAY, *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines() == [
            "error: --backend ray needs Ray, which is not installed: pip install 'keel[ray]'"
        ]
