"""Threshold filters over attribute columns: language, the Gopher heuristics, the quality score.

run_quality computes the attributes once; run_filter only compares them with thresholds, so an
ablation changes a threshold, not the data:

    from dataclasses import replace

    from keel.data.filter import FilterConfig, run_filter

    run_filter("scored/", "kept/")  # Gopher thresholds, English
    run_filter("scored/", "kept_q/", replace(FilterConfig(), min_quality_score=0.5))

Each config field is a rule: `languages` (the allowed values of `language`; None allows all), and
`min_<column>` / `max_<column>`, a document keeps when column >= min and column <= max (both
inclusive); None switches a rule off, and a null or NaN value fails it. Rules run in field order,
and a dropped document is counted under the FIRST rule it fails (its field name is the reason), so
the reasons partition the dropped documents but a later rule's count depends on the earlier ones.

Output directory: the kept documents (part-*.parquet, in input order, every column kept), then
stage.json with the drops by reason and a sample of their ids.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keel.core.errors import UsageError
from keel.data import documents
from keel.data.langid import LANGUAGE_COLUMN
from keel.data.runner import run_stage
from keel.data.stage import DROPPED_SCHEMA, MAP, BatchFunction, Mapped, Stage
from keel.flow import RunOptions

STAGE = "filter"


@dataclass(frozen=True)
class FilterConfig:
    """Thresholds: defaults are Gopher's (Rae et al. 2021, appendix A), English only, and no
    quality threshold. See heuristics.py for what each column measures."""

    languages: tuple[str, ...] | None = ("en",)
    """Allowed values of `language` (ISO 639 codes); None: any language."""
    min_language_score: float | None = None
    """Lowest `language_score` (probability of the identified language, 0..1)."""
    min_word_count: int | None = 50
    max_word_count: int | None = 100_000
    min_mean_word_length: float | None = 3.0
    """Characters per word."""
    max_mean_word_length: float | None = 10.0
    max_hash_to_word_ratio: float | None = 0.1
    max_ellipsis_to_word_ratio: float | None = 0.1
    max_bullet_line_fraction: float | None = 0.9
    max_ellipsis_line_fraction: float | None = 0.3
    min_alpha_word_fraction: float | None = 0.8
    min_stop_word_count: int | None = 2
    """Distinct Gopher stop words (the, be, to, of, and, that, have, with) present."""
    max_duplicate_line_fraction: float | None = 0.3
    max_duplicate_line_char_fraction: float | None = 0.2
    max_top_2gram_char_fraction: float | None = 0.2
    max_top_3gram_char_fraction: float | None = 0.18
    max_top_4gram_char_fraction: float | None = 0.16
    min_quality_score: float | None = None
    """Lowest `quality_score` (the classifier's probability of the positive class, 0..1)."""


@dataclass(frozen=True)
class Rule:
    """One active threshold: documents whose `column` fails it are dropped with reason `name`."""

    name: str
    column: str
    kind: str
    """"in" (value in bound), "min" (value >= bound) or "max" (value <= bound)."""
    bound: float | tuple[str, ...]


def rules(config: FilterConfig) -> list[Rule]:
    """The active rules of a config, in the order they are checked."""
    active = []
    for field in dataclasses.fields(config):
        bound = getattr(config, field.name)
        if bound is None:
            continue
        if field.name == "languages":
            active.append(Rule(field.name, LANGUAGE_COLUMN, "in", tuple(bound)))
        else:
            kind, column = field.name.split("_", 1)
            active.append(Rule(field.name, column, kind, float(bound)))
    return active


def rule_type(rule: Rule) -> pa.DataType:
    """The type of the column a rule reads: strings for "in", numbers otherwise."""
    return pa.string() if rule.kind == "in" else pa.float64()


def first_failed_rule(batch: pa.RecordBatch | pa.Table, active: Sequence[Rule]) -> np.ndarray:
    """Per row: the index in `active` of the first rule it fails, or -1 when it passes all
    (int64 [rows])."""
    failed = np.full(batch.num_rows, -1, dtype=np.int64)
    for index, rule in enumerate(active):
        values = batch.column(rule.column)
        if rule.kind == "in":
            passed = pc.is_in(values, value_set=pa.array(rule.bound, pa.string()))
        elif rule.kind == "min":
            passed = pc.greater_equal(values, rule.bound)
        else:
            passed = pc.less_equal(values, rule.bound)
        passed = pc.fill_null(passed, False).to_numpy(zero_copy_only=False)
        failed[(failed < 0) & ~passed] = index
    return failed


def run_filter(
    input: str,
    output: str,
    config: FilterConfig = FilterConfig(),
    options: RunOptions | None = None,
) -> documents.StageReport:
    """Keep the documents of `input` that pass every rule of `config`, into `output`."""
    return run_stage(FILTER, input, output, config, options)


def filter_batches(config: FilterConfig) -> BatchFunction:
    """The filter stage's batch function (keel.data.stage)."""
    return functools.partial(filter_mapped, active=tuple(rules(config)))


def filter_mapped(batch: pa.RecordBatch, active: Sequence[Rule]) -> Mapped:
    """The documents that pass every rule; the others with their first failed rule's name."""
    failed = first_failed_rule(batch, active)
    dropped = np.flatnonzero(failed >= 0)
    names = np.array([rule.name for rule in active] or [""], dtype=object)
    reasons = pa.array(names[failed[dropped]].tolist() if len(dropped) else [], pa.string())
    ids = batch.column(documents.ID_COLUMN).take(pa.array(dropped, pa.int64()))
    return Mapped(
        batch.filter(pa.array(failed < 0)),
        pa.RecordBatch.from_arrays([reasons, ids.cast(pa.string())], schema=DROPPED_SCHEMA),
    )


def _check_columns(config: FilterConfig, columns: Sequence[str], input: str) -> None:
    missing = [rule for rule in rules(config) if rule.column not in columns]
    if missing:
        raise UsageError(
            f"{input} has no column {missing[0].column!r}, which "
            f"FilterConfig.{missing[0].name} needs: add the attribute columns with "
            f"keel.data.quality.run_quality, or set {missing[0].name}=None"
        )


def _rule_fields(config: FilterConfig) -> dict[str, pa.DataType]:
    """JSONL input: the rules' columns, typed."""
    return {rule.column: rule_type(rule) for rule in rules(config)}


FILTER = Stage(
    STAGE,
    FilterConfig,
    MAP,
    batches=filter_batches,
    help="Drop documents by thresholds over attribute columns (defaults: Gopher's, English).",
    fields=_rule_fields,
    check=_check_columns,
)
