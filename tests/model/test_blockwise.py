"""Blockwise attention: equals XLA's attention (values and gradients), keeps a training step's
temporaries linear in the sequence length, trains tiny-dense at 16K tokens per sequence, and
`model.attention` rejects what cannot run."""

import subprocess
import sys
from typing import get_args, get_type_hints

import jax
import jax.numpy as jnp
import pytest

from keel.core.errors import ConfigError
from keel.model.attend import IMPLEMENTATIONS, attend, choose
from keel.model.blockwise import blockwise_attention, reference_attention
from keel.model.config import ModelConfig
from keel.train.config import apply_train_overrides
from keel.train.plan import plan_run
from keel.train.presets import preset


def qkv_and_documents(seq: int, n_heads: int, n_kv_heads: int):
    """q [2, seq, n_heads, 16], k and v [2, seq, n_kv_heads, 16], and segment ids [2, seq] with
    documents of a few to ~30 tokens (some shorter than a block, some crossing blocks)."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (2, seq, n_heads, 16))
    k = jax.random.normal(kk, (2, seq, n_kv_heads, 16))
    v = jax.random.normal(kv, (2, seq, n_kv_heads, 16))
    starts = jax.random.bernoulli(kd, 0.06, (2, seq))
    return q, k, v, jnp.cumsum(starts, axis=1).astype(jnp.int32)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_blockwise_equals_reference_values_and_gradients(documents):
    # 4 query heads on 2 key/value heads (GQA); 200 tokens in blocks of 32: a ragged last block,
    # blocks above the diagonal skipped, documents shorter than a block and across blocks.
    q, k, v, ids = qkv_and_documents(200, n_heads=4, n_kv_heads=2)
    ids = ids if documents else None
    cotangent = jax.random.normal(jax.random.key(1), q.shape)

    def out_and_grads(fn):
        def weighted(q, k, v):
            out = fn(q, k, v, ids)
            return (out * cotangent).sum(), out

        return jax.jit(jax.grad(weighted, (0, 1, 2), has_aux=True))(q, k, v)

    grads, out = out_and_grads(lambda *args: blockwise_attention(*args, block_size=32))
    want_grads, want_out = out_and_grads(reference_attention)
    assert jnp.abs(out - want_out).max() < 1e-5
    for grad, want in zip(grads, want_grads, strict=True):
        assert jnp.abs(grad - want).max() < 1e-5


def temp_bytes(attention: str, seq_len: int) -> int:
    """XLA's temporaries of one update step of one-layer tiny-dense, 1 sequence of seq_len."""
    overrides = [
        f"phases.0.seq_len={seq_len}",
        "batch_size=1",
        "model.n_layers=1",
        f"model.attention={attention}",
    ]
    config = apply_train_overrides(preset("tiny-dense"), overrides)
    return plan_run(config, jax.devices()[:1]).temp_bytes


def test_blockwise_step_memory_grows_linearly_and_xla_quadratically():
    blockwise = temp_bytes("blockwise", 16384) / temp_bytes("blockwise", 2048)
    xla = temp_bytes("xla", 16384) / temp_bytes("xla", 2048)
    # 8x the tokens: blockwise's temporaries grow with them (measured 7.9x), XLA's S x S scores
    # with their square (measured 57x).
    assert blockwise <= 8.8, blockwise
    assert xla >= 20, xla


def test_tiny_dense_trains_at_16k_tokens_per_sequence(tmp_path):
    command = [
        *("train", "--preset", "tiny-dense", "--steps", "2"),
        *("--set", "phases.0.seq_len=16384", "--set", "batch_size=1"),
        # The command (2 steps end inside the preset's 30-step warmup: a warning, not an
        # error); one layer and one evaluation batch keep this test's CPU time down (the 4-layer
        # run: docs/training.md).
        *("--set", "eval_batches=1", "--set", "model.n_layers=1"),
    ]
    done = _keel(tmp_path, command, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "to step 2" in done.stdout
    assert "ends during warmup" in done.stderr  # the preset warms up over 30 steps


def test_auto_chooses_by_platform_length_and_masking():
    assert choose("auto", 256, jnp.float32, has_segments=False) == "xla"
    assert choose("auto", 512, jnp.float32, has_segments=False) == "blockwise"
    assert choose("auto", 16384, jnp.float32, has_segments=True) == "blockwise"
    if jax.default_backend() == "gpu":
        assert choose("auto", 512, jnp.bfloat16, has_segments=False) == "cudnn"
    # The config's names are the registry's: adding an implementation touches both.
    known = get_args(get_type_hints(ModelConfig)["attention"])
    assert known == ("auto", *IMPLEMENTATIONS)


def test_unknown_implementation_is_an_error_listing_the_known_ones():
    with pytest.raises(ConfigError, match="known: auto, blockwise, xla, cudnn"):
        ModelConfig(attention="flash").validate()
    with pytest.raises(ConfigError, match="known: auto, blockwise, xla, cudnn"):
        q, k, v, _ = qkv_and_documents(8, 2, 2)
        attend(q, k, v, None, "flash")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cudnn is valid on a GPU")
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("cudnn", "error: model.attention=cudnn needs an NVIDIA GPU, but JAX runs on cpu"),
        ("flash", "error: --set model.attention=flash: expected one of 'auto', 'blockwise'"),
    ],
)
def test_cli_rejects_cudnn_on_cpu_and_unknown_names_in_one_line(tmp_path, value, message):
    command = ["train", "--preset", "tiny-dense", "--plan", "--set", f"model.attention={value}"]
    done = _keel(tmp_path, command, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(message), done.stderr[-2000:]


def _keel(cwd, command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`keel COMMAND...` as a user runs it, in `cwd`, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "keel", *command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
