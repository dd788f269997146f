"""HTML -> main text on real pages, charset handling, and the extract stage."""

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keel.core.errors import UsageError
from keel.data import documents
from keel.data.extract import ExtractConfig, decode_html, extract_text, run_extract
from keel.flow import RunOptions

PYDOCS = Path(__file__).resolve().parents[3] / "shared/datasets/pydocs/pages.jsonl.gz"
NAVIGATION = (
    "Table of Contents",
    "Previous topic",
    "Next topic",
    "This Page",
    "Report a Bug",
    "Show Source",
    "Navigation",
    "Quick search",
)


def pydocs_pages(count: int) -> list[dict]:
    with gzip.open(PYDOCS, "rt", encoding="utf-8") as handle:
        return [json.loads(next(handle)) for _ in range(count)]


def test_extract_text_keeps_the_main_text_of_a_real_page_and_drops_its_navigation():
    [about] = pydocs_pages(1)
    assert about["url"].endswith("/about.html")
    assert all(string in about["html"] for string in NAVIGATION)

    text = extract_text(about["html"], about["url"])

    assert text.splitlines()[0] == "About these documents"
    assert (
        "These documents are generated from reStructuredText sources by Sphinx, a document "
        "processor specifically written for the Python documentation." in text
    )
    assert [string for string in NAVIGATION if string in text] == []
    assert "3.11.2 Documentation" not in text  # the breadcrumb bar


def test_extract_text_is_none_without_main_text():
    assert extract_text("") is None
    assert extract_text("<html><body><nav><a href='/'>Home</a></nav></body></html>") is None


def test_decode_html_prefers_the_header_charset_then_utf8_then_detection():
    page = "<html><body><p>Crème brûlée, façade, naïve</p></body></html>"
    assert decode_html(page.encode("cp1252"), "text/html; charset=windows-1252") == page
    assert decode_html(page.encode("utf-8"), "text/html") == page
    meta = f'<html><head><meta charset="windows-1252"></head>{page}</html>'
    assert decode_html(meta.encode("cp1252")) == meta


def test_run_extract_replaces_html_with_text_and_keeps_other_columns(tmp_path):
    pages = pydocs_pages(2)
    table = pa.table(
        {
            "url": [pages[0]["url"], pages[1]["url"], "https://e.example/empty", None],
            "html": [pages[0]["html"], pages[1]["html"], "<html><body></body></html>", None],
            "crawl": ["cc-1", "cc-1", "cc-2", "cc-2"],
            "source": ["pydocs"] * 4,
        }
    )
    (tmp_path / "pages").mkdir()
    pq.write_table(table, tmp_path / "pages" / "part-00000-of-00001.parquet")

    report = run_extract(
        str(tmp_path / "pages"), str(tmp_path / "docs"), options=RunOptions(workers=1)
    )

    out = pq.read_table(tmp_path / "docs" / "part-00000-of-00001.parquet")
    assert out.column_names == ["id", "text", "url", "crawl", "source"]
    docs = out.to_pylist()
    assert [d["url"] for d in docs] == [pages[0]["url"], pages[1]["url"]]
    assert docs[0]["text"].startswith("About these documents\n")
    assert all(d["id"] == documents.document_id(d["text"]) for d in docs)
    assert report.dropped == {"missing_html": 1, "no_main_text": 1}
    assert report.dropped_sample["no_main_text"] == ["https://e.example/empty"]
    assert (report.documents_in, report.documents_out) == (4, 2)


def test_run_extract_needs_the_html_column(tmp_path):
    pq.write_table(pa.table({"page": ["<p>x</p>"]}), tmp_path / "pages.parquet")
    with pytest.raises(UsageError, match="html_field"):
        run_extract(str(tmp_path / "pages.parquet"), str(tmp_path / "out"))
    config = ExtractConfig(html_field="page", keep_html=True)
    report = run_extract(
        str(tmp_path / "pages.parquet"), str(tmp_path / "out"), config, RunOptions(workers=1)
    )
    assert report.documents_out == 1
    out = pq.read_table(tmp_path / "out" / "part-00000-of-00001.parquet").to_pylist()
    assert out == [{"id": documents.document_id("x"), "text": "x", "page": "<p>x</p>"}]
