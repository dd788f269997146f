"""HTML -> main text: trafilatura against resiliparse (and keel's extract_text) on real pages.

What it measures, on ../shared/datasets/pydocs/pages.jsonl.gz (530 Sphinx pages of the Python
3.11 docs, 51 MB of HTML with a header bar, breadcrumbs, a sidebar and a footer around the text):

- Speed: pages/s and MB/s (MB of input HTML, 10^6 bytes) of each extractor over all pages in one
  process on one core (this process is pinned to a single CPU where the OS allows), median of
  `--repeats` runs; runs are interleaved (a, b, c, a, b, c, ...) so that noise from other load
  spreads evenly over the contenders.
- Quality against a reference: on these pages the main content is exactly the element
  `<div class="body" role="main">`. The reference text is that element's visible text, taken with
  the standard library's HTMLParser (script/style skipped). Texts are compared as bags of word
  tokens (`\\w+`, lowercased): precision = shared tokens / extracted tokens, recall = shared
  tokens / reference tokens, F1 their harmonic mean; micro-averaged (token counts summed over all
  pages) and the median of per-page F1.
- Boilerplate: for each navigation string ("Table of Contents", "Previous topic", ...) that is not
  in a page's reference text, whether it survives in the extracted text. Reported: the pages
  where any survives, and the surviving (page, string) pairs.
- Empty: pages where the extractor returned nothing.

    pip install "trafilatura>=2.0"   # only to measure; not a keel dependency
    python benchmarks/extract_bench.py [--pages 530] [--repeats 3] [--data PATH]
    python benchmarks/extract_bench.py --smoke   # what CI runs: seconds, no shared data

Prints a Markdown table (and the per-string boilerplate counts) to stdout.

--smoke: the 30 pages bundled with keel (keel/experiments/sample/pydocs.jsonl.gz, the same kind
of pages; ../shared/datasets is not read unless --data names it), 1 repeat, every extractor as
above (trafilatura's two skipped, with one line, when it is not installed).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path

from measure import Peer, runnable_contenders
from resiliparse.extract.html2text import extract_plain_text

from keel.data.extract import extract_text

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "datasets" / "pydocs" / "pages.jsonl.gz"
SMOKE_DATA = REPO / "keel" / "experiments" / "sample" / "pydocs.jsonl.gz"
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
_TOKEN = re.compile(r"\w+")


def _trafilatura(html: str, url: str) -> str | None:
    import trafilatura  # a peer, not a keel dependency: imported when it runs

    return trafilatura.extract(html, url=url, include_comments=False)


def _trafilatura_fast(html: str, url: str) -> str | None:
    import trafilatura

    return trafilatura.extract(html, url=url, include_comments=False, fast=True)


def _resiliparse(html: str, url: str) -> str | None:
    return extract_plain_text(html, main_content=True)


EXTRACTORS: dict[str, Callable[[str, str], str | None]] = {
    "trafilatura 2 (default)": _trafilatura,
    "trafilatura 2 (fast=True)": _trafilatura_fast,
    "resiliparse 2 (main_content)": _resiliparse,
    "keel extract_text": extract_text,
}
TRAFILATURA = Peer("trafilatura", 'pip install "trafilatura>=2.0"')
PEERS = {"trafilatura 2 (default)": TRAFILATURA, "trafilatura 2 (fast=True)": TRAFILATURA}


class _MainText(HTMLParser):
    """The visible text inside `<div role="main">` (Sphinx's div.body), for the reference, and
    the part of it that is link text."""

    _SKIPPED = frozenset({"script", "style"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth = 0  # open <div>s counted from the main one; 0 = outside it
        self.skipping = 0
        self.in_link = 0
        self.parts: list[str] = []
        self.link_parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "div" and (self.depth or ("role", "main") in attrs):
            self.depth += 1
        if self.depth and tag in self._SKIPPED:
            self.skipping += 1
        if self.depth and tag == "a":
            self.in_link += 1

    def handle_endtag(self, tag: str) -> None:
        if self.depth and tag in self._SKIPPED:
            self.skipping = max(0, self.skipping - 1)
        if self.depth and tag == "a":
            self.in_link = max(0, self.in_link - 1)
        if tag == "div" and self.depth:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth and not self.skipping:
            self.parts.append(data)
            if self.in_link:
                self.link_parts.append(data)


def reference_text(html: str) -> tuple[str, float]:
    """The main element's text, and the share of its word tokens that are link text."""
    parser = _MainText()
    parser.feed(html)
    parser.close()
    text = " ".join(parser.parts)
    words = len(_TOKEN.findall(text))
    return text, len(_TOKEN.findall(" ".join(parser.link_parts))) / max(words, 1)


def tokens(text: str) -> Counter[str]:
    return Counter(_TOKEN.findall(text.lower()))


def quality(outputs: list[str | None], references: list[str]) -> dict[str, float]:
    """Token precision/recall/F1 (micro and per-page median), boilerplate and empty counts."""
    shared = extracted = wanted = 0
    page_f1: list[float] = []
    leak_pages = leaks = empty = 0
    for output, reference in zip(outputs, references, strict=True):
        text = output or ""
        empty += not text.strip()
        got, ref = tokens(text), tokens(reference)
        both = sum((got & ref).values())
        shared, extracted, wanted = shared + both, extracted + got.total(), wanted + ref.total()
        page_f1.append(_f1(both, got.total(), ref.total()))
        leaked = [s for s in NAVIGATION if s not in reference and s in text]
        leaks += len(leaked)
        leak_pages += bool(leaked)
    return {
        "precision": shared / extracted if extracted else 0.0,
        "recall": shared / wanted if wanted else 0.0,
        "f1": _f1(shared, extracted, wanted),
        "median_page_f1": statistics.median(page_f1) if page_f1 else 0.0,
        "leak_pages": leak_pages,
        "leaks": leaks,
        "empty": empty,
    }


def leaked_strings(outputs: list[str | None], references: list[str]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for output, reference in zip(outputs, references, strict=True):
        counts.update(s for s in NAVIGATION if s not in reference and s in (output or ""))
    return counts


def _f1(shared: int, extracted: int, wanted: int) -> float:
    if not shared:
        return 0.0
    precision, recall = shared / extracted, shared / wanted
    return 2 * precision * recall / (precision + recall)


LINK_LIST_SHARE = 0.5
"""A page whose main text is more than this share link text is a link list (the general index,
the table of contents), not prose."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="pages (JSONL.gz of url, html)")
    parser.add_argument("--pages", type=int, default=None, help="first N pages (default: all)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--smoke: 1)")
    parser.add_argument(
        "--smoke", action="store_true", help="the bundled pages, 1 repeat, missing peers skipped"
    )
    args = parser.parse_args()
    data = args.data or (SMOKE_DATA if args.smoke else DEFAULT_DATA)
    repeats = args.repeats or (1 if args.smoke else 3)
    extractors = {
        name: EXTRACTORS[name] for name in runnable_contenders(EXTRACTORS, PEERS, args.smoke)
    }
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    with gzip.open(data, "rt", encoding="utf-8") as handle:
        pages = [json.loads(line) for line in handle][: args.pages]
    megabytes = sum(len(p["html"].encode("utf-8")) for p in pages) / 1e6
    references, link_shares = zip(*(reference_text(p["html"]) for p in pages), strict=True)
    prose = [share <= LINK_LIST_SHARE for share in link_shares]

    seconds: dict[str, list[float]] = {name: [] for name in extractors}
    outputs: dict[str, list[str | None]] = {}
    for _ in range(repeats):
        for name, extract in extractors.items():
            start = time.perf_counter()
            result = [extract(p["html"], p["url"]) for p in pages]
            seconds[name].append(time.perf_counter() - start)
            outputs.setdefault(name, result)

    print(
        f"{len(pages)} pages ({sum(prose)} prose, {len(pages) - sum(prose)} link lists), "
        f"{megabytes:.1f} MB of HTML, one core, median of {repeats} runs\n"
    )
    print(
        "| extractor | pages/s | MB/s | precision (prose) | recall (prose) | F1 (prose) "
        "| median page F1 (prose) | F1 (all pages) | recall (link lists) "
        "| pages with nav left | empty |"
    )
    print("| --- |" + " ---: |" * 10)
    for name in extractors:
        took = statistics.median(seconds[name])
        every = quality(outputs[name], list(references))
        good = quality(*_where(prose, outputs[name], references))
        lists = quality(*_where([not p for p in prose], outputs[name], references))
        print(
            f"| {name} | {len(pages) / took:.1f} | {megabytes / took:.2f} "
            f"| {good['precision']:.3f} | {good['recall']:.3f} | {good['f1']:.3f} "
            f"| {good['median_page_f1']:.3f} | {every['f1']:.3f} | {lists['recall']:.3f} "
            f"| {every['leak_pages']} | {every['empty']} |"
        )
    print("\nNavigation strings left, by extractor:\n")
    for name in extractors:
        counts = leaked_strings(outputs[name], list(references))
        print(f"- {name}: " + (", ".join(f"{s!r} {n}" for s, n in counts.most_common()) or "none"))


def _where(mask: list[bool], outputs: list[str | None], references) -> tuple[list, list[str]]:
    return (
        [o for o, keep in zip(outputs, mask, strict=True) if keep],
        [r for r, keep in zip(references, mask, strict=True) if keep],
    )


if __name__ == "__main__":
    main()
