"""A DataKit stage: a name, a config dataclass and a function, of one of two kinds.

- "map": `batches(config)` returns a picklable function of one pyarrow RecordBatch of documents
  -> Mapped (the kept rows, transformed, and the dropped rows' reasons). A map stage never looks
  beyond its batch (extract, quality, filter), so consecutive map stages fuse into one flow pass:
  the input is read once and the output written once (keel.data.runner).
- "wide": `run(input, output, config, options) -> StageReport` works on a flow Dataset as a
  whole (ingest, dedup, fuzzy dedup, decontam, embed, tokenize) and writes its own output.

keel.data.registry maps names to stages; keel.data.runner runs one or a chain of them.

Staged rows: a batch of documents with two more columns, DROP_REASON (null for a kept row) and
DROP_LOCATOR (what names a dropped row in stage.json's sample: its id, URL or file), the form in
which extract and ingest produce documents and the records they drop. `write_staged` writes the
kept rows of such a Dataset and counts the dropped ones by reason, in one flow pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from keel.core.config import to_dict
from keel.data import documents
from keel.flow import Dataset, FlowResult, RunOptions
from keel.flow.ops import Row

MAP = "map"
WIDE = "wide"
DROP_REASON = "drop_reason"
"""Staged rows: why the row is dropped; null for a kept document."""
DROP_LOCATOR = "drop_locator"
"""Staged rows: what names a dropped row in stage.json's sample (an id, a URL or a file)."""
DROPPED_SCHEMA = pa.schema([(DROP_REASON, pa.string()), (DROP_LOCATOR, pa.string())])
"""Mapped.dropped: one row per dropped document."""
STAGED_SCHEMA = pa.schema(
    [
        (documents.ID_COLUMN, pa.string()),
        (documents.TEXT_COLUMN, pa.string()),
        (documents.SOURCE_COLUMN, pa.string()),
        (documents.URL_COLUMN, pa.string()),
        (DROP_REASON, pa.string()),
        (DROP_LOCATOR, pa.string()),
    ]
)
"""The columns of staged_row, typed (a chunk of rows alone may infer null for a column)."""

# Side rows of a pass (keel.flow FileOutput.aside): per batch, stage and reason, the drops.
ASIDE_REASON = "__keel_drop_reason"
ASIDE_STAGE = "__keel_drop_stage"
ASIDE_COUNT = "__keel_drop_count"
ASIDE_IDS = "__keel_drop_ids"
ASIDE_COLUMNS = (ASIDE_REASON, ASIDE_STAGE, ASIDE_COUNT, ASIDE_IDS)
_ASIDE_SCHEMA = pa.schema(
    [
        (ASIDE_REASON, pa.string()),
        (ASIDE_STAGE, pa.int32()),
        (ASIDE_COUNT, pa.int64()),
        (ASIDE_IDS, pa.list_(pa.string())),
    ]
)


@dataclass(frozen=True)
class Mapped:
    """What a map stage makes of one batch: the kept rows and, per dropped row, why
    (DROPPED_SCHEMA)."""

    kept: pa.RecordBatch
    dropped: pa.RecordBatch


BatchFunction = Callable[[pa.RecordBatch], Mapped]


@dataclass(frozen=True)
class Stage:
    """One DataKit stage (module doc). Only `name`, `config`, `kind` and the function of its
    kind are needed; the hooks let the runner check a chain before any work and read JSONL
    input with the types the stage needs."""

    name: str
    config: type
    """A frozen dataclass whose defaults run; its fields are the stage's settings."""
    kind: str
    batches: Callable[[Any], BatchFunction] | None = None
    """map: config -> the batch function (built once per run: a model loads here)."""
    run: Callable[..., documents.StageReport] | None = None
    """wide: run(input, output, config, options) -> StageReport."""
    help: str = ""
    """One line: what the stage does (CLI help)."""
    fields: Callable[[Any], Mapping[str, pa.DataType]] | None = None
    """map: config -> the columns the stage reads besides id/text/source/url, with their types
    (JSONL input fields are read as these)."""
    adds: Callable[[Any], Sequence[str]] | None = None
    """map: config -> the columns the stage adds (a later stage of a chain may read them)."""
    check: Callable[[Any, Sequence[str], str], None] | None = None
    """map: (config, the columns the stage gets, the input) -> None, or UsageError before any
    work when a column it needs is missing."""
    details: Callable[[Any], dict] | None = None
    """map: config -> stage.json's details (default: {"config": the config as a dict})."""
    require_text: bool = True
    """map, first in a chain: JSONL input records must have a string text."""

    def __post_init__(self) -> None:
        if self.kind == MAP and self.batches is None:
            raise TypeError(f"map stage {self.name!r} needs a batches function")
        if self.kind == WIDE and self.run is None:
            raise TypeError(f"wide stage {self.name!r} needs a run function")
        if self.kind not in (MAP, WIDE):
            raise TypeError(f"stage {self.name!r}: kind must be {MAP!r} or {WIDE!r}")

    def report_details(self, config: Any) -> dict:
        return self.details(config) if self.details else {"config": to_dict(config)}


