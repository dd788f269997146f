"""safetensors files written from numpy arrays, without the safetensors package (the core
install has no use for it; Hugging Face loaders read what this writes).

The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length N,
N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
padded with spaces to a multiple of 8, then the tensors' bytes (C order, little-endian) back to
back, offsets counted from the end of the header.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from keel.core.errors import ConfigError

DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
}


def write_safetensors(
    path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` (name -> array) to `path` in name order."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    blobs, offset = [], 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype not in DTYPES:
            raise ConfigError(f"safetensors: {name} has dtype {array.dtype}, not one of {DTYPES}")
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {
            "dtype": DTYPES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(text)))
        file.write(text)
        for data in blobs:
            file.write(data)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (name -> array), as float32 for float dtypes (BF16
    included) and as stored otherwise; the file is memory-mapped, not read whole."""
    import ml_dtypes  # jax's dependency: numpy's bfloat16

    readable = {name: dtype for dtype, name in DTYPES.items()}
    readable["BF16"] = np.dtype(ml_dtypes.bfloat16)
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in readable:
            raise ConfigError(f"safetensors {path}: {name} has dtype {entry['dtype']}, unsupported")
        begin, end = entry["data_offsets"]
        array = data[begin:end].view(readable[entry["dtype"]]).reshape(entry["shape"])
        floating = array.dtype.kind == "f" or entry["dtype"] == "BF16"
        tensors[name] = array.astype(np.float32) if floating else np.array(array)
    return tensors
