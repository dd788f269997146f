"""`keel status EXPERIMENT.py` and `keel gc --keep EXPERIMENT.py` through the real command."""

import json

from cli_support import error_lines


def test_status_of_an_experiment_and_gc_of_what_no_kept_experiment_uses(cli):
    old, new = cli.experiment(value_a=1, name="old.py"), cli.experiment(value_a=5, name="new.py")
    assert cli.run("run", str(old), "--prefix", str(cli.prefix)).returncode == 0
    assert (
        cli.run("run", str(new), "--prefix", str(cli.prefix), "--set", "d.value=3").returncode == 0
    )
    (cli.prefix / "notes").mkdir()  # a user's own directory, and a step-like name without record
    (cli.prefix / "e-0123abcd").mkdir()
    (cli.prefix / "telemetry").mkdir()

    status = json.loads(cli.run("status", str(new), "--prefix", str(cli.prefix), "--json").stdout)
    assert [(s["name"], s["state"]) for s in status["steps"]] == [
        ("a", "SUCCESS"),
        ("b", "SUCCESS"),
        ("c", "SUCCESS"),
        ("d", "NOT RUN"),  # run with --set d.value=3 only: that d is another step
    ]
    before = sorted(p.name for p in cli.prefix.iterdir())
    listed = cli.run("gc", "--keep", str(new), "--prefix", str(cli.prefix), "--json")
    assert listed.returncode == 0, listed.stderr
    unused = json.loads(listed.stdout)
    assert unused["removed"] is False
    names = sorted(o["name"] for o in unused["outputs"])
    assert names == ["a", "b", "c", "d", "d"]  # old a-d and the --set d
    assert all(o["bytes"] > 0 for o in unused["outputs"])
    assert sorted(p.name for p in cli.prefix.iterdir()) == before  # a dry listing by default
    removed = cli.run("gc", "--keep", str(new), "--prefix", str(cli.prefix), "--yes")
    assert removed.returncode == 0, removed.stderr
    assert "removed 5 step outputs" in removed.stderr
    left = sorted(p.name for p in cli.prefix.iterdir())
    assert sorted(name for name in left if not name.startswith(".")) == sorted(
        [f"{s['name']}-{s['hash']}" for s in status["steps"][:3]]
        + ["e-0123abcd", "notes", "telemetry"]
    )
    assert [name for name in left if name.startswith(".")] == [".keel"]  # nothing set aside
    controls = sorted(p.name for p in (cli.prefix / ".keel" / "steps").iterdir())
    assert controls == sorted(f"{s['name']}-{s['hash']}" for s in status["steps"][:3])
    cached = json.loads(cli.run("run", str(new), "--prefix", str(cli.prefix), "--json").stdout)
    assert cached["executed"] == ["d"] and cached["cached"] == ["a", "b", "c"]


def test_gc_without_a_kept_experiment_is_one_line_error(cli):
    result = cli.run("gc", "--prefix", str(cli.prefix), "--yes")
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        "error: name the experiments whose outputs to keep: keel gc --keep EXPERIMENT.py ..."
    ]
