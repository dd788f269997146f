"""Ingest: every input format from real files, ids, drop counting, determinism."""

import gzip
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from warcio.archiveiterator import ArchiveIterator
from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

from keel.core.errors import UsageError
from keel.data import documents
from keel.data.ingest import IngestConfig, run_ingest
from keel.flow import LocalBackend, RunOptions

PYDOCS = Path(__file__).resolve().parents[3] / "shared/datasets/pydocs/pages.jsonl.gz"
PARAGRAPH = "A real paragraph of text that a reader came to this page for. " * 8
NAVIGATION = ("Previous topic", "Next topic", "This Page", "Show Source", "Report a Bug")


@pytest.fixture(scope="module")
def options():
    with LocalBackend(workers=2) as pool:
        yield RunOptions(backend=pool)


def documents_of(directory: Path) -> list[dict]:
    parts = sorted(directory.glob("part-*.parquet"))
    return [row for part in parts for row in pq.read_table(part).to_pylist()]


def page(title: str, body: str = PARAGRAPH) -> str:
    return (
        f"<html><head><title>{title}</title></head><body>"
        "<nav><a href='/'>Home</a> | <a href='/a'>About</a> | <a href='/c'>Contact</a></nav>"
        f"<main><h1>{title}</h1><p>{body}</p></main>"
        "<footer>Copyright Example Corp. Privacy policy.</footer></body></html>"
    )


def test_jsonl_records_become_normalized_documents_and_bad_records_are_counted(tmp_path, options):
    lines = [
        json.dumps({"text": "First line\r\nsecond line  \n", "url": "https://a.example/1"}),
        json.dumps({"text": "Cafe\u0301 \x00menu"}),  # NFD accent and a NUL byte
        json.dumps({"url": "https://a.example/no-text"}),
        json.dumps({"text": None, "url": "https://a.example/null"}),
        json.dumps({"text": " \r\n\t\x07 ", "url": "https://a.example/blank"}),
        "{this is not json",
    ]
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl.zst").write_bytes(zstandard.compress("\n".join(lines).encode()))
    (raw / "b.jsonl").write_text(json.dumps({"text": "Plain file.", "url": 7}) + "\n")

    report = run_ingest(str(raw / "*"), str(tmp_path / "out"), options=options)

    docs = documents_of(tmp_path / "out")
    assert [d["text"] for d in docs] == ["First line\nsecond line", "Café menu", "Plain file."]
    assert all(d["id"] == documents.document_id(d["text"]) for d in docs)
    assert [d["url"] for d in docs] == ["https://a.example/1", None, None]
    assert [d["source"] for d in docs] == [str(raw / "a.jsonl.zst")] * 2 + [str(raw / "b.jsonl")]
    assert report.dropped == {"missing_text": 2, "empty_after_normalization": 1, "invalid_json": 1}
    assert report.dropped_sample["missing_text"] == [
        "https://a.example/no-text",
        "https://a.example/null",
    ]
    assert (report.documents_in, report.documents_out) == (7, 3)
    assert documents.StageReport.read(str(tmp_path / "out")) == report
    [malformed] = report.details["malformed_sample"]
    assert malformed.startswith(f"{raw / 'a.jsonl.zst'}:6: not valid JSON")


def test_parquet_with_named_text_column(tmp_path, options):
    table = pa.table(
        {
            "content": ["One document.", None, "Another document."],
            "link": ["https://p.example/1", "https://p.example/2", None],
            "other": [1, 2, 3],
        }
    )
    pq.write_table(table, tmp_path / "docs.parquet")
    config = IngestConfig(text_field="content", url_field="link", source="my-corpus")

    report = run_ingest(str(tmp_path / "docs.parquet"), str(tmp_path / "out"), config, options)

    docs = documents_of(tmp_path / "out")
    assert [(d["text"], d["url"], d["source"]) for d in docs] == [
        ("One document.", "https://p.example/1", "my-corpus"),
        ("Another document.", None, "my-corpus"),
    ]
    assert list(docs[0]) == ["id", "text", "source", "url"]
    assert report.dropped == {"missing_text": 1}
    assert report.dropped_sample == {"missing_text": ["https://p.example/2"]}


