"""The stage abstraction: a fused chain of map stages reads once, writes once and equals the stages
run one by one; stages found by name, by module:attribute and as entry points; `keel data run`."""

import dataclasses
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from keel.cli.main import app
from keel.core.errors import UsageError
from keel.data import registry
from keel.data.documents import STAGE_FILE, write_texts
from keel.data.extract import run_extract
from keel.data.filter import run_filter
from keel.data.quality import run_quality
from keel.data.runner import run_chain
from keel.flow import RunOptions, TaskFailedError, sinks, sources
from keel.flow.backends import Attempts, run_task_safely

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
SAMPLE = ROOT / "keel" / "experiments" / "sample" / "wikitext2.jsonl.gz"
CHAIN = ("extract", "quality", "filter")


def _pages(directory: Path, parts: int = 2) -> str:
    """HTML pages in `parts` Parquet files: wikitext paragraphs in a page with navigation, a
    null page (missing_html) and short pages (the filter's min_word_count drops them)."""
    with gzip.open(SAMPLE, "rt") as handle:
        texts = [json.loads(line)["text"] for line in handle][:16]
    pages = [
        f"<html><body><nav><a href='/'>Home</a></nav><main><h1>T{n}</h1><p>{text}</p></main>"
        "<footer>Copyright</footer></body></html>"
        for n, text in enumerate(texts)
    ]
    pages[3] = None
    pages[5] = "<html><body><main><p>Too short to keep.</p></main></body></html>"
    pages[11] = "<html><body><main><p>Also short.</p></main></body></html>"
    directory.mkdir()
    size = -(-len(pages) // parts)
    for part in range(parts):
        chunk = pages[part * size : (part + 1) * size]
        urls = [f"https://example.com/{part}/{n}" for n in range(len(chunk))]
        table = pa.table(
            {"url": urls, "html": pa.array(chunk, pa.string()), "source": ["web"] * len(chunk)}
        )
        pq.write_table(table, directory / f"part-{part:05d}-of-{parts:05d}.parquet")
    return str(directory)


class InProcess:
    """A flow backend that runs each task in this process, so that the test can count what the
    tasks read and write (the local backend's workers are other processes)."""

    def run(self, tasks, *, retries, on_done):
        attempts = Attempts(tasks, retries, on_done)
        while attempts.waiting:
            index, attempt = attempts.next()
            attempts.finished(index, run_task_safely(tasks[index], attempt))
        return attempts.ordered_results()

    def close(self) -> None:
        pass


@pytest.fixture
def io_counts(monkeypatch):
    """Parquet files read by flow tasks and Parquet/JSONL files written by them, by path."""
    counts = {"read": [], "written": 0}
    read_parquet, open_file = sources.read_parquet, sinks.FileSink._open

    def counting_read(path, **kwargs):
        counts["read"].append(path)
        return read_parquet(path, **kwargs)

    def counting_open(self):
        counts["written"] += 1
        open_file(self)

    monkeypatch.setattr(sources, "read_parquet", counting_read)
    monkeypatch.setattr(sinks.FileSink, "_open", counting_open)
    return counts


def _table(directory) -> pa.Table:
    parts = sorted(Path(directory).glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(part) for part in parts])


def _counts(report: dict) -> tuple:
    return (
        report["documents_in"],
        report["documents_out"],
        report["dropped"],
        report["dropped_sample"],
    )


def test_a_fused_chain_reads_its_input_once_writes_once_and_equals_the_stages_one_by_one(
    tmp_path, io_counts
):
    pages = _pages(tmp_path / "pages")
    options = RunOptions(backend=InProcess(), progress=False)
    chain = [(registry.stage(name), None) for name in CHAIN]
    fused = run_chain(chain, pages, str(tmp_path / "fused"), options)
    inputs = sorted(str(path) for path in Path(pages).glob("*.parquet"))
    assert sorted(io_counts["read"]) == inputs  # each input file read once, nothing else
    assert io_counts["written"] == len(list((tmp_path / "fused").glob("part-*.parquet"))) == 2

    io_counts["read"].clear()
    run_extract(pages, str(tmp_path / "text"), options=options)
    run_quality(str(tmp_path / "text"), str(tmp_path / "scored"), options=options)
    run_filter(str(tmp_path / "scored"), str(tmp_path / "kept"), options=options)
    assert len(io_counts["read"]) == 6  # one by one: each stage reads the one before
    assert _table(tmp_path / "fused").equals(_table(tmp_path / "kept"))
    one_by_one = [
        json.loads((tmp_path / name / STAGE_FILE).read_text())
        for name in ("text", "scored", "kept")
    ]
    assert [_counts(report) for report in fused.details["stages"]] == [
        _counts(report) for report in one_by_one
    ]
    assert fused.stage == "extract+quality+filter"
    assert fused.documents_in == 16 and fused.documents_out == _table(tmp_path / "kept").num_rows
    assert fused.dropped["missing_html"] == 1 and fused.dropped["min_word_count"] >= 2
    assert sum(fused.dropped.values()) == fused.documents_in - fused.documents_out