def _no_drops() -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array([], pa.string()), pa.array([], pa.string())], schema=DROPPED_SCHEMA
    )


def kept_all(kept: pa.RecordBatch) -> Mapped:
    """A map stage's result that drops nothing."""
    return Mapped(kept, _no_drops())


def split_staged(batch: pa.RecordBatch) -> Mapped:
    """Staged rows -> Mapped: the rows whose DROP_REASON is null, without the two drop columns,
    and the others' (reason, locator)."""
    dropped = pc.is_valid(batch.column(DROP_REASON))
    return Mapped(
        batch.filter(pc.invert(dropped)).drop_columns([DROP_REASON, DROP_LOCATOR]),
        batch.filter(dropped).select([DROP_REASON, DROP_LOCATOR]),
    )


def staged_row(
    text: str | None, reason: str | None, source: str, url: Any, locator: str | None = None
) -> Row:
    """A staged row: a document (reason None) or a dropped record, which stage.json names by
    `locator`, else its URL."""
    url = url if isinstance(url, str) else None
    return {
        documents.ID_COLUMN: None if text is None else documents.document_id(text),
        documents.TEXT_COLUMN: text,
        documents.SOURCE_COLUMN: source,
        documents.URL_COLUMN: url,
        DROP_REASON: reason,
        DROP_LOCATOR: (locator or url) if reason else None,
    }


# -- kept rows written, dropped rows counted, in one pass ---------------------------------------
def with_drop_summary(kept: pa.RecordBatch, drops: Sequence[pa.RecordBatch]) -> pa.Table:
    """The kept rows, then one side row (ASIDE_COLUMNS) per stage and reason with drops in
    this batch: the stage's index in `drops`, how many, the first DROPPED_SAMPLE locators."""
    summary: list[dict] = []
    for index, dropped in enumerate(drops):
        rows: dict[str, dict] = {}
        reasons = dropped.column(DROP_REASON).to_pylist()
        locators = dropped.column(DROP_LOCATOR).to_pylist()
        for reason, locator in zip(reasons, locators, strict=True):
            row = rows.setdefault(
                reason, {ASIDE_REASON: reason, ASIDE_STAGE: index, ASIDE_COUNT: 0, ASIDE_IDS: []}
            )
            row[ASIDE_COUNT] += 1
            if locator is not None and len(row[ASIDE_IDS]) < documents.DROPPED_SAMPLE:
                row[ASIDE_IDS].append(locator)
        summary.extend(rows.values())
    side = pa.Table.from_pylist(summary, schema=_ASIDE_SCHEMA)
    return pa.concat_tables([pa.Table.from_batches([kept]), side], promote_options="default")


def stage_drops(aside: pa.Table | None, stages: int) -> list[dict[str, dict]]:
    """FlowResult.aside of a pass -> per stage {reason: {"count", "ids"}}, the ids the first
    DROPPED_SAMPLE in input order."""
    found: list[dict[str, dict]] = [{} for _ in range(stages)]
    if aside is None:
        return found
    for row in aside.to_pylist():
        entry = found[row[ASIDE_STAGE]].setdefault(row[ASIDE_REASON], {"count": 0, "ids": []})
        entry["count"] += row[ASIDE_COUNT]
        entry["ids"].extend(row[ASIDE_IDS][: documents.DROPPED_SAMPLE - len(entry["ids"])])
    return found


def write_staged(
    staged: Dataset, staging: str, report: documents.StageReport, options: RunOptions | None
) -> FlowResult:
    """Run a Dataset of staged rows once into `staging` (a documents.stage_output directory):
    the kept rows (without the drop columns) are written, the dropped ones counted into
    `report` by reason with samples, and rows in and out added to it. Returns the pass's
    result (its `skipped` holds what lenient reading skipped)."""
    result = staged.map_batches(_staged_summary).write_parquet(
        staging, options=options, commit=False, aside=ASIDE_COLUMNS
    )
    (drops,) = stage_drops(result.aside, 1)
    add_drops(report, drops)
    report.documents_in += result.rows + sum(entry["count"] for entry in drops.values())
    report.documents_out += result.rows
    return result


def add_drops(report: documents.StageReport, drops: Mapping[str, dict]) -> None:
    """Add drops by reason (stage_drops) to `report`, reasons in sorted order."""
    for reason in sorted(drops):
        report.drop(reason, drops[reason]["ids"], count=drops[reason]["count"])


def _staged_summary(batch: pa.RecordBatch) -> pa.Table:
    mapped = split_staged(batch)
    return with_drop_summary(mapped.kept, [mapped.dropped])
