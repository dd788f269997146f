"""`keel quickstart`: the main job on the bundled sample, end to end."""

import json

import pytest

QUICKSTART_STEPS = ["documents", "word_counts", "document_stats", "summary"]  # DAG order


def test_quickstart_runs_end_to_end_then_is_cached(cli):
    first = cli.run("quickstart", "--prefix", str(cli.prefix))
    assert first.returncode == 0, first.stderr
    assert "quickstart done" in first.stdout and "40 documents" in first.stdout
    summary_file = next(cli.prefix.glob("summary-*/summary.json"))
    summary = json.loads(summary_file.read_text())
    assert summary["documents"] == 40
    assert summary["words"] > 50_000
    assert summary["top_words"][0][0] == "the"
    assert all(word != "unk" for word, _ in summary["top_words"])
    counts = [count for _, count in summary["top_words"]]
    assert counts == sorted(counts, reverse=True)

    again = cli.run("quickstart", "--prefix", str(cli.prefix), "--json")
    assert json.loads(again.stdout) == {"executed": [], "cached": QUICKSTART_STEPS, "failed": []}


def test_quickstart_threshold_change_reruns_one_branch(cli):
    cli.run("quickstart", "--prefix", str(cli.prefix), "--json")
    changed = cli.run(
        "quickstart", "--prefix", str(cli.prefix), "--json", "--set", "word_counts.min_length=6"
    )
    result = json.loads(changed.stdout)
    assert sorted(result["executed"]) == ["summary", "word_counts"]
    assert sorted(result["cached"]) == ["document_stats", "documents"]
    summaries = [json.loads(p.read_text()) for p in cli.prefix.glob("summary-*/summary.json")]
    long_words = next(s for s in summaries if s["top_words"][0][0] != "the")
    assert all(len(word) >= 6 for word, _ in long_words["top_words"])


def test_every_command_has_help_with_an_example(cli):
    for command in ("run", "status", "quickstart"):
        result = cli.run(command, "--help")
        assert result.returncode == 0
        assert "Example" in result.stdout


def test_unknown_backend_is_a_usage_error(cli):
    result = cli.run("quickstart", "--prefix", str(cli.prefix), "--backend", "spark")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --backend 'spark': use one of local, ray"


@pytest.mark.ray
def test_quickstart_on_ray_writes_the_same_bytes_as_local(cli):
    local = cli.run("quickstart", "--prefix", str(cli.root / "local"), "--json")
    on_ray = cli.run("quickstart", "--prefix", str(cli.root / "ray"), "--json", "--backend", "ray")
    assert on_ray.returncode == 0, on_ray.stderr
    assert json.loads(on_ray.stdout)["executed"] == json.loads(local.stdout)["executed"]
    for part in (cli.root / "local").glob("word_counts-*/word_counts/*"):
        twin = cli.root / "ray" / part.relative_to(cli.root / "local")
        assert twin.read_bytes() == part.read_bytes()
