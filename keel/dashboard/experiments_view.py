"""The dashboard's experiments view: the experiment records of a project (keel.records) and the
reports `keel experiment report` wrote for them.

Records live in `experiments/` of the project (`--experiments DIR`; default ./experiments when
it exists). A report is served as the self-contained page the command wrote (figures embedded),
never regenerated here: the dashboard only reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from keel.core.errors import UsageError
from keel.records.record import ExperimentRecord, find_record, list_records
from keel.records.report import HTML_FILE, REPORT_DIR
from keel.records.runs import FAILED, STOPPED, read_invocations


def list_experiments(root: Path | None) -> list[dict[str, Any]]:
    """One row per record, newest first: id, name, hypothesis, issue, status, created, runs (the
    `keel run` invocations made for it), failed (of those, how many failed or were stopped) and
    report (whether `keel experiment report` has written report.html)."""
    if root is None:
        return []
    rows = []
    for record in reversed(list_records(root)):
        invocations = read_invocations(record)
        rows.append(
            {
                "id": record.id,
                "name": record.name,
                "hypothesis": record.hypothesis,
                "issue": record.issue,
                "status": record.status,
                "created": record.created,
                "runs": len(invocations),
                "failed": sum(1 for run in invocations if run.outcome in (FAILED, STOPPED)),
                "report": _report_page(record).is_file(),
            }
        )
    return rows


def report_page(root: Path | None, key: str) -> Path:
    """The report.html of record `key`; UsageError when there is no such record or report."""
    if root is None:
        raise UsageError("no experiment records here: start the dashboard with --experiments DIR")
    record = find_record(root, key)
    page = _report_page(record)
    if not page.is_file():
        raise UsageError(
            f"experiment {record.id} has no report yet: run `keel experiment report {record.id}`"
        )
    return page


def _report_page(record: ExperimentRecord) -> Path:
    return record.directory / REPORT_DIR / HTML_FILE
