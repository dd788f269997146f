"""The write-ahead log: a write is acknowledged once its rows are fsynced here.

One file per generation (`wal/000000000042.wal`): the writer appends to the newest generation and
seals it when it is flushed into a segment; the file is deleted once the manifest names that
segment. A record is a header (magic, payload length, xxh3-64 of the payload) followed by an Arrow
IPC stream of the rows, so a record is either whole and verified or ignored: a writer killed
mid-append leaves a torn tail that every reader skips and the next writer truncates.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import xxhash

from keel.core import paths
from keel.telemetry.wire import arrow_stream, read_stream

MAGIC = b"KWL1"
HEADER = struct.Struct("<4sQQ")  # magic, payload bytes, xxh3-64 of the payload


def generation_path(directory: Path, generation: int) -> Path:
    return directory / f"{generation:012d}.wal"


def generations(directory: Path) -> list[int]:
    """The generations with a WAL file, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for entry in os.listdir(directory):
        stem, dot, suffix = entry.partition(".")
        if dot and suffix == "wal" and stem.isdigit():
            found.append(int(stem))
    return sorted(found)


class WalWriter:
    """Appends verified records to one generation's file; each `append` is durable on return."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        paths.fsync_directory(path.parent)
        self.bytes = os.fstat(self._fd).st_size

    def append(self, table: pa.Table) -> int:
        """Write `table` as one record and fsync; return the bytes written."""
        payload = arrow_stream(table)
        header = HEADER.pack(MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload))
        _write_all(self._fd, header + payload)
        os.fsync(self._fd)
        self.bytes += HEADER.size + len(payload)
        return HEADER.size + len(payload)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class WalContents:
    """The verified records of one file and where the verified prefix ends (bytes)."""

    tables: list[pa.Table]
    valid_bytes: int
    file_bytes: int


def read_wal(path: Path) -> WalContents:
    """Every whole, verified record of `path`, in order; stops at the first torn or bad record.

    Raises FileNotFoundError if the file is gone (it was flushed and deleted meanwhile)."""
    with open(path, "rb") as handle:
        data = handle.read()
    tables: list[pa.Table] = []
    offset = 0
    while offset + HEADER.size <= len(data):
        magic, length, digest = HEADER.unpack_from(data, offset)
        start, end = offset + HEADER.size, offset + HEADER.size + length
        if magic != MAGIC or end > len(data):
            break
        payload = memoryview(data)[start:end]
        if xxhash.xxh3_64_intdigest(payload) != digest:
            break
        tables.append(read_stream(payload))
        offset = end
    return WalContents(tables, offset, len(data))


def truncate_torn_tail(path: Path, contents: WalContents) -> None:
    """Cut a file back to its verified prefix (what a killed writer left after it)."""
    if contents.valid_bytes < contents.file_bytes:
        with open(path, "r+b") as handle:
            handle.truncate(contents.valid_bytes)
            handle.flush()
            os.fsync(handle.fileno())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
