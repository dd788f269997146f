"""Every DataKit stage reads JSONL (plain, .gz, .zst), Parquet and text files directly, and does
the same to the same documents whichever form they come in."""

import dataclasses
import gzip
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from keel.core.errors import KeelError, UsageError
from keel.data.decontam import DecontamConfig, EvalSet, run_decontam
from keel.data.dedup import run_exact_dedup
from keel.data.documents import document_id
from keel.data.embed import EmbedConfig, run_embed
from keel.data.extract import run_extract
from keel.data.filter import FilterConfig, run_filter
from keel.data.fuzzy import FuzzyDedupConfig, run_fuzzy_dedup
from keel.data.inputs import read_documents
from keel.data.mix import MixConfig, MixSource, run_mix
from keel.data.quality import run_quality
from keel.data.tokenize import TokenizeConfig, run_tokenize
from keel.flow import LocalBackend, RunOptions

FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "txt")
QUESTION = "what is the capital of the country whose flag has a red maple leaf on it today"


def _texts() -> list[str]:
    rng = random.Random(0)
    words = [f"w{n}" for n in range(400)]
    texts = [" ".join(rng.sample(words, 60)) for _ in range(12)]
    texts.append(texts[0])  # an exact copy
    near = texts[1].split()
    near[30] = "changed"
    texts.append(" ".join(near))  # a near copy
    texts.append("the leak: " + QUESTION + " and more words after it")  # contaminated
    return texts


@pytest.fixture(scope="module")
def pool():
    with LocalBackend(workers=2) as backend:
        yield RunOptions(backend=backend)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """The same 15 texts as each input form: name -> the path or glob a stage is given."""
    root = tmp_path_factory.mktemp("inputs")
    texts = _texts()
    lines = "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()
    (root / "docs.jsonl").write_bytes(lines)
    (root / "docs.jsonl.gz").write_bytes(gzip.compress(lines))
    (root / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"text": texts}), root / "docs.parquet")
    (root / "txt").mkdir()
    for number, text in enumerate(texts):
        (root / "txt" / f"{number:02d}.txt").write_text(text)
    (root / "eval.jsonl").write_text(json.dumps({"question": QUESTION}) + "\n")
    forms = {name: str(root / f"docs.{name}") for name in FORMATS[:4]}
    return {**forms, "txt": str(root / "txt" / "*.txt"), "eval": str(root / "eval.jsonl")}


def _ids(directory) -> list[str]:
    files = sorted(directory.glob("part-*.parquet"))
    return sorted(pq.read_table(files, columns=["id"]).column("id").to_pylist()) if files else []


@pytest.mark.parametrize("form", FORMATS)
def test_dedup_decontam_quality_and_tokenize_read_every_form(form, inputs, tmp_path, pool):
    source = inputs[form]
    texts = _texts()
    exact = run_exact_dedup(source, str(tmp_path / "exact"), options=pool)
    assert exact.dropped == {"exact_duplicate": 1}
    assert _ids(tmp_path / "exact") == sorted({document_id(text) for text in texts})

    fuzzy = run_fuzzy_dedup(source, str(tmp_path / "fuzzy"), FuzzyDedupConfig(), options=pool)
    assert fuzzy.dropped == {"near_duplicate": 2}  # the exact copy and the near one

    config = DecontamConfig(eval_sets=(EvalSet(inputs["eval"]),))
    clean = run_decontam(source, str(tmp_path / "clean"), config, options=pool)
    assert (clean.documents_in, clean.documents_out) == (15, 14)

    scored = run_quality(source, str(tmp_path / "scored"), options=pool)
    assert scored.documents_out == 15
    columns = pq.read_schema(next((tmp_path / "scored").glob("part-*.parquet"))).names
    assert {"id", "text", "language", "word_count"} <= set(columns)

    tokens = run_tokenize(source, str(tmp_path / "tokens"), TokenizeConfig(vocab_size=300), pool)
    assert tokens.documents_out == 15 and tokens.details["tokens"] > 15 * 60


def test_embed_mix_filter_and_extract_read_jsonl_directly(inputs, tmp_path, pool):
    source = inputs["jsonl.zst"]
    embedded = run_embed(source, str(tmp_path / "embed"), EmbedConfig(clusters=2), pool)
    assert embedded.documents_out == 15

    mixed = run_mix(MixConfig((MixSource(inputs["txt"], 1.0, "text"),)), str(tmp_path / "mix"))
    assert mixed.documents_in == 15

    rows = [{"text": f"doc {n}", "word_count": n * 10, "language": "en"} for n in range(10)]
    attributes = tmp_path / "scored.jsonl.gz"
    attributes.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    off = {field.name: None for field in dataclasses.fields(FilterConfig)}
    config = FilterConfig(**{**off, "min_word_count": 45, "languages": ("en",)})
    kept = run_filter(str(attributes), str(tmp_path / "filter"), config, pool)
    assert (kept.documents_out, kept.dropped) == (5, {"min_word_count": 5})

    pages = tmp_path / "pages.jsonl"
    html = "<html><body><nav>Home | About</nav><main><p>{}</p></main></body></html>"
    body = "A paragraph of real prose, long enough to be the main text of the page. " * 3
    pages.write_text(json.dumps({"html": html.format(body), "url": "https://x.org/a"}) + "\n")
    extracted = run_extract(str(pages), str(tmp_path / "extract"), options=pool)
    text = pq.read_table(next((tmp_path / "extract").glob("part-*.parquet"))).column("text")
    assert extracted.documents_out == 1 and "real prose" in text[0].as_py()


def test_a_jsonl_record_without_text_and_an_unknown_suffix_are_one_line_errors(tmp_path, pool):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(KeelError, match=r"bad\.jsonl: a record has no string 'text' field"):
        read_documents(str(bad)).to_table(pool)
    with pytest.raises(UsageError, match=r"cannot tell the format of .*docs\.csv\.gz"):
        read_documents(str(tmp_path / "docs.csv.gz"))


def test_a_single_text_or_ndjson_file_is_read_as_a_file_and_a_raw_directory_gets_a_hint(
    inputs, tmp_path, pool
):
    texts = _texts()
    one = tmp_path / "one.txt"
    one.write_text(texts[0])
    assert run_exact_dedup(str(one), str(tmp_path / "a"), options=pool).documents_out == 1
    records = tmp_path / "docs.ndjson"
    records.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    report = run_exact_dedup(str(records), str(tmp_path / "b"), options=pool)
    assert (report.documents_in, report.dropped) == (15, {"exact_duplicate": 1})
    raw = inputs["txt"].removesuffix("/*.txt")  # a directory of .txt files, not a document set
    with pytest.raises(UsageError, match=r"holds 00\.txt, 01\.txt, 02\.txt, \.\.\.: .* glob"):
        run_exact_dedup(raw, str(tmp_path / "c"), options=pool)