def test_the_fused_chain_is_the_same_on_two_worker_processes(tmp_path):
    pages = _pages(tmp_path / "pages", parts=3)
    chain = [(registry.stage(name), None) for name in CHAIN]
    one = run_chain(chain, pages, str(tmp_path / "one"), RunOptions(workers=1, progress=False))
    two = run_chain(chain, pages, str(tmp_path / "two"), RunOptions(workers=2, progress=False))
    assert _table(tmp_path / "one").equals(_table(tmp_path / "two"))
    assert dataclasses.asdict(one) == dataclasses.asdict(two)


def test_a_chain_with_a_wide_stage_runs_group_by_group_and_leaves_no_scratch(tmp_path):
    with gzip.open(SAMPLE, "rt") as handle:
        texts = [json.loads(line)["text"] for line in handle][:12]
    docs = write_texts(tmp_path / "docs", texts + texts[:4], parts=2, source="wiki")
    options = RunOptions(backend=InProcess(), progress=False)
    names = ("quality", "exact_dedup", "filter")
    report = run_chain(
        [(registry.stage(name), None) for name in names], docs, str(tmp_path / "chain"), options
    )
    current = docs
    for name in names:
        run_chain([(registry.stage(name), None)], current, str(tmp_path / name), options)
        current = str(tmp_path / name)
    assert _table(tmp_path / "chain").equals(_table(tmp_path / "filter"))
    assert report.stage == "filter" and report.documents_in == 12  # the last group's report
    assert sorted(os.listdir(tmp_path)) == ["chain", "docs", *sorted(names)]


@pytest.mark.ray
def test_the_fused_chain_is_the_same_on_ray(tmp_path):
    pytest.importorskip("ray")
    pages = _pages(tmp_path / "pages", parts=3)
    chain = [(registry.stage(name), None) for name in CHAIN]
    local = run_chain(chain, pages, str(tmp_path / "local"), RunOptions(workers=2, progress=False))
    on_ray = RunOptions(backend="ray", workers=2, progress=False)
    ray = run_chain(chain, pages, str(tmp_path / "ray"), on_ray)
    assert _table(tmp_path / "local").equals(_table(tmp_path / "ray"))
    assert dataclasses.asdict(local) == dataclasses.asdict(ray)


def test_stages_are_found_by_name_module_and_entry_point(tmp_path, monkeypatch):
    assert registry.stage("filter").kind == "map" and registry.stage("fuzzy_dedup").kind == "wide"
    with pytest.raises(UsageError, match=r"stage 'qualty' \(did you mean 'quality'\?\)"):
        registry.stage("qualty")
    with pytest.raises(UsageError, match=r"no DataKit stage 'nope'.*extract.*fuzzy_dedup"):
        registry.stage("nope")
    monkeypatch.syspath_prepend(str(HERE))
    assert registry.stage("lowercase_stage:LOWERCASE").name == "lowercase"
    with pytest.raises(UsageError, match=r"not a keel\.data\.stage\.Stage"):
        registry.stage("lowercase_stage:LowercaseConfig")
    # an installed package declaring the stage as an entry point
    dist = tmp_path / "site" / "lowercase_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lowercase-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[keel.data.stages]\nlower = lowercase_stage:LOWERCASE\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert registry.stage("lower").name == "lowercase"
    assert "lower" in registry.known_names()


