"""`keel export --format hf` without torch or transformers: which class a model exports to, the
refusals, and the command's errors (the parity tests are
test_hf_parity.py and test_hf_remote.py)."""

import json
import struct
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from keel.core.errors import UsageError
from keel.model.config import RouterConfig
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


def test_a_model_no_stock_class_expresses_exports_as_keels_class():
    model = preset("tiny-moe").model  # a shared expert
    bias = np.full((model.n_moe_layers, model.n_routed_experts), 0.1, np.float32)
    others = [
        (model, None),
        (replace(model, n_shared_experts=0), bias),
        (replace(model, n_shared_experts=0, latent_dim=32), None),
        (replace(model, n_shared_experts=0, router=RouterConfig(score="sigmoid")), None),
        (replace(preset("tiny-dense").model, rotary_fraction=0.5), None),
        (replace(preset("tiny-dense").model, rope_scaling="linear", rope_factor=2.0), None),
    ]
    for config, router_bias in others:
        assert choose_architecture(config, router_bias).name == "KeelForCausalLM"


def test_a_requested_stock_class_that_cannot_express_the_model_names_the_features():
    model = preset("tiny-moe").model
    with pytest.raises(UsageError) as refused:
        choose_architecture(model, None, "Qwen3MoeForCausalLM")
    assert str(refused.value) == (
        "Qwen3MoeForCausalLM cannot express this model (shared experts (n_shared_experts=1)); "
        "without --architecture it exports as KeelForCausalLM (load it with "
        "trust_remote_code=True)"
    )
    bias = np.full((model.n_moe_layers, model.n_routed_experts), 0.1, np.float32)
    with pytest.raises(UsageError, match="a non-zero router bias"):
        choose_architecture(replace(model, n_shared_experts=0), bias, "Qwen3MoeForCausalLM")
    with pytest.raises(UsageError, match="partial RoPE"):
        choose_architecture(
            replace(preset("tiny-dense").model, rotary_fraction=0.5), None, "Qwen3ForCausalLM"
        )
    with pytest.raises(UsageError, match=r"known classes are Qwen3ForCausalLM, .*KeelForCausalLM"):
        choose_architecture(model, None, "MixtralForCausalLM")
    dense = preset("tiny-dense").model
    assert choose_architecture(dense, None, "KeelForCausalLM").name == "KeelForCausalLM"


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
    assert error_lines(unknown.stderr) == ["error: --format 'onnx': known formats are hf"]
    missing = keel_export(str(tmp_path / "nope"), "--output", str(tmp_path / "out"))
    assert missing.returncode == 2
    expected = f"error: {tmp_path / 'nope'} holds no keel run (no config.yaml)"
    assert missing.stderr.strip() == expected
    assert not (tmp_path / "out").exists()


def test_a_requested_class_that_cannot_express_the_run_is_one_error_line(trained_run, tmp_path):
    output = tmp_path / "out"
    refused = keel_export(
        str(trained_run), "--architecture", "Qwen3MoeForCausalLM", "--output", str(output)
    )
    assert refused.returncode == 2
    assert error_lines(refused.stderr) == [
        "error: Qwen3MoeForCausalLM cannot express this model (no routed experts (an MoE "
        "class)); without --architecture it exports as Qwen3ForCausalLM"
    ]
    assert not output.exists()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]
