"""`keel data mix` and `keel data stats` through the real command."""

import json

from keel.data.documents import document_id
from keel.flow import from_items


def _document_set(path, name, count):
    rows = [
        {"id": document_id(f"{name}{i}"), "text": f"{name} text {i} " * 20, "source": name}
        for i in range(count)
    ]
    from_items(rows, 2).write_parquet(path, workers=1)


def test_mix_then_stats(cli):
    _document_set(cli.root / "web", "web", 60)
    _document_set(cli.root / "code", "code", 20)
    mixed = cli.run(
        "data",
        "mix",
        "--source",
        f"{cli.root / 'web'}=1",
        "--source",
        f"{cli.root / 'code'}=1",
        "--output",
        str(cli.root / "mix"),
        "--workers",
        "1",
        "--json",
    )
    assert mixed.returncode == 0, mixed.stderr
    report = json.loads(mixed.stdout)
    assert report["stage"] == "mix" and report["documents_in"] == 80
    stats = cli.run("data", "stats", str(cli.root / "mix"), "--json")
    assert stats.returncode == 0, stats.stderr
    result = json.loads(stats.stdout)
    assert result["kind"] == "documents"
    assert result["documents"] == report["documents_out"]
    assert result["stage"]["stage"] == "mix"


def test_bad_mix_source_and_missing_stats_path_are_one_line_errors(cli):
    bad = cli.run("data", "mix", "--source", "web", "--output", str(cli.root / "m"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: --source 'web'")
    missing = cli.run("data", "stats", str(cli.root / "nothing"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr
