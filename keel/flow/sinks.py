"""Where a task's rows go: Parquet or JSONL files cut at a target size, or one Arrow file."""

from __future__ import annotations

import json
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from keel.core import paths
from keel.flow.ops import StageError


class FileSink:
    """Writes the rows of one task to `part-{k:04d}.{ext}` files under `directory`, starting a new
    file once the current one reaches `target_bytes`. All files share the first batch's schema.

    Rows are regrouped into blocks of exactly `block_rows` (the last may be shorter) before they
    are written, so Parquet row groups, and with them the file bytes, do not depend on how the
    rows happened to be chunked upstream (which varies with the memory budget)."""

    def __init__(self, directory: str, format: str, target_bytes: int, block_rows: int) -> None:
        self.directory = directory
        self.format = format
        self.target_bytes = target_bytes
        self.block_rows = block_rows
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self.files: list[str] = []
        self.schema: pa.Schema | None = None
        self._handle: IO[Any] | None = None
        self._parquet: pq.ParquetWriter | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        self._pending.append(self._conform(batch))
        self._pending_rows += batch.num_rows
        if self._pending_rows >= self.block_rows:
            table = pa.Table.from_batches(self._pending)
            whole = (self._pending_rows // self.block_rows) * self.block_rows
            for start in range(0, whole, self.block_rows):
                self._write_block(
                    table.slice(start, self.block_rows).combine_chunks().to_batches()[0]
                )
            rest = table.slice(whole).combine_chunks().to_batches()
            self._pending = rest
            self._pending_rows = self._pending_rows - whole

    def close(self) -> list[str]:
        if self._pending_rows:
            table = pa.Table.from_batches(self._pending).combine_chunks()
            self._write_block(table.to_batches()[0])
        if self._handle is not None:
            self._close_file()
        return self.files

    def _write_block(self, batch: pa.RecordBatch) -> None:
        if self._handle is None:
            self._open()
        if self._parquet is not None:
            self._parquet.write_batch(batch)
        else:
            lines = (json.dumps(row, ensure_ascii=False, default=str) for row in batch.to_pylist())
            self._handle.write("".join(line + "\n" for line in lines).encode("utf-8"))
        if self._handle.tell() >= self.target_bytes:
            self._close_file()

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
