"""`keel data mix` and `keel data stats` through the real command."""

import json
import re
from pathlib import Path

import pytest

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


def _stage_files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_data_commands_follow_their_contract_and_are_worker_independent(cli):
    """ingest -> dedup (exact, fuzzy) -> decontam -> tokenize through the CLI, with 1 and 2
    workers: the same files, byte for byte."""
    sample = Path(__file__).resolve().parents[2] / "keel" / "experiments" / "sample"
    outputs = {}
    for workers in ("1", "2"):
        root = cli.root / f"w{workers}"
        steps = [
            (
                "ingest",
                "--input",
                str(sample / "wikitext2.jsonl.gz"),
                "--output",
                str(root / "docs"),
            ),
            (
                "dedup",
                "--mode",
                "exact",
                "--input",
                str(root / "docs"),
                "--output",
                str(root / "exact"),
            ),
            (
                "dedup",
                "--mode",
                "fuzzy",
                "--threshold",
                "0.8",
                "--input",
                str(root / "exact"),
                "--output",
                str(root / "fuzzy"),
            ),
            (
                "decontam",
                "--eval",
                str(sample / "gsm8k.jsonl.gz"),
                "--eval-field",
                "question",
                "--eval-field",
                "answer",
                "--input",
                str(root / "fuzzy"),
                "--output",
                str(root / "clean"),
            ),
            (
                "tokenize",
                "--train-tokenizer",
                "--vocab-size",
                "1024",
                "--input",
                str(root / "clean"),
                "--output",
                str(root / "cache"),
            ),
        ]
        for step in steps:
            result = cli.run("data", *step, "--workers", workers, "--json", timeout=300)
            assert result.returncode == 0, (step, result.stderr)
            assert json.loads(result.stdout)["stage"]
        outputs[workers] = {
            name: _stage_files(root / name) for name in ("exact", "fuzzy", "clean", "cache")
        }
    assert outputs["1"] == outputs["2"]
    files = outputs["1"]
    assert "removed.parquet" in files["exact"] and "removed.parquet" in files["fuzzy"]
    assert {"contaminated.parquet", "report.json"} <= set(files["clean"])
    assert {"manifest.json", "tokenizer.json"} <= set(files["cache"])
    manifest = json.loads(files["cache"]["manifest.json"])
    assert manifest["total_tokens"] > 10_000 and manifest["vocab_size"] == 1024


def test_tokenize_needs_exactly_one_tokenizer_source(cli):
    result = cli.run("data", "tokenize", "--input", "x", "--output", "y")
    assert result.returncode == 2
    assert "exactly one of --train-tokenizer and --tokenizer" in result.stderr


# -- --output may only be a new/empty directory or a previous output, never an input ----------
DATA_COMMANDS_WITH_OUTPUT = {
    "ingest": ["ingest", "--input", "{raw}"],
    "extract": ["extract", "--input", "{docs}"],
    "quality": ["quality", "--input", "{docs}"],
    "filter": ["filter", "--input", "{docs}"],
    "embed": ["embed", "--input", "{docs}"],
    "dedup-exact": ["dedup", "--mode", "exact", "--input", "{docs}"],
    "dedup-fuzzy": ["dedup", "--mode", "fuzzy", "--input", "{docs}"],
    "decontam": ["decontam", "--eval", "{eval}", "--input", "{docs}"],
    "tokenize": ["tokenize", "--train-tokenizer", "--input", "{docs}"],
    "mix": ["mix", "--source", "{docs}=1"],
}


def _checksums(root: Path) -> dict[str, str]:
    """Every file and directory under `root`: path -> sha256 of its bytes ("dir" for dirs)."""
    import hashlib

    found = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        found[key] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.mark.parametrize("target", ["cwd", "input", "parent-of-input"])
