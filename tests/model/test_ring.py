"""Ring attention over the mesh's sequence axis (keel.model.ring) on simulated CPU devices
(tests/conftest.py makes 8): over 4 devices it equals the reference attention, forward and
gradients, with and without document masks and GQA; a training step with mesh.sequence=2 equals
the one-device step; a sequence axis that does not split seq_len is one error line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mesh_support import small_dense

from keel.model import ring
from keel.model.blockwise import reference_attention
from keel.model.ring import ring_attention, zigzag_order
from keel.model.sharding import MeshConfig, build_mesh
from keel.train.layout import initial_state
from keel.train.schedule import piecewise_lr
from keel.train.step import build_step_functions

BATCH, SEQ, HEAD_DIM = 2, 64, 16


def _documents(seed: int) -> jax.Array:
    """[BATCH, SEQ] segment ids: documents of random lengths (a new one at ~1 in 8 tokens)."""
    starts = np.random.default_rng(seed).random((BATCH, SEQ)) < 0.125
    return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


@pytest.mark.parametrize("n_heads,n_kv_heads,documents", [(4, 4, False), (4, 2, True)])
def test_ring_over_4_devices_equals_reference_forward_and_gradients(
    n_heads, n_kv_heads, documents, monkeypatch
):
    if documents:  # chunks of 8 tokens: a device's own 16 keys take 2 key blocks of 8
        monkeypatch.setattr(ring, "KEY_BLOCK", 8)
    mesh = build_mesh(MeshConfig(data=1, sequence=4), jax.devices()[:4])
    keys = jax.random.split(jax.random.key(n_kv_heads), 4)
    q = jax.random.normal(keys[0], (BATCH, SEQ, n_heads, HEAD_DIM))
    k = jax.random.normal(keys[1], (BATCH, SEQ, n_kv_heads, HEAD_DIM))
    v = jax.random.normal(keys[2], (BATCH, SEQ, n_kv_heads, HEAD_DIM))
    cotangent = jax.random.normal(keys[3], q.shape)  # a loss that weighs every output
    segments = _documents(n_heads) if documents else None
    order = zigzag_order(SEQ, 4)
    back = np.argsort(order)

    def ringed(q, k, v):
        zigzag = None if segments is None else segments[:, order]
        out = ring_attention(q[:, order], k[:, order], v[:, order], zigzag, mesh)[:, back]
        return (out * cotangent).sum(), out

    def reference(q, k, v):
        out = reference_attention(q, k, v, segments)
        return (out * cotangent).sum(), out

    (_, got), got_grads = jax.jit(jax.value_and_grad(ringed, (0, 1, 2), has_aux=True))(q, k, v)
    (_, want), want_grads = jax.jit(jax.value_and_grad(reference, (0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_zigzag_gives_each_device_chunk_i_and_2n_minus_1_minus_i():
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


def test_training_step_with_sequence_2_equals_one_device(wikitext_cache):
    config = small_dense("mask_documents=true").with_data((wikitext_cache,))
    window = jnp.asarray(
        np.random.default_rng(0).integers(0, 512, (4, config.phases[0].seq_len + 1)), jnp.int32
    )
    window = window.at[:, 20].set(0)  # an EOS (id 0) mid-sequence: two documents per row

    def one_step(mesh: MeshConfig, devices: int):
        run = replace(config, mesh=mesh)
        learning_rate = piecewise_lr(run.segments())
        state, optimizer, layout = initial_state(run, learning_rate, jax.devices()[:devices])
        functions = build_step_functions(
            run, optimizer, learning_rate, jnp.ones(512, jnp.int32), 0, layout
        )
        state, metrics = functions.update(state, window)
        return jax.device_get((metrics["loss"], metrics["grad_norm"], state.params))

    want = one_step(MeshConfig(data=1), 1)
    got = one_step(MeshConfig(data=1, sequence=2), 2)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_sequence_axis_that_does_not_split_seq_len_is_one_error_line():
    env = {**os.environ, "KEEL_DEVICES": "4"}
    command = [sys.executable, "-m", "keel", "train", "--preset", "tiny-dense", "--steps", "1"]
    command += ["--set", "mesh.sequence=4", "--set", "mesh.data=1", "--set", "phases.0.seq_len=100"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert "mesh.sequence" in lines[0] and "seq_len (100)" in lines[0]
