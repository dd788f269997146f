"""Mixing: a weighted mixture of document sets, by tokens, with epoch accounting.

Each source gets `weight / sum(weights)` of the target tokens. A source with fewer tokens than its
share is repeated: `floor(epochs)` whole copies, plus the documents whose id hash falls under the
fractional remainder (a deterministic, uniform choice), so `epochs` can be 2.5. A source with more
tokens than its share contributes that fraction of its documents, chosen the same way. Without a
target, the total is the largest for which no source is repeated.

Tokens are estimated from UTF-8 bytes (`bytes_per_token`, default 4.0, about what byte-level BPE
vocabularies of 32k-64k give on English); a `tokens` column, when present, is used instead. The
mixture is approximate in tokens (whole documents are taken); mix.json reports what was taken.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from keel.core import paths
from keel.core.errors import UsageError
from keel.data.documents import StageReport, stage_output
from keel.data.inputs import read_documents
from keel.flow import RunOptions
from keel.flow.runner import place_parts
from keel.steps import Step

MIX_FILE = "mix.json"
SOURCES_DIR = ".sources"
"""Inside the staging directory: each source's taken documents, before they become the parts."""


@dataclass(frozen=True)
class MixSource:
    input: str
    """A document set directory or glob (or output_of(step) in an experiment)."""
    weight: float
    name: str = ""
    """Written to the `mix_source` column; defaults to the input's last path component."""


@dataclass(frozen=True)
class MixConfig:
    sources: tuple[MixSource, ...]
    total_tokens: int | None = None
    """Target tokens of the mixture; None: the most that repeats no source."""
    bytes_per_token: float = 4.0
    seed: int = 0
    """Changes which documents a fractional epoch takes."""


@dataclass
class SourcePlan:
    name: str
    weight: float
    tokens_available: int
    tokens_target: int
    epochs: float
    documents_available: int = 0
    documents_taken: int = 0
    tokens_taken: int = 0


def run_mix(config: MixConfig, output: str, options: RunOptions | None = None) -> StageReport:
    """Write the mixture of `config.sources` to `output` (documents, mix.json, stage.json),
    committed together."""
    if not config.sources:
        raise UsageError("mix needs at least one source: MixConfig(sources=(MixSource(...), ...))")
    if any(source.weight <= 0 for source in config.sources):
        raise UsageError("mix: every source weight must be positive")
    names = [source.name or _default_name(source.input) for source in config.sources]
    if len(set(names)) != len(names):
        raise UsageError(f"mix: source names must differ, got {names}; set MixSource.name")
    with stage_output(output, [source.input for source in config.sources]) as staging:
        available = [
            _tokens(source.input, config.bytes_per_token, options) for source in config.sources
        ]
        plans = _plan(config, names, available)
        taken = paths.join(staging, SOURCES_DIR)
        files: list[str] = []
        for index, (source, plan) in enumerate(zip(config.sources, plans, strict=True)):
            result = _take(source, plan, config, paths.join(taken, f"{index:03d}"), options)
            plan.documents_available = result.stages[0].rows_in
            plan.documents_taken = result.rows
            files.extend(result.files)
        plan_tokens = _taken_tokens(files, config.bytes_per_token)
        for plan in plans:
            plan.tokens_taken = plan_tokens.get(plan.name, 0)
        place_parts(files, staging)
        paths.remove_tree(taken)
        report = StageReport(
            "mix",
            documents_in=sum(plan.documents_available for plan in plans),
            documents_out=sum(plan.documents_taken for plan in plans),
        )
        report.details = {"sources": [asdict(plan) for plan in plans]}
        paths.write_text(paths.join(staging, MIX_FILE), json.dumps(report.details, indent=2))
        report.write(staging)
    return report


def _plan(config: MixConfig, names: list[str], available: list[int]) -> list[SourcePlan]:
    total_weight = sum(source.weight for source in config.sources)
    shares = [source.weight / total_weight for source in config.sources]
    if any(tokens == 0 for tokens in available):
        empty = names[available.index(0)]
        raise UsageError(f"mix: source {empty} has no text")
    total = config.total_tokens or int(min(t / s for t, s in zip(available, shares, strict=True)))
    return [
        SourcePlan(name, source.weight, tokens, round(total * share), total * share / tokens)
        for name, source, tokens, share in zip(
            names, config.sources, available, shares, strict=True
        )
    ]


def _take(source: MixSource, plan: SourcePlan, config: MixConfig, directory: str, options):
    whole = math.floor(plan.epochs)
    fraction = plan.epochs - whole
    name, seed = plan.name, config.seed

    def copies(document: dict) -> list[dict]:
        extra = _unit_hash(document["id"], seed) < fraction
        return [{**document, "mix_source": name, "epoch": epoch} for epoch in range(whole + extra)]

    dataset = read_documents(source.input).flat_map(copies)
    return dataset.write_parquet(directory, options=options, commit=False)


def _unit_hash(document_id: str, seed: int) -> float:
    """A deterministic number in [0, 1) per (document, seed)."""
    return xxhash.xxh3_64_intdigest(document_id.encode(), seed=seed) / 2**64


def _tokens(input: str, bytes_per_token: float, options: RunOptions | None) -> int:
    totals = (
        read_documents(input, columns=["text"])
        .map_batches(lambda batch: _batch_tokens(batch, bytes_per_token))
        .to_table(options)
    )
    return int(pc.sum(totals.column("tokens")).as_py() or 0) if totals.num_rows else 0


def _batch_tokens(batch: pa.RecordBatch, bytes_per_token: float) -> pa.RecordBatch:
    size = pc.sum(pc.binary_length(pc.cast(batch.column("text"), pa.binary()))).as_py() or 0
    return pa.record_batch({"tokens": [math.ceil(size / bytes_per_token)]})


def _taken_tokens(files: list[str], bytes_per_token: float) -> dict[str, int]:
    totals: dict[str, int] = {}
    for file in files:
        fs, path = paths.filesystem(file)
        table = pq.read_table(path, columns=["text", "mix_source"], filesystem=fs)
        lengths = pc.binary_length(pc.cast(table.column("text"), pa.binary()))
        for name in pc.unique(table.column("mix_source")).to_pylist():
            mask = pc.equal(table.column("mix_source"), name)
            size = pc.sum(pc.filter(lengths, mask)).as_py() or 0
            totals[name] = totals.get(name, 0) + math.ceil(size / bytes_per_token)
    return totals


def _default_name(input: str) -> str:
    return str(input).rstrip("/").rsplit("/", 1)[-1].split("*")[0] or "source"


def mix_step(name: str, config: MixConfig, version: str | None = None) -> Step:
    """A step that writes the mixture; its sources may be `output_of(step)` references."""
    return Step(name, _run_mix_step, config, version)


def _run_mix_step(config: MixConfig, output: str) -> None:
    run_mix(config, output)
