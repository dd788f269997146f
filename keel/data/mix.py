"""Mixing: a weighted mixture of document sets, by tokens, with epoch accounting.

Each source gets `weight / sum(weights)` of the target tokens. A source with fewer tokens than its
share is repeated: `floor(epochs)` whole copies, plus the documents whose id hash falls under the
fractional remainder (a deterministic, uniform choice), so `epochs` can be 2.5. A source with more
tokens than its share contributes that fraction of its documents, chosen the same way. Without a
target, the total is the largest for which no source is repeated.

Domain mixing by the embed stage's clusters: a source with `cluster_weights` (a document set that
`keel data embed` gave a `cluster` column) is split into one source per cluster, named
`NAME#K`. The source's weight is shared among its clusters in proportion to each cluster's
tokens times its multiplier (1 for a cluster not listed; 0 leaves a cluster out), so
multipliers all 1 take the source as it is, and `{3: 2.0}` gives cluster 3 twice its natural
share of the source's tokens at the others' expense.

Tokens are estimated from UTF-8 bytes (`bytes_per_token`, default 4.0, about what byte-level BPE
vocabularies of 32k-64k give on English); a `tokens` column, when present, is used instead. The
mixture is approximate in tokens (whole documents are taken); mix.json reports what was taken.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from keel.core import paths
from keel.core.errors import UsageError
from keel.data.documents import StageReport, stage_output
from keel.data.embed import CLUSTER_COLUMN
from keel.data.inputs import column_names, read_documents
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
    cluster_weights: tuple[tuple[int, float], ...] = ()
    """(cluster, multiplier) pairs: split the source by its `cluster` column (keel data embed)
    and weight each cluster by its tokens x multiplier (1 when not listed, 0 to leave it out)."""
    cluster: int | None = None
    """Only the documents of this cluster (set by the split; not given by hand)."""


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
    named = [
        replace(source, name=source.name or _default_name(source.input))
        for source in config.sources
    ]
    names = [source.name for source in named]
    if len(set(names)) != len(names):
        raise UsageError(f"mix: source names must differ, got {names}; set MixSource.name")
    with stage_output(output, [source.input for source in config.sources]) as staging:
        sources: list[MixSource] = []
        available: list[int] = []
        for source in named:
            tokens = _tokens(source, config.bytes_per_token, options)
            split = _by_cluster(source, tokens) if source.cluster_weights else [(source, tokens)]
            for part, part_tokens in split:
                sources.append(part)
                available.append(part_tokens)
        plans = _plan(replace(config, sources=tuple(sources)), available)
        taken = paths.join(staging, SOURCES_DIR)
        files: list[str] = []
        for index, (source, plan) in enumerate(zip(sources, plans, strict=True)):
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


def _by_cluster(source: MixSource, tokens: dict[int, int]) -> list[tuple[MixSource, int]]:
    """`source` split into one source per cluster with tokens (NAME#K), the source's weight
    shared by tokens x multiplier; with each part, its tokens."""
    multipliers = dict(source.cluster_weights)
    if any(multiplier < 0 for multiplier in multipliers.values()):
        raise UsageError(f"mix: {source.name}: cluster weights must be 0 or more")
    unknown = sorted(set(multipliers) - set(tokens))
    if unknown:
        raise UsageError(
            f"mix: {source.name} has no documents in cluster {', '.join(map(str, unknown))} "
            f"(its clusters: {', '.join(map(str, sorted(tokens)))})"
        )
    scaled = {k: n * multipliers.get(k, 1.0) for k, n in sorted(tokens.items()) if n}
    total = sum(scaled.values())
    if total == 0:
        raise UsageError(f"mix: {source.name}: every cluster has weight 0")
    return [
        (
            replace(source, name=f"{source.name}#{k}", weight=source.weight * v / total, cluster=k),
            tokens[k],
        )
        for k, v in scaled.items()
        if v > 0
    ]


def _plan(config: MixConfig, available: list[int]) -> list[SourcePlan]:
    names = [source.name for source in config.sources]
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

    cluster = source.cluster

    def copies(document: dict) -> list[dict]:
        if cluster is not None and document[CLUSTER_COLUMN] != cluster:
            return []
        extra = _unit_hash(document["id"], seed) < fraction
        return [{**document, "mix_source": name, "epoch": epoch} for epoch in range(whole + extra)]

    dataset = read_documents(source.input).flat_map(copies)
    return dataset.write_parquet(directory, options=options, commit=False)


def _unit_hash(document_id: str, seed: int) -> float:
    """A deterministic number in [0, 1) per (document, seed)."""
    return xxhash.xxh3_64_intdigest(document_id.encode(), seed=seed) / 2**64


def _tokens(source: MixSource, bytes_per_token: float, options: RunOptions | None) -> Any:
    """The source's estimated tokens; by cluster ({cluster: tokens}) when it has cluster
    weights."""
    by_cluster = bool(source.cluster_weights)
    columns = ["text", CLUSTER_COLUMN] if by_cluster else ["text"]
    if by_cluster and CLUSTER_COLUMN not in (column_names(source.input) or [CLUSTER_COLUMN]):
        raise UsageError(
            f"mix: {source.input} has no {CLUSTER_COLUMN} column for cluster weights: "
            "run `keel data embed` on it first"
        )
    totals = (
        read_documents(source.input, columns=columns)
        .map_batches(lambda batch: _batch_tokens(batch, bytes_per_token, by_cluster))
        .to_table(options)
    )
    if not by_cluster:
        return int(pc.sum(totals.column("tokens")).as_py() or 0) if totals.num_rows else 0
    found: dict[int, int] = {}
    for cluster, tokens in zip(
        totals.column(CLUSTER_COLUMN).to_pylist(), totals.column("tokens").to_pylist(), strict=True
    ):
        found[cluster] = found.get(cluster, 0) + tokens
    return found


def _batch_tokens(
    batch: pa.RecordBatch, bytes_per_token: float, by_cluster: bool
) -> pa.RecordBatch:
    """The batch's estimated tokens: one row, or one row per cluster."""
    lengths = pc.binary_length(pc.cast(batch.column("text"), pa.binary()))
    if not by_cluster:
        size = pc.sum(lengths).as_py() or 0
        return pa.record_batch({"tokens": [math.ceil(size / bytes_per_token)]})
    sizes = pa.table({CLUSTER_COLUMN: batch.column(CLUSTER_COLUMN), "bytes": lengths})
    grouped = sizes.group_by(CLUSTER_COLUMN).aggregate([("bytes", "sum")])
    tokens = [
        math.ceil((size or 0) / bytes_per_token) for size in grouped.column("bytes_sum").to_pylist()
    ]
    return pa.record_batch(
        {CLUSTER_COLUMN: grouped.column(CLUSTER_COLUMN).combine_chunks(), "tokens": tokens}
    )


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
    """A source's name from its input: the last part of its path, with its directory's name when
    it is a glob (`raw/*.jsonl` -> `raw/*.jsonl`, `web/` -> `web`)."""
    parts = str(input).rstrip("/").split("/")
    if paths.is_glob(parts[-1]) and len(parts) > 1 and parts[-2]:
        return "/".join(parts[-2:])
    return parts[-1] or "source"


def mix_step(name: str, config: MixConfig, version: str | None = None) -> Step:
    """A step that writes the mixture; its sources may be `output_of(step)` references."""
    return Step(name, _run_mix_step, config, version)


def _run_mix_step(config: MixConfig, output: str) -> None:
    run_mix(config, output)
