"""A DataKit stage that lives outside keel, as a user's would: tests load it by `module:name`
(tests/data/test_stages.py puts this directory on the path) and as an entry point."""

import functools
import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from keel.data.stage import DROPPED_SCHEMA, MAP, Mapped, Stage


@dataclass(frozen=True)
class LowercaseConfig:
    banned: str = "spam"
    """Documents containing this word (after lowercasing) are dropped."""


def lowercase_batches(config: LowercaseConfig):
    return functools.partial(lowercase_batch, banned=config.banned)


FAIL_ON = "LOWERCASE_STAGE_FAIL_ON"
"""Tests set this environment variable to a word: a batch with a text containing it fails."""


def lowercase_batch(batch: pa.RecordBatch, banned: str) -> Mapped:
    texts = pc.utf8_lower(batch.column("text"))
    word = os.environ.get(FAIL_ON)
    if word and pc.any(pc.match_substring(texts, word)).as_py():
        raise RuntimeError(f"a text contains {word!r}")
    batch = batch.set_column(batch.schema.get_field_index("text"), "text", texts)
    hit = pc.match_substring(texts, banned)
    dropped = batch.filter(hit)
    reasons = pa.array([f"contains_{banned}"] * dropped.num_rows, pa.string())
    return Mapped(
        batch.filter(pc.invert(hit)),
        pa.RecordBatch.from_arrays([reasons, dropped.column("id")], schema=DROPPED_SCHEMA),
    )


LOWERCASE = Stage(
    "lowercase",
    LowercaseConfig,
    MAP,
    batches=lowercase_batches,
    help="Lowercase every text; drop those containing a banned word.",
)
