"""Runs DataKit stages (keel.data.stage): one, or a chain whose consecutive map stages are fused.

    from keel.data.registry import stage
    from keel.data.runner import run_chain

    report = run_chain([(stage("extract"), None), (stage("quality"), None)], "pages/", "scored/")

The runner owns what every stage shares: input discovery (keel.data.inputs: document sets,
Parquet, JSONL and text files, ids computed where missing), the drop accounting (stage.json's
counts by reason and samples), and the atomic commit of the output with its stage.json
(documents.stage_output). Consecutive map stages run as ONE flow pass: each input batch goes
through every stage's batch function in turn, the kept rows are written once, and the dropped
rows' reasons travel beside them as side rows (keel.flow's FileOutput.aside), so nothing is
written or read twice. A chain's stage.json counts the drops of all its stages (a reason two
stages share is summed) and keeps each stage's own report under details["stages"].

A wide stage writes its own output. A chain with wide stages runs group by group (a wide stage,
or a run of map stages) through scratch directories beside the output, removed at the end; its
stage.json is the last group's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import xxhash

from keel.core import paths
from keel.core.errors import UsageError
from keel.data import documents, inputs
from keel.data.stage import (
    ASIDE_COLUMNS,
    MAP,
    BatchFunction,
    Stage,
    add_drops,
    stage_drops,
    with_drop_summary,
)
from keel.flow import RunOptions, pooled
from keel.flow.sources import expand

logger = logging.getLogger(__name__)

Chain = Sequence[tuple[Stage, Any]]
"""Stages with their configs (None: the stage's default config), in the order they run."""


def run_stage(
    stage: Stage,
    input: inputs.Input,
    output: str,
    config: Any = None,
    options: RunOptions | None = None,
) -> documents.StageReport:
    """Run one stage over `input` into `output`; its report (also written as stage.json)."""
    return run_chain([(stage, config)], input, output, options)


def run_chain(
    chain: Chain, input: inputs.Input, output: str, options: RunOptions | None = None
) -> documents.StageReport:
    """Run `chain` over `input` into `output` (module doc); the report of its last group."""
    if not chain:
        raise UsageError("no stage to run: name at least one")
    chain = [(stage, stage.config() if config is None else config) for stage, config in chain]
    groups = _groups(chain)
    if len(groups) == 1:
        return _run_group(groups[0], input, output, options)
    scratch = f"{paths.normalize(output)}.chain-{uuid.uuid4().hex[:12]}"
    try:
        with pooled(options) as options:
            current: inputs.Input = input
            for index, group in enumerate(groups):
                last = index == len(groups) - 1
                names = "+".join(stage.name for stage, _ in group)
                target = output if last else paths.join(scratch, f"{index:02d}-{names}")
                report = _run_group(group, current, target, options)
                logger.info(
                    "%s: %d documents in, %d out", names, report.documents_in, report.documents_out
                )
                current = target
    finally:
        paths.remove_tree(scratch)
    return report


def _groups(chain: Chain) -> list[list[tuple[Stage, Any]]]:
    """The chain cut into runs of consecutive map stages and single wide stages."""
    groups: list[list[tuple[Stage, Any]]] = []
    for stage, config in chain:
        if stage.kind == MAP and groups and groups[-1][0][0].kind == MAP:
            groups[-1].append((stage, config))
        else:
            groups.append([(stage, config)])
    return groups


def _run_group(
    group: Chain, input: inputs.Input, output: str, options: RunOptions | None
) -> documents.StageReport:
    stage, config = group[0]
    if stage.kind != MAP:
        return stage.run(input, output, config, options)
    return run_map_stages(group, input, output, options)


def run_map_stages(
    chain: Chain, input: inputs.Input, output: str, options: RunOptions | None = None
) -> documents.StageReport:
    """Map stages fused into one flow pass over `input`, written to `output` with stage.json."""
    with documents.stage_output(output, input) as staging:
        fields = check_chain(chain, input)
        functions = tuple(stage.batches(config) for stage, config in chain)
        docs = inputs.read_documents(input, fields=fields, require_text=chain[0][0].require_text)
        fused = docs.map_batches(functools.partial(apply_chain, functions=functions))
        checkpoint = checkpoint_dir(chain, input, output)
        result = fused.write_parquet(
            staging, options=options, commit=False, aside=ASIDE_COLUMNS, checkpoint=checkpoint
        )
        drops = stage_drops(result.aside, len(chain))
        documents_in = result.stages[0].rows_in if result.stages else 0
        reports = []
        for (stage, config), found in zip(chain, drops, strict=True):
            report = documents.StageReport(stage.name, details=stage.report_details(config))
            report.documents_in = reports[-1].documents_out if reports else documents_in
            add_drops(report, found)
            report.documents_out = report.documents_in - sum(report.dropped.values())
            reports.append(report)
        if reports[-1].documents_out != result.rows:
            raise RuntimeError(
                f"drop counts do not add up to the {result.rows} rows written: {reports}"
            )
        report = reports[0] if len(reports) == 1 else _chain_report(reports)
        report.write(staging)
    remove_checkpoints(output)  # committed: the finished shards are in the output
    return report


def remove_checkpoints(output: str) -> None:
    """Remove the checkpoint directories beside `output` (this run's, and those of earlier
    runs into it that changed stages, settings or input and so never resumed)."""
    output = paths.normalize(output)
    parent, name = output.rsplit("/", 1) if "/" in output else (".", output)
    for entry in paths.list_dir(parent):
        if entry.startswith(f"{name}.partial-"):
            paths.remove_tree(paths.join(parent, entry))


def checkpoint_dir(chain: Chain, input: inputs.Input, output: str) -> str:
    """Where a map pass keeps its finished shards until its output is committed (keel.flow's
    FileOutput.checkpoint): beside `output`, named for the stages, their configs and the input
    files (paths, sizes, modification times), so a rerun of the same work resumes there and
    any change starts afresh."""
    identity = [[stage.name, repr(config)] for stage, config in chain]
    for file in expand(documents.parquet_glob(input)):
        fs, fs_path = paths.filesystem(file)
        info = fs.info(fs_path)
        identity.append([file, info.get("size"), str(info.get("mtime", info.get("LastModified")))])
    digest = xxhash.xxh3_64_hexdigest(json.dumps(identity).encode())
    return f"{paths.normalize(output)}.partial-{digest}"


def apply_chain(batch: pa.RecordBatch, functions: Sequence[BatchFunction]) -> pa.Table:
    """map_batches: a batch through each stage's batch function in turn; the kept rows, then the
    drops of each stage as side rows (stage.with_drop_summary)."""
    drops = []
    for function in functions:
        mapped = function(batch)
        drops.append(mapped.dropped)
        batch = mapped.kept
        if batch.num_rows == 0:
            break
    return with_drop_summary(batch, drops)


def check_chain(chain: Chain, input: inputs.Input) -> dict[str, pa.DataType]:
    """Check each stage against the columns it will get (the input's, plus those earlier stages
    add), before any work; returns the typed fields to read from JSONL input."""
    names = inputs.column_names(input)
    columns = None if names is None else list(names)
    fields: dict[str, pa.DataType] = {}
    added: set[str] = set()
    for index, (stage, config) in enumerate(chain):
        if stage.check is not None and columns is not None:
            stage.check(config, columns, str(input))
        for name, kind in (stage.fields(config) if stage.fields else {}).items():
            if name not in added:
                fields.setdefault(name, kind)
        later = chain[index + 1 :]
        needed = any(other.check or other.fields for other, _ in later)  # else adds is moot
        new = list(stage.adds(config)) if stage.adds and needed else []
        added.update(new)
        if columns is not None:
            columns.extend(name for name in new if name not in columns)
    return fields


def _chain_report(reports: list[documents.StageReport]) -> documents.StageReport:
    chain = documents.StageReport(
        "+".join(report.stage for report in reports),
        documents_in=reports[0].documents_in,
        documents_out=reports[-1].documents_out,
        details={"stages": [dataclasses.asdict(report) for report in reports]},
    )
    for report in reports:
        for reason, count in report.dropped.items():
            chain.drop(reason, report.dropped_sample.get(reason, []), count=count)
    return chain
