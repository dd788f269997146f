"""The DataKit stages by name: the package's public face (`keel data run`, `keel data <stage>`).

    from keel.data.registry import STAGES, stage

    stage("filter")              # a stage of keel's own (STAGES)
    stage("mypackage.stages:lower")  # a Stage object in any importable module
    stage("lower")               # or one a package declares as an entry point:
                                 # [project.entry-points."keel.data.stages"] lower = "pkg.mod:LOWER"

A new stage is one module holding its config dataclass, its function and its Stage (see
keel.data.stage and docs/architecture.md), and one line in STAGES below. Wide stages whose
module predates keel.data.stage are wrapped here, one line each.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from keel.core.errors import UsageError, did_you_mean
from keel.data.decontam import DecontamConfig, run_decontam
from keel.data.dedup import ExactDedupConfig, run_exact_dedup
from keel.data.embed import EmbedConfig, run_embed
from keel.data.extract import EXTRACT
from keel.data.filter import FILTER
from keel.data.fuzzy import FuzzyDedupConfig, run_fuzzy_dedup
from keel.data.ingest import INGEST
from keel.data.quality import QUALITY
from keel.data.stage import WIDE, Stage
from keel.data.tokenize import TokenizeConfig, run_tokenize

ENTRY_POINT_GROUP = "keel.data.stages"

STAGES: dict[str, Stage] = {
    stage.name: stage
    for stage in (
        INGEST,
        EXTRACT,
        QUALITY,
        FILTER,
        Stage(
            "exact_dedup",
            ExactDedupConfig,
            WIDE,
            run=run_exact_dedup,
            help="Remove documents whose text another document already has.",
        ),
        Stage(
            "fuzzy_dedup",
            FuzzyDedupConfig,
            WIDE,
            run=run_fuzzy_dedup,
            help="Remove near duplicates (MinHash LSH); removed.parquet says which and why.",
        ),
        Stage(
            "decontam",
            DecontamConfig,
            WIDE,
            run=run_decontam,
            help="Drop (or cut) documents sharing n-grams with eval sets.",
        ),
        Stage(
            "embed",
            EmbedConfig,
            WIDE,
            run=run_embed,
            help="Add an `embedding` and a k-means `cluster` column.",
        ),
        Stage(
            "tokenize",
            TokenizeConfig,
            WIDE,
            run=run_tokenize,
            help="Documents -> a token cache (manifest.json + shards) and its tokenizer.json.",
        ),
    )
}
"""keel's own stages, in pipeline order."""


def stage(name: str) -> Stage:
    """The stage called `name`: one of STAGES, `module:attribute` (a Stage in an importable
    module), or a `keel.data.stages` entry point. UsageError listing the known names otherwise."""
    if ":" in name:
        return _imported(name)
    if name in STAGES:
        return STAGES[name]
    found = entry_points(group=ENTRY_POINT_GROUP).select(name=name)
    for entry in found:
        return _checked(entry.load(), f"entry point {name} ({entry.value})")
    known = known_names()
    raise UsageError(
        f"no DataKit stage {name!r}{did_you_mean(name, known)}: use one of {', '.join(known)}, "
        "or module:attribute for a stage of your own"
    )


def known_names() -> list[str]:
    """keel's stages, then those declared as entry points."""
    declared = [entry.name for entry in entry_points(group=ENTRY_POINT_GROUP)]
    return [*STAGES, *(name for name in declared if name not in STAGES)]


def chain(names: str) -> list[Stage]:
    """`extract,quality,filter` -> those stages, in order."""
    parts = [part.strip() for part in names.split(",")]
    if not all(parts):
        raise UsageError(f"{names!r}: name stages separated by commas, e.g. extract,quality")
    return [stage(part) for part in parts]


def _imported(name: str) -> Stage:
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"stage {name!r}: cannot import {module_name} ({error})") from error
    if not hasattr(module, attribute):
        raise UsageError(f"stage {name!r}: {module_name} has no {attribute!r}")
    return _checked(getattr(module, attribute), name)


def _checked(found: object, where: str) -> Stage:
    if not isinstance(found, Stage):
        raise UsageError(
            f"{where} is a {type(found).__name__}, not a keel.data.stage.Stage: define "
            "Stage(name, Config, kind, ...)"
        )
    return found
