"""DataKit stage funnels: documents and bytes in, kept, dropped by reason, for each stage output
under the prefix (a directory with stage.json). Documents and drops are stage.json's numbers
(StageReport); bytes are `keel data stats`' (UTF-8 bytes of the text column, keel.data.stats):
bytes kept of the stage's output, bytes in of the inputs its step record names. Committed
outputs never change, so each directory's stats are computed once per process.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from keel.dashboard.sources import Sources
from keel.data.documents import STAGE_FILE, StageReport
from keel.data.stats import data_stats
from keel.steps.store import StepStore


def stage_funnels(sources: Sources) -> list[dict[str, Any]]:
    """One funnel per stage output, in the order the stages ended: step (directory name), stage,
    documents_in, documents_out, dropped {reason: documents}, bytes_in (None when no input is
    under the prefix), bytes_out (None for a token cache), tokens (a token cache's, else None)."""
    if sources.root is None:
        return []
    store = StepStore(str(sources.root))
    records = {entry.dir_name: entry.record for entry in store.entries() if entry.has_output}
    funnels = []
    for directory in sorted(path for path in sources.root.iterdir() if path.is_dir()):
        if not (directory / STAGE_FILE).is_file():
            continue
        report = StageReport.read(str(directory))
        stats = _stats(str(directory))
        record = records.get(directory.name)
        inputs = [
            sources.root / Path(dependency["output"]).name
            for dependency in (record.dependencies if record is not None else [])
        ]
        inputs = [path for path in inputs if (path / STAGE_FILE).is_file()]
        bytes_in = [_stats(str(path))["bytes"] for path in inputs]
        funnels.append(
            {
                "step": directory.name,
                "stage": report.stage,
                "documents_in": report.documents_in,
                "documents_out": report.documents_out,
                "dropped": dict(report.dropped),
                "bytes_in": sum(bytes_in) if bytes_in and None not in bytes_in else None,
                "bytes_out": stats["bytes"],
                "tokens": stats["tokens"],
                "ended": record.end_time if record is not None else None,
            }
        )
    return sorted(funnels, key=lambda funnel: (funnel["ended"] or "", funnel["step"]))


@functools.lru_cache(maxsize=1024)
def _stats(directory: str) -> dict[str, int | None]:
    stats = data_stats(directory)
    return {"bytes": stats.bytes, "tokens": stats.tokens}