@pytest.mark.parametrize("command", sorted(DATA_COMMANDS_WITH_OUTPUT))
def test_output_that_is_cwd_or_holds_an_input_is_refused_and_nothing_is_touched(
    tmp_path, monkeypatch, command, target
):
    """The real `keel data` commands (in process, for speed): one `error:` line, exit 2, and the
    whole tree byte for byte as it was."""
    from typer.testing import CliRunner

    from keel.cli.main import app
    from keel.data.documents import write_texts

    tree = tmp_path / "tree"
    (tree / "notes").mkdir(parents=True)
    (tree / "notes" / "todo.txt").write_text("unrelated user file\n")
    docs = write_texts(tree / "data" / "docs", ["alpha beta", "gamma delta"], 1, "t")
    raw = tree / "data" / "raw.jsonl"
    raw.write_text('{"text": "alpha"}\n')
    eval_set = tree / "eval.jsonl"
    eval_set.write_text('{"question": "what"}\n')
    monkeypatch.chdir(tree)
    args = [
        part.format(docs=docs, raw=raw, eval=eval_set)
        for part in DATA_COMMANDS_WITH_OUTPUT[command]
    ]
    input_path = Path(docs) if command != "ingest" else raw
    output = {"cwd": ".", "input": str(input_path), "parent-of-input": str(tree / "data")}[target]
    if command == "ingest" and target == "input":
        output = str(raw)  # the input is a file: refused as an output too
    before = _checksums(tmp_path)
    result = CliRunner().invoke(app, ["data", *args, "--output", output, "--workers", "1"])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "refus" in lines[0], lines[0]
    assert _checksums(tmp_path) == before


def test_a_data_stage_writes_progress_lines_into_a_log_and_none_with_quiet(cli):
    _document_set(cli.root / "docs", "web", 40)  # 2 input files: 2 tasks per stage
    base = ["data", "dedup", "--input", str(cli.root / "docs"), "--workers", "1", "--json"]
    shown = cli.run(*base, "--output", str(cli.root / "a"), "--progress", "1")
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stderr.splitlines() if re.search(r"\d+/\d+ tasks", line)]
    assert lines and all(line.startswith("stage ") for line in lines), shown.stderr
    quiet = cli.run(*base, "--output", str(cli.root / "b"), "--quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert not re.search(r"\d+/\d+ tasks", quiet.stderr)
    assert json.loads(quiet.stdout)["documents_out"] == json.loads(shown.stdout)["documents_out"]


def test_fuzzy_dedup_source_guard_is_one_error_line_and_force_lifts_it(cli):
    """JSONL straight into `keel data dedup --mode fuzzy` (and `keel data fuzzy-dedup`): a
    source that would lose 90% stops the run (exit 1, nothing written); --force runs it and
    prints what each source lost."""
    import random

    rng = random.Random(0)
    vocabulary = [f"w{n}" for n in range(3000)]
    records = []
    for _ in range(10):  # 10 texts and 9 near copies of each: 90 of 100 "web" documents
        words = rng.sample(vocabulary, 100)
        for copy in range(10):
            edited = list(words)
            if copy:
                edited[rng.randrange(100)] = "edited"
            records.append({"text": " ".join(edited), "source": "web"})
    raw = cli.root / "raw.jsonl"
    raw.write_text("".join(json.dumps(record) + "\n" for record in records))
    base = ["data", "dedup", "--mode", "fuzzy", "--input", str(raw), "--workers", "1"]
    stopped = cli.run(*base, "--output", str(cli.root / "a"))
    assert stopped.returncode == 1, stopped.stderr
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and stopped.stderr.splitlines()[-1] == errors[0]  # flow logs above
    assert errors[0].startswith("error: fuzzy dedup would drop 90.0% of source 'web'")
    assert not (cli.root / "a").exists()
    forced = cli.run(*base, "--output", str(cli.root / "b"), "--force")
    assert forced.returncode == 0, forced.stderr
    assert "web: 90.0% (90 of 100)" in forced.stdout
    assert (cli.root / "b" / "evidence.parquet").exists()
    # the stage's own command has the --force its guard's error names
    generated = ["data", "fuzzy-dedup", "--input", str(raw), "--workers", "1"]
    stopped = cli.run(*generated, "--output", str(cli.root / "c"))
    assert stopped.returncode == 1 and "or pass --force" in stopped.stderr, stopped.stderr
    forced = cli.run(*generated, "--output", str(cli.root / "c"), "--force")
    assert forced.returncode == 0, forced.stderr
    assert "web: 90.0% (90 of 100)" in forced.stdout
