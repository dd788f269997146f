"""A run directory's events.jsonl: what happened to the run besides its steps (re-plans on resume,
and later branches and mid-run changes), one JSON object per line with `event` and `step`.

Object stores cannot append, so an event rewrites the (small) file; only process 0 writes it.
"""

from __future__ import annotations

import json
from typing import Any

from keel.core import paths

EVENTS_FILE = "events.jsonl"


def read_events(run_dir: str, kind: str | None = None) -> list[dict[str, Any]]:
    """The run's events in order (only those whose `event` is `kind`, when given)."""
    path = paths.join(run_dir, EVENTS_FILE)
    if not paths.exists(path):
        return []
    events = [json.loads(line) for line in paths.read_text(path).splitlines() if line.strip()]
    return [event for event in events if kind is None or event.get("event") == kind]


def append_event(run_dir: str, event: dict[str, Any]) -> None:
    """Add `event` (JSON-able, with `event` and `step`) at the end of the run's events."""
    lines = [json.dumps(old) for old in read_events(run_dir)]
    lines.append(json.dumps(event))
    paths.write_text(paths.join(run_dir, EVENTS_FILE), "\n".join(lines) + "\n")
