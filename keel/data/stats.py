"""`keel data stats`: what a document set or token cache holds, and what each stage dropped."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import pyarrow.parquet as pq

from keel.core import paths
from keel.core.errors import UsageError
from keel.data.documents import STAGE_FILE, StageReport

MANIFEST = "manifest.json"


@dataclass
class DataStats:
    """Counts read from file footers and manifests only: no text is read."""

    path: str
    kind: str
    """"documents" (Parquet parts) or "token_cache" (manifest.json)."""
    documents: int = 0
    files: int = 0
    bytes: int = 0
    tokens: int | None = None
    stage: StageReport | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def data_stats(path: str) -> DataStats:
    """Stats of a document-set directory or a token-cache directory."""
    names = paths.list_dir(path)
    if not names:
        raise UsageError(f"{path}: no such directory, or it is empty")
    stage = StageReport.read(path) if STAGE_FILE in names else None
    if MANIFEST in names:
        manifest = json.loads(paths.read_text(paths.join(path, MANIFEST)))
        shards = manifest.get("shards", [])
        return DataStats(
            path=path,
            kind="token_cache",
            documents=int(manifest.get("documents", 0)),
            files=len(shards),
            bytes=sum(int(shard.get("bytes", 0)) for shard in shards),
            tokens=int(manifest.get("total_tokens", 0)),
            stage=stage,
            extra={key: manifest[key] for key in ("vocab_size", "dtype") if key in manifest},
        )
    parts = [name for name in names if name.startswith("part-") and name.endswith(".parquet")]
    if not parts:
        raise UsageError(f"{path}: neither a document set (part-*.parquet) nor a token cache")
    stats = DataStats(path=path, kind="documents", files=len(parts), stage=stage)
    for name in parts:
        fs, file_path = paths.filesystem(paths.join(path, name))
        stats.bytes += int(fs.size(file_path))
        with fs.open(file_path, "rb") as handle:
            stats.documents += pq.ParquetFile(handle).metadata.num_rows
    return stats
