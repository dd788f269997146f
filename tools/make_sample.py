"""Rebuild keel's bundled samples from ../shared/datasets (run from the repository root).

    python tools/make_sample.py [--articles 40]

Writes into keel/experiments/sample/ (sources and licenses: NOTICE):
- wikitext2.jsonl.gz: the first N articles of WikiText-2 (valid split), {"title", "text", "source"}.
- pydocs.jsonl.gz: the raw HTML of the Python 3.11 documentation's tutorial/ and distutils/ pages
  (30 pages, navigation included), {"url", "html"}, in URL order.
- gsm8k.jsonl.gz: the first 200 problems of GSM8K's test split, {"question", "answer"}: the eval
  set the quickstart decontaminates against.
- crawl.jsonl.gz: raw HTML pages as a web crawl returns them, {"url", "html"}, so that every
  quickstart stage has something to remove: MIRRORED articles of the WikiText sample republished
  by a mirror site (its own navigation and footer, the last paragraph cut: near duplicates), a
  Python docs page outside the pydocs sample fetched twice under two URLs (exact duplicates),
  and a worksheet page that quotes LEAKED GSM8K problems with their answers (contamination),
  and a SPAM page whose text is the words of a WikiText article outside the sample in random
  order (keyword stuffing: Gopher's heuristics pass it, the quality classifier does not).
"""

from __future__ import annotations

import argparse
import gzip
import html
import json
import random
import re
from pathlib import Path

HEADING = re.compile(r"^ = ([^=].*) = $")
DATASETS = Path("../shared/datasets")
SAMPLE = Path("keel/experiments/sample")
PYDOCS_SECTIONS = ("/3.11/tutorial/", "/3.11/distutils/")
GSM8K_ITEMS = 200
MIRRORED = (2, 8, 13, 30)
"""Articles of the WikiText sample (0-based) the crawl's mirror site republishes."""
LEAKED = (4, 17, 42)
"""GSM8K sample problems (0-based) the crawl's worksheet page quotes."""
SPAM = 45
"""The WikiText valid article (0-based, outside the sample) whose shuffled words the spam page
holds."""
SPAM_SEED = 0
TWICE = "https://docs.python.org/3.11/howto/sorting.html"
"""The Python docs page the crawl fetched under two URLs."""
MIRROR_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title} - WikiMirror</title></head>
<body>
<nav><a href="/">WikiMirror</a> | <a href="/random">Random article</a>
| <a href="/login">Log in</a></nav>
<div id="content"><h1>{title}</h1>
{paragraphs}
</div>
<footer><p>This page is a copy of a Wikipedia article. Text is available under the Creative
Commons Attribution-ShareAlike License.</p><p>Mirror last updated 2024.</p></footer>
</body></html>
"""
SPAM_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Top 10 reviews of the year</title></head>
<body>
<nav><a href="/">Best Deals</a> | <a href="/reviews">Reviews</a></nav>
<div id="content"><h1>Top 10 reviews of the year</h1>
{paragraphs}
</div>
<footer><p>Best Deals earns a commission on purchases.</p></footer>
</body></html>
"""
WORKSHEET_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Grade school maths practice with answers</title></head>
<body>
<nav><a href="/">Homework help</a> | <a href="/worksheets">Worksheets</a></nav>
<div id="content"><h1>Word problems with worked answers</h1>
<p>Here are some word problems our students found useful before their exams. Try each one
yourself first, then check the worked answer below it.</p>
{problems}
</div>
<footer><p>Copyright Homework help. All rights reserved.</p></footer>
</body></html>
"""


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
    crawled = crawl(articles(wikitext), args.articles, pages, problems)
    write_jsonl_gz(SAMPLE / "crawl.jsonl.gz", crawled)


def crawl(
    articles: list[tuple[str, str]], sampled: int, pages: list[dict], problems: list[dict]
) -> list[dict]:
    """The crawl's pages: mirrors of MIRRORED articles (of the first `sampled`), TWICE under two
    URLs, the worksheet, the spam page."""
    if sampled > SPAM:
        raise SystemExit(f"--articles {sampled}: the spam article {SPAM} must be outside it")
    rows = []
    for index in MIRRORED:
        title, text = articles[index]
        kept = text.split("\n")[:-1] or text.split("\n")
        paragraphs = "\n".join(f"<p>{html.escape(part)}</p>" for part in kept)
        page = MIRROR_PAGE.format(title=html.escape(title), paragraphs=paragraphs)
        slug = re.sub(r"\W+", "_", title).strip("_")
        rows.append({"url": f"https://wikimirror.example/wiki/{slug}", "html": page})
    sorting = next(page for page in pages if page["url"] == TWICE)
    rows.append({"url": TWICE, "html": sorting["html"]})
    rows.append({"url": TWICE + "?highlight=sort", "html": sorting["html"]})
    quoted = "\n".join(
        f"<h2>Problem {number}</h2>\n<p>{html.escape(problems[index]['question'])}</p>\n"
        f"<p>Answer: {html.escape(problems[index]['answer'])}</p>"
        for number, index in enumerate(LEAKED, 1)
    )
    rows.append(
        {"url": "https://homework.example/worksheets/word-problems",
         "html": WORKSHEET_PAGE.format(problems=quoted)}
    )  # fmt: skip
    words = articles[SPAM][1].split()
    random.Random(SPAM_SEED).shuffle(words)
    stuffed = "\n".join(
        f"<p>{html.escape(' '.join(words[start : start + 120]))}</p>"
        for start in range(0, len(words), 120)
    )
    rows.append(
        {"url": "https://best-deals.example/top-10-reviews",
         "html": SPAM_PAGE.format(paragraphs=stuffed)}
    )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