def test_text_files_one_document_each(tmp_path, options):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.txt").write_text("\ufeffAlpha text.\r\n")  # a BOM and CRLF
    (raw / "b.txt.gz").write_bytes(gzip.compress(b"Beta text."))
    (raw / "c.txt").write_bytes(b"caf\xe9")  # Latin-1, not UTF-8
    (raw / "d.txt").write_text("   \n\n")
    cut = gzip.compress(" ".join(map(str, range(2000))).encode())
    (raw / "e.txt.gz").write_bytes(cut[: len(cut) // 2])

    report = run_ingest(str(raw / "*.txt*"), str(tmp_path / "out"), options=options)

    docs = documents_of(tmp_path / "out")
    assert [(d["text"], Path(d["source"]).name) for d in docs] == [
        ("Alpha text.", "a.txt"),
        ("Beta text.", "b.txt.gz"),
    ]
    assert all(d["id"] == documents.document_id(d["text"]) for d in docs)
    assert report.dropped == {
        "empty_after_normalization": 1,
        "invalid_utf8": 1,
        "unreadable_file": 1,
    }
    assert [Path(p).name for p in report.dropped_sample["invalid_utf8"]] == ["c.txt"]


def test_html_pages_from_pydocs_lose_their_navigation(tmp_path, options):
    with gzip.open(PYDOCS, "rt", encoding="utf-8") as handle:
        pages = [json.loads(next(handle)) for _ in range(2)]
    pages.append({"url": "https://e.example/empty", "html": "<html><body></body></html>"})
    pages.append({"url": "https://e.example/none"})
    path = tmp_path / "pages.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(p) + "\n" for p in pages).encode()))

    report = run_ingest(str(path), str(tmp_path / "out"), IngestConfig(html_field="html"), options)

    docs = documents_of(tmp_path / "out")
    assert [d["url"] for d in docs] == [pages[0]["url"], pages[1]["url"]]
    assert docs[0]["text"].startswith("About these documents\n")
    assert not [s for s in NAVIGATION for d in docs if s in d["text"]]
    assert all(d["id"] == documents.document_id(d["text"]) for d in docs)
    assert report.dropped == {"missing_html": 1, "no_main_text": 1}


def write_warc(path: Path, records: list[tuple[str, str, str, bytes]]) -> None:
    """(url, HTTP status line, content type, body) -> response records, each after a request."""
    with open(path, "wb") as handle:
        writer = WARCWriter(handle, gzip=path.suffix == ".gz")
        for url, status, content_type, body in records:
            request = StatusAndHeaders("GET / HTTP/1.1", [("Host", "x")], is_http_request=True)
            writer.write_record(writer.create_warc_record(url, "request", http_headers=request))
            headers = StatusAndHeaders(status, [("Content-Type", content_type)], "HTTP/1.1")
            writer.write_record(
                writer.create_warc_record(
                    url, "response", payload=io.BytesIO(body), http_headers=headers
                )
            )


def test_warc_html_responses_become_documents(tmp_path, options):
    latin = page("Crème brûlée").encode("cp1252")
    write_warc(
        tmp_path / "crawl.warc.gz",
        [
            ("https://w.example/1", "200 OK", "text/html; charset=utf-8", page("First").encode()),
            ("https://w.example/2", "200 OK", "text/html; charset=windows-1252", latin),
            ("https://w.example/3", "404 Not Found", "text/html", page("Missing").encode()),
            ("https://w.example/4", "200 OK", "image/png", b"\x89PNG..."),
            ("https://w.example/5", "200 OK", "application/xhtml+xml", page("Fifth").encode()),
        ],
    )

    report = run_ingest(str(tmp_path / "*.warc.gz"), str(tmp_path / "out"), options=options)

    docs = documents_of(tmp_path / "out")
    assert [d["url"] for d in docs] == [
        "https://w.example/1",
        "https://w.example/2",
        "https://w.example/5",
    ]
    assert docs[1]["text"].startswith("Crème brûlée\n")
    assert all(PARAGRAPH.strip() in d["text"] for d in docs)
    assert not [d for d in docs if "Home" in d["text"] or "Privacy" in d["text"]]
    assert all(d["source"].endswith("crawl.warc.gz") for d in docs)
    assert report.dropped == {"http_status": 1, "not_html": 1}
    assert report.dropped_sample == {
        "http_status": ["https://w.example/3"],
        "not_html": ["https://w.example/4"],
    }


@pytest.mark.parametrize("name", ["cut.warc", "cut.warc.gz"])
def test_truncated_warc_keeps_its_complete_records(tmp_path, options, name):
    records = [
        (f"https://t.example/{i}", "200 OK", "text/html", page(f"P{i}").encode()) for i in range(6)
    ]
    write_warc(tmp_path / name, records)
    with open(tmp_path / name, "rb") as handle:  # where the third response starts and ends
        records = ArchiveIterator(handle)
        spans = [(records.get_record_offset(), records.get_record_length()) for _ in records]
    start, length = spans[5]  # request, response, request, response, request, response
    data = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(data[: start + length // 2])

    report = run_ingest(str(tmp_path / name), str(tmp_path / "out"), options=options)

    docs = documents_of(tmp_path / "out")
    assert [d["url"] for d in docs] == ["https://t.example/0", "https://t.example/1"]
    assert report.dropped == {"unreadable_warc": 1}
    assert report.documents_in == 3


@pytest.mark.parametrize("format", ["jsonl", "warc"])
def test_output_is_byte_identical_for_one_and_two_workers(tmp_path, format):
    raw = tmp_path / "raw"
    raw.mkdir()
    for number in range(3):
        if format == "jsonl":
            lines = [json.dumps({"text": f"doc {number}-{i} " * 5}) for i in range(40)]
            lines.append(json.dumps({"text": ""}))
            (raw / f"{number}.jsonl").write_text("\n".join(lines))
        else:
            pages = [(f"https://d.example/{number}/{i}", page(f"D{number}-{i}")) for i in range(9)]
            records = [(url, "200 OK", "text/html", html.encode()) for url, html in pages]
            write_warc(
                raw / f"{number}.warc.gz",
                [*records, ("https://d.example/x", "200 OK", "text/css", b"")],
            )
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        run_ingest(str(raw / "*"), str(out), options=RunOptions(workers=workers))
        outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outputs[0] == outputs[1]
    assert sorted(outputs[0]) == [
        "_SUCCESS",
        "part-00000-of-00003.parquet",
        "part-00001-of-00003.parquet",
        "part-00002-of-00003.parquet",
        "stage.json",
    ]
    assert json.loads(outputs[0]["stage.json"])["documents_out"] == 3 * (
        40 if format == "jsonl" else 9
    )


def test_user_mistakes_are_usage_errors(tmp_path):
    (tmp_path / "a.csv").write_text("text\nhello\n")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(UsageError, match="cannot tell the format"):
        run_ingest(str(tmp_path / "a.csv"), str(tmp_path / "out"))
    with pytest.raises(UsageError, match="no column 'text'"):
        run_ingest(str(tmp_path / "c.parquet"), str(tmp_path / "out"))
    with pytest.raises(UsageError, match="is a directory"):
        run_ingest(str(tmp_path), str(tmp_path / "out"))
    with pytest.raises(UsageError, match="format must be one of"):
        IngestConfig(format="csv")
