"""Where a task's rows go: Parquet or JSONL files cut at a target size, or one Arrow file."""

from __future__ import annotations

import json
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from keel.core import paths
from keel.flow.ops import StageError


class FileSink:
    """Writes batches of one task to `part-{k:04d}.{ext}` files under `directory`, starting a new
    file once the current one reaches `target_bytes`. All files share the first batch's schema."""

    def __init__(self, directory: str, format: str, target_bytes: int) -> None:
        self.directory = directory
        self.format = format
        self.target_bytes = target_bytes
        self.files: list[str] = []
        self.schema: pa.Schema | None = None
        self._handle: IO[Any] | None = None
        self._parquet: pq.ParquetWriter | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        batch = self._conform(batch)
        if self._handle is None:
            self._open()
        if self._parquet is not None:
            self._parquet.write_batch(batch)
        else:
            lines = (json.dumps(row, ensure_ascii=False, default=str) for row in batch.to_pylist())
            self._handle.write("".join(line + "\n" for line in lines).encode("utf-8"))
        if self._handle.tell() >= self.target_bytes:
            self._close_file()

    def close(self) -> list[str]:
        if self._handle is not None:
            self._close_file()
        return self.files

    def _conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if self.schema is None:
            self.schema = batch.schema
            return batch
        if batch.schema == self.schema:
            return batch
        try:
            return batch.cast(self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError) as error:
            raise StageError(
                f"rows written to {self.directory} change schema: {self.schema} then "
                f"{batch.schema} ({error}); make the columns' types consistent"
            ) from error

    def _open(self) -> None:
        extension = "parquet" if self.format == "parquet" else "jsonl"
        path = paths.join(self.directory, f"part-{len(self.files):04d}.{extension}")
        self._handle = paths.open_file(path, "wb")
        if self.format == "parquet":
            self._parquet = pq.ParquetWriter(self._handle, self.schema, compression="zstd")
        self.files.append(path)

    def _close_file(self) -> None:
        if self._parquet is not None:
            self._parquet.close()
            self._parquet = None
        self._handle.close()
        self._handle = None
