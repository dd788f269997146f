"""Reading an offline W&B run's transaction log (run-ID.wandb) back, for the tests.

wandb 0.31 has no reader of its own (its Python `datastore` module is gone; the Go core writes
the file) and writes no config.yaml or wandb-summary.json for an offline run, so the log is the
only record of what was sent. Its framing is LevelDB's log format after a 7-byte header
(`:W&B`, magic, version): 32 KiB blocks of chunks, each with a 7-byte header (checksum, length,
type FULL/FIRST/MIDDLE/LAST); each record is one protobuf `Record` of wandb's own schema.
"""

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every Record in the file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    found, chunks, position = [], [], HEADER
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:  # the block's tail is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if kind == 0:  # zero fill to the end of the block
            position += left
            continue
        body = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        chunks = [body] if kind in (FULL, FIRST) else [*chunks, body]
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            found.append(record)
    return found


@dataclass
class OfflineRun:
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)


def read_offline_run(path: Path) -> OfflineRun:
    """The run's config, its final summary and its history rows (W&B's own keys, `_step`,
    `_runtime`, `_timestamp`, left out)."""
    run = OfflineRun()
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.config.update(_items(record.run.config.update))
        elif kind == "config":
            run.config.update(_items(record.config.update))
        elif kind == "summary":
            run.summary.update(_items(record.summary.update))
        elif kind == "history":
            row = _items(record.history.item)
            row["step"] = record.history.step.num
            run.history.append(row)
    run.config.pop("_wandb", None)
    return run


def _items(items) -> dict:
    out = {}
    for item in items:
        key = item.key or "/".join(item.nested_key)
        if not key.startswith("_"):
            out[key] = json.loads(item.value_json)
    return out
