"""Rebuild keel's bundled samples from ../shared/datasets (run from the repository root).

    python tools/make_sample.py [--articles 40]

Writes into keel/experiments/sample/ (sources and licenses: NOTICE):
- wikitext2.jsonl.gz: the first N articles of WikiText-2 (valid split), {"title", "text", "source"}.
- pydocs.jsonl.gz: the raw HTML of the Python 3.11 documentation's tutorial/ and distutils/ pages
  (30 pages, navigation included), {"url", "html"}, in URL order.
- gsm8k.jsonl.gz: the first 200 problems of GSM8K's test split, {"question", "answer"}: the eval
  set the quickstart decontaminates against.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

HEADING = re.compile(r"^ = ([^=].*) = $")
DATASETS = Path("../shared/datasets")
SAMPLE = Path("keel/experiments/sample")
PYDOCS_SECTIONS = ("/3.11/tutorial/", "/3.11/distutils/")
GSM8K_ITEMS = 200


def articles(lines: list[str]) -> list[tuple[str, str]]:
    """(title, body) pairs: an article starts at a top-level heading line ` = Title = `."""
    found: list[tuple[str, list[str]]] = []
    for line in lines:
        match = HEADING.match(line.rstrip("\n"))
        if match:
            found.append((match.group(1).strip(), []))
        elif found:
            found[-1][1].append(line.strip())
    return [(title, "\n".join(part for part in body if part)) for title, body in found]


def write_jsonl_gz(target: Path, rows: list[dict]) -> None:
    """Rows as gzipped JSON lines, byte-identical on every rebuild (gzip mtime 0)."""
    with gzip.GzipFile(target, "wb", mtime=0) as raw:
        for row in rows:
            raw.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
    print(f"wrote {len(rows)} rows to {target}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--articles", type=int, default=40)
    args = parser.parse_args()
    SAMPLE.mkdir(parents=True, exist_ok=True)
    wikitext = (DATASETS / "wikitext2" / "valid.txt").read_text(encoding="utf-8").splitlines()
    write_jsonl_gz(
        SAMPLE / "wikitext2.jsonl.gz",
        [
            {"title": title, "text": text, "source": "wikitext2/valid"}
            for title, text in articles(wikitext)[: args.articles]
        ],
    )
    with gzip.open(DATASETS / "pydocs" / "pages.jsonl.gz", "rt", encoding="utf-8") as lines:
        pages = [json.loads(line) for line in lines]
    chosen = sorted(
        (page for page in pages if any(part in page["url"] for part in PYDOCS_SECTIONS)),
        key=lambda page: page["url"],
    )
    write_jsonl_gz(
        SAMPLE / "pydocs.jsonl.gz", [{"url": p["url"], "html": p["html"]} for p in chosen]
    )
    with open(DATASETS / "gsm8k" / "test.jsonl", encoding="utf-8") as lines:
        problems = [json.loads(line) for line, _ in zip(lines, range(GSM8K_ITEMS), strict=False)]
    write_jsonl_gz(
        SAMPLE / "gsm8k.jsonl.gz",
        [{"question": p["question"], "answer": p["answer"]} for p in problems],
    )


if __name__ == "__main__":
    main()
