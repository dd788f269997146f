"""Rebuild keel's bundled sample from ../shared/datasets (run from the repository root).

    python tools/make_sample.py [--articles 40]

Writes keel/experiments/sample/wikitext2.jsonl.gz: the first N articles of WikiText-2 (valid split),
one JSON object per article {"title", "text", "source"}. Source and license: NOTICE.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

HEADING = re.compile(r"^ = ([^=].*) = $")
SOURCE = Path("../shared/datasets/wikitext2/valid.txt")
TARGET = Path("keel/experiments/sample/wikitext2.jsonl.gz")


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--articles", type=int, default=40)
    args = parser.parse_args()
    selected = articles(SOURCE.read_text(encoding="utf-8").splitlines())[: args.articles]
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(TARGET, "wb", mtime=0) as raw:
        for title, text in selected:
            row = {"title": title, "text": text, "source": "wikitext2/valid"}
            raw.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
    print(f"wrote {len(selected)} articles to {TARGET}")


if __name__ == "__main__":
    main()
