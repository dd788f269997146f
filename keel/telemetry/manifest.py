"""A namespace's manifest: its schema, options and the segments that hold its rows.

`<root>/<namespace>/manifest.json` is replaced atomically (temporary file, fsync, rename): a
reader sees the segments before a flush or compaction or after it, never a mix. A segment is
visible only once the manifest names it; a WAL generation at or below `flushed_generation` is in a
segment already. Files replaced by compaction stay on disk for a grace period (`retired`), so a
reader that loaded the previous manifest can still finish its query.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson
import pyarrow as pa

from keel.core import paths
from keel.telemetry.schema import NamespaceOptions

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class SegmentEntry:
    """One immutable Parquet segment. Times are epoch nanoseconds of the time column (or None)."""

    name: str
    rows: int
    bytes: int
    checksum: str
    row_groups: int
    min_time: int | None = None
    max_time: int | None = None


@dataclass(frozen=True)
class Manifest:
    namespace: str
    schema: pa.Schema
    options: NamespaceOptions
    segments: tuple[SegmentEntry, ...] = ()
    flushed_generation: int = -1
    retired: tuple[tuple[str, float], ...] = field(default=())  # (segment name, retired at, unix s)
    version: int = 0

    @property
    def rows(self) -> int:
        return sum(segment.rows for segment in self.segments)

    def with_segments(self, segments: tuple[SegmentEntry, ...], **changes: object) -> Manifest:
        return replace(self, segments=segments, version=self.version + 1, **changes)


def load_manifest(directory: Path) -> Manifest | None:
    """The namespace's manifest, or None if the namespace has none yet."""
    try:
        text = (directory / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None
    return parse_manifest(text)


def parse_manifest(text: bytes) -> Manifest:
    """A manifest from the bytes of its file."""
    data = orjson.loads(text)
    schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(data["schema"])))
    return Manifest(
        namespace=data["namespace"],
        schema=schema,
        options=NamespaceOptions.from_dict(data["options"]),
        segments=tuple(SegmentEntry(**entry) for entry in data["segments"]),
        flushed_generation=data["flushed_generation"],
        retired=tuple((name, at) for name, at in data["retired"]),
        version=data["version"],
    )


def save_manifest(directory: Path, manifest: Manifest) -> None:
    """Replace the manifest atomically and durably."""
    data = {
        "namespace": manifest.namespace,
        "schema": base64.b64encode(manifest.schema.serialize().to_pybytes()).decode("ascii"),
        "columns": {f.name: str(f.type) for f in manifest.schema},
        "options": manifest.options.to_dict(),
        "segments": [segment.__dict__ for segment in manifest.segments],
        "flushed_generation": manifest.flushed_generation,
        "retired": [list(item) for item in manifest.retired],
        "version": manifest.version,
    }
    paths.write_text(directory / MANIFEST, orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
