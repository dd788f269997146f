"""The fenced code blocks of README.md and docs/**/*.md, and the mark each info string carries.

A block's info string is its language and then one mark: ```` ```bash run ```` (the docs test
executes it), ```` ```python excerpt ```` (shown only: part of a longer program, output, or a line
with placeholders), or ```` ```bash skip=slurm ```` (needs something CI does not have; the word
after `skip=` says what). Only shell and Python blocks need a mark; YAML, text and bare blocks are
data or output and are never run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHELL_LANGUAGES = frozenset({"bash", "sh", "shell", "console"})
PYTHON_LANGUAGES = frozenset({"python", "py"})
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_SKIP = re.compile(r"^skip=[a-z0-9][a-z0-9-]*$")
_SAVED_AS = re.compile(r"^#\s*(?P<name>[\w.-]+\.py)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts (1-based line of its opening fence), its language and
    mark (None when its info string carries none), and its text."""

    doc: Path
    line: int
    language: str
    mark: str | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    @property
    def is_shell(self) -> bool:
        return self.language in SHELL_LANGUAGES

    @property
    def needs_mark(self) -> bool:
        return self.is_shell or self.language in PYTHON_LANGUAGES

    @property
    def saved_as(self) -> str | None:
        """A Python block whose first line is `# NAME.py` is that file (later blocks may run it)."""
        first = self.text.split("\n", 1)[0]
        found = _SAVED_AS.match(first)
        return found["name"] if found else None


def documents() -> list[Path]:
    """README.md and every Markdown file under docs/, in a stable order."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _mark(words: list[str]) -> str | None:
    marks = [word for word in words if word in ("run", "excerpt") or _SKIP.match(word)]
    return marks[0] if len(marks) == 1 else None


def _closes(line: str, fence: str) -> bool:
    """Whether `line` closes a block opened by `fence`: the same character, at least as many."""
    stripped = line.strip()
    return len(stripped) >= len(fence) and stripped == fence[0] * len(stripped)


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order."""
    lines = doc.read_text(encoding="utf-8").split("\n")
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None or ("`" in opening["fence"] and "`" in opening["info"]):
            # CommonMark: a backtick fence's info string holds no backtick (else: inline code)
            index += 1
            continue
        fence, words = opening["fence"], opening["info"].split()
        end = index + 1
        while end < len(lines) and not _closes(lines[end], fence):
            end += 1
        body = [line.removeprefix(opening["indent"]) for line in lines[index + 1 : end]]
        language = words[0].lower() if words else ""
        found.append(Block(doc, index + 1, language, _mark(words[1:]), "\n".join(body) + "\n"))
        index = end + 1
    return found