def _keel(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "keel", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_keel_data_run_runs_a_stage_defined_outside_keel(tmp_path):
    docs = tmp_path / "docs.jsonl"
    texts = ["Hello World", "Buy SPAM now", "Eggs and spam", "Plain Text"]
    docs.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    out = tmp_path / "lower"
    ran = _keel(
        "data",
        "run",
        "lowercase_stage:LOWERCASE",
        "-i",
        str(docs),
        "-o",
        str(out),
        "--workers",
        "1",
        "--quiet",
        "--json",
    )
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["stage"] == "lowercase" and report["dropped"] == {"contains_spam": 2}
    assert _table(out).column("text").to_pylist() == ["hello world", "plain text"]
    # with --set STAGE.key=value, and fused with a stage of keel's
    ran = _keel(
        "data", "run", "lowercase_stage:LOWERCASE,quality,filter", "-i", str(docs),
        "-o", str(out), "--set", "lowercase.banned=eggs", "--set", "filter.languages=null",
        "--workers", "1", "--quiet", "--json",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["stage"] == "lowercase+quality+filter"
    assert report["details"]["stages"][0]["dropped"] == {"contains_eggs": 1}
    assert report["details"]["stages"][2]["details"]["config"]["languages"] is None
    assert (
        report["documents_in"] == 4
        and report["documents_out"] + sum(report["dropped"].values()) == 4
    )


def test_keel_data_run_bad_names_and_keys_are_one_line_errors(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "hello"}) + "\n")
    for args, message in [
        (["nope"], "no DataKit stage 'nope'"),
        (["filter", "--set", "min_word_count=1"], "--set 'min_word_count=1': name a stage"),
        (["filter", "--set", "filter.nonsense=1"], "nonsense"),
    ]:
        out = ["-i", str(docs), "-o", str(tmp_path / "out"), "--quiet"]
        ran = CliRunner().invoke(app, ["data", "run", *args, *out])
        assert ran.exit_code == 2, ran.output
        assert message in ran.stderr and len(ran.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "out").exists()


def test_a_chain_that_failed_part_way_resumes_from_the_shards_it_finished(
    tmp_path, io_counts, monkeypatch
):
    monkeypatch.syspath_prepend(str(HERE))
    import lowercase_stage

    docs = tmp_path / "docs"
    for part, texts in enumerate([["One A", "Two SPAM"], ["Three B"], ["Four C", "Five boom"]]):
        write_texts(docs / f"p{part}", texts)
    files = sorted(str(path) for path in docs.glob("p*/*.parquet"))
    chain = [(lowercase_stage.LOWERCASE, None), (registry.stage("quality"), None)]
    options = RunOptions(backend=InProcess(), retries=0, progress=False)
    output = str(tmp_path / "out")
    monkeypatch.setenv(lowercase_stage.FAIL_ON, "boom")
    with pytest.raises(TaskFailedError, match="boom"):
        run_chain(chain, files, output, options)
    assert io_counts["read"] == files and not os.path.exists(output)
    monkeypatch.delenv(lowercase_stage.FAIL_ON)
    io_counts["read"].clear()
    report = run_chain(chain, files, output, options)
    assert io_counts["read"] == files[2:]  # the two finished shards are not read again
    assert report.documents_in == 5 and report.dropped == {"contains_spam": 1}
    fresh = run_chain(chain, files, str(tmp_path / "fresh"), options)
    assert _table(output).equals(_table(tmp_path / "fresh"))
    assert dataclasses.asdict(report) == dataclasses.asdict(fresh)
    assert sorted(os.listdir(tmp_path)) == ["docs", "fresh", "out"]  # no checkpoint left
    # a failed run whose work then changes leaves a checkpoint no run resumes: the next commit
    # into the same output removes it
    monkeypatch.setenv(lowercase_stage.FAIL_ON, "boom")
    with pytest.raises(TaskFailedError):
        run_chain(chain, files, output, options)
    assert any(name.startswith("out.partial-") for name in os.listdir(tmp_path))
    monkeypatch.delenv(lowercase_stage.FAIL_ON)
    run_chain(chain, files[:2], output, options)
    assert sorted(os.listdir(tmp_path)) == ["docs", "fresh", "out"]


def test_docs_list_every_registered_stage_with_its_kind_and_config():
    """docs/data.md's stage table is the registry: a stage added without a row (or a row whose
    kind or config class is stale) fails here."""
    text = (Path(__file__).parents[2] / "docs/data.md").read_text(encoding="utf-8")
    table = text.split("## The stages", 1)[1].split("\n\n| stage |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        name, kind, config = (cell.strip().strip("`") for cell in line.split("|")[1:4])
        rows[name] = (kind, config)
    want = {name: (s.kind, s.config.__name__) for name, s in registry.STAGES.items()}
    assert rows == want
