"""`keel export --format hf` without torch or transformers: which class a model exports to, the
refusals, and the directory the command writes (the parity tests are test_hf_parity.py)."""

import json
import struct
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from keel.core.errors import UsageError
from keel.train.hf_export import choose_architecture
from keel.train.presets import preset
from keel.train.tensor_file import write_safetensors


def test_dense_and_moe_models_choose_their_stock_class():
    dense = preset("tiny-dense").model
    assert choose_architecture(dense, None).name == "Qwen3ForCausalLM"
    assert choose_architecture(replace(dense, qk_norm=False), None).name == "LlamaForCausalLM"
    moe = replace(preset("tiny-moe").model, n_shared_experts=0)
    zero_bias = np.zeros((moe.n_moe_layers, moe.n_routed_experts), np.float32)
    assert choose_architecture(moe, zero_bias).name == "Qwen3MoeForCausalLM"


def test_a_model_no_stock_class_expresses_is_refused_naming_its_features():
    model = preset("tiny-moe").model  # a shared expert
    with pytest.raises(UsageError, match=r"shared experts \(n_shared_experts=1\)"):
        choose_architecture(model, None)
    bias = np.full((model.n_moe_layers, model.n_routed_experts), 0.1, np.float32)
    with pytest.raises(UsageError, match="a non-zero router bias"):
        choose_architecture(replace(model, n_shared_experts=0), bias)
    with pytest.raises(UsageError, match="partial RoPE"):
        choose_architecture(replace(preset("tiny-dense").model, rotary_fraction=0.5), None)


def test_a_safetensors_file_reads_back(tmp_path):
    """The header and bytes as the format says: 8-byte length, JSON, data in name order."""
    tensors = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(4, np.float32)}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, {"format": "pt"})
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0
    header = json.loads(data[8 : 8 + length])
    assert header["__metadata__"] == {"format": "pt"}
    for name, array in tensors.items():
        entry = header[name]
        begin, end = entry["data_offsets"]
        assert entry["dtype"] == "F32" and entry["shape"] == list(array.shape)
        read = np.frombuffer(data[8 + length + begin : 8 + length + end], "<f4")
        np.testing.assert_array_equal(read.reshape(array.shape), array)


def keel_export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "keel", "export", *args], capture_output=True, text=True, timeout=120
    )


def test_an_unknown_format_and_a_missing_run_are_one_error_line(tmp_path):
    unknown = keel_export(str(tmp_path), "--format", "onnx", "--output", str(tmp_path / "out"))
    assert unknown.returncode == 2
    errors = [line for line in unknown.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --format 'onnx': known formats are hf"]
    missing = keel_export(str(tmp_path / "nope"), "--output", str(tmp_path / "out"))
    assert missing.returncode == 2
    expected = f"error: {tmp_path / 'nope'} holds no keel run (no config.yaml)"
    assert missing.stderr.strip() == expected
    assert not (tmp_path / "out").exists()
