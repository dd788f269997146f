"""keel/flow: a lazy dataflow engine for data larger than memory, on local processes or Ray.

See docs/flow.md. Entry points: read_jsonl, read_parquet, from_files, from_items -> Dataset.
"""

from keel.flow.backends import TaskFailedError
from keel.flow.backends.local import LocalBackend
from keel.flow.dataset import Dataset, from_files, from_items, read_jsonl, read_parquet
from keel.flow.readers import MalformedInputError, SkipLog
from keel.flow.runner import FlowResult, RunOptions, StageCounters, pooled
from keel.flow.shuffle import run_lengths
from keel.flow.tasks import Settings

__all__ = [
    "Dataset",
    "FlowResult",
    "LocalBackend",
    "MalformedInputError",
    "RunOptions",
    "Settings",
    "SkipLog",
    "StageCounters",
    "TaskFailedError",
    "from_files",
    "from_items",
    "pooled",
    "read_jsonl",
    "read_parquet",
    "run_lengths",
]
