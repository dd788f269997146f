"""Ring attention: causal attention over a sequence split across the mesh's `sequence` axis.

Each of the n devices of SEQUENCE_AXIS holds 2 of the sequence's 2n equal chunks, chunk i and
chunk 2n-1-i (the zigzag split), so every device has the same causal work: `zigzag_order` gives
the token order that a contiguous split over the axis turns into that layout. The devices keep
their queries; keys, values and segment ids travel around the ring (jax.lax.ppermute inside
jax.shard_map), one hop per step, and each device merges the partial attention of its queries
over each visiting chunk by log-sum-exp (the online softmax of keel.model.blockwise, one chunk
pair at a time).

Work per step: at step 0 a device attends its own two chunks causally. At step s it holds the
keys of device j = (i - s) mod n: when j < i, all of its queries see j's first chunk and none of
its second; when j > i, only its second chunk's queries see anything, and they see all of j's.
Either way one unmasked (2c x c) block, c = seq_len / 2n: every device does the same work at
every step. Within a block the keys go KEY_BLOCK at a time (an online softmax again), so the
scores a device holds are [2c, KEY_BLOCK].

Gradients: JAX differentiates the ring loop (the ppermutes transpose to the reverse ring); each
step is rematerialised (jax.checkpoint), so the backward pass keeps each step's carry (the
visiting keys and values and the running output, O(seq_len x head_dim) per device over the
whole ring) rather than each step's [2c, c] probabilities. A custom VJP that sends dk and dv
around the ring would keep O(seq_len / n) instead; it is the next step for very long sequences.

Shapes (global, in zigzag order): q [batch, seq, n_heads, head_dim], k and v [batch, seq,
n_kv_heads, head_dim], segment_ids [batch, seq] or None -> [batch, seq, n_heads, head_dim].
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from keel.model.sharding import MESH_AXES, SEQUENCE_AXIS

_MASKED = -1e30
"""Score of a masked pair and log-sum-exp of a row that saw nothing: finite, so no NaN."""

TOKENS_SPEC = PartitionSpec(MESH_AXES, SEQUENCE_AXIS)
"""[batch, seq, ...] arrays: rows over the batch axes, tokens over the sequence axis."""


def zigzag_order(seq_len: int, parts: int) -> np.ndarray:
    """[seq_len] int32: the original position of each token in zigzag order, the order whose
    contiguous split into `parts` pieces gives piece i the chunks i and 2 * parts - 1 - i."""
    if seq_len % (2 * parts):
        raise ValueError(f"seq_len {seq_len} is not a multiple of 2 x {parts} sequence devices")
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * parts, -1)
    order = [chunks[k] for i in range(parts) for k in (i, 2 * parts - 1 - i)]
    return np.concatenate(order)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    mesh: Mesh,
) -> jax.Array:
    """Causal attention of tokens in zigzag order (`zigzag_order`) split over `mesh`'s
    SEQUENCE_AXIS (rows over its batch axes); shapes as the module docstring says."""
    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
    parts = mesh.shape[SEQUENCE_AXIS]
    if q.shape[1] % (2 * parts):
        raise ValueError(f"seq_len {q.shape[1]} is not a multiple of 2 x {parts} sequence devices")
    local = partial(_ring, parts=parts)
    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(TOKENS_SPEC, TOKENS_SPEC, TOKENS_SPEC, TOKENS_SPEC),
        out_specs=TOKENS_SPEC,
    )
    return sharded(q, k, v, segment_ids.astype(jnp.int32))


def _ring(q, k, v, segments, *, parts: int):
    """One device's queries [b, 2c, H, D] against every device's keys, passed around the ring."""
    me = jax.lax.axis_index(SEQUENCE_AXIS)
    chunk = q.shape[1] // 2
    own = _positions(me, chunk, parts)
    out, lse = jax.checkpoint(_partial)(q, k, v, own, own, segments, segments)
    ring = [(device, (device + 1) % parts) for device in range(parts)]

    @jax.checkpoint
    def step(carry, s):
        out, lse, k, v, key_segments = carry
        k, v, key_segments = (
            jax.lax.ppermute(x, SEQUENCE_AXIS, ring) for x in (k, v, key_segments)
        )
        source = (me - s) % parts
        keys = _positions(source, chunk, parts)

        def earlier(_):  # every query sees the source's first chunk, none sees its second
            lo = slice(0, chunk)
            return _partial(q, k[:, lo], v[:, lo], own, keys[lo], segments, key_segments[:, lo])

        def later(_):  # only the second chunk's queries see anything; they see all of it
            hi = slice(chunk, None)
            o, m = _partial(q[:, hi], k, v, own[hi], keys, segments[:, hi], key_segments)
            o = jnp.concatenate([jnp.zeros_like(o), o], axis=1)
            return o, jnp.concatenate([jnp.full_like(m, _MASKED), m], axis=1)

        out, lse = _merge((out, lse), jax.lax.cond(source < me, earlier, later, None))
        return (out, lse, k, v, key_segments), None

    (out, _, _, _, _), _ = jax.lax.scan(
        step, (out, lse, k, v, segments), jnp.arange(1, parts, dtype=jnp.int32)
    )
    return out.astype(q.dtype)


def _positions(device: jax.Array, chunk: int, parts: int) -> jax.Array:
    """[2c] original positions of `device`'s tokens: chunk `device`, then 2 * parts - 1 - it."""
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    return jnp.concatenate([device * chunk + offsets, (2 * parts - 1 - device) * chunk + offsets])


def _partial(q, k, v, q_positions, k_positions, q_segments, k_segments):
    """Attention of q [b, Sq, H, D] over k, v [b, Sk, H_kv, D] where a key is visible to a query
    at or after its position in the same segment: (output [b, Sq, H, D] float32, normalised
    over the visible keys; log-sum-exp of the scores [b, Sq, H] float32, _MASKED for a row that
    sees none). Keys are taken KEY_BLOCK at a time (an online softmax over the blocks, each
    rematerialised in the backward pass), so the scores in memory are [Sq, KEY_BLOCK]."""
    keys = k.shape[1]
    block = _key_block(keys)
    if block == keys:
        return _block(q, k, v, q_positions, k_positions, q_segments, k_segments)
    count = keys // block

    def blocks(x, axis):
        shape = (*x.shape[:axis], count, block, *x.shape[axis + 1 :])
        return jnp.moveaxis(x.reshape(shape), axis, 0)

    @jax.checkpoint
    def step(carry, key_block):
        kb, vb, pb, sb = key_block
        part = _block(q, kb, vb, q_positions, pb, q_segments, sb)
        return _merge(carry, part), None

    # *_like: the carry varies over the mesh axes q varies over (shard_map's type check).
    init = (jnp.zeros_like(q, jnp.float32), jnp.full_like(q[..., 0], _MASKED, jnp.float32))
    xs = (blocks(k, 1), blocks(v, 1), blocks(k_positions, 0), blocks(k_segments, 1))
    return jax.lax.scan(step, init, xs)[0]


KEY_BLOCK = 512
"""Keys per block of `_partial` (at most): its scores are [batch, heads, Sq, KEY_BLOCK] f32."""


def _key_block(keys: int) -> int:
    """The largest block of at most KEY_BLOCK keys that divides `keys`."""
    return next(size for size in range(min(keys, KEY_BLOCK), 0, -1) if keys % size == 0)


def _merge(a, b):
    """Two partial attentions (output, log-sum-exp) of the same queries over disjoint keys ->
    their attention over both keys."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    merged = jnp.logaddexp(lse_a, lse_b)
    weight_a, weight_b = jnp.exp(lse_a - merged), jnp.exp(lse_b - merged)
    return out_a * weight_a[..., None] + out_b * weight_b[..., None], merged


def _block(q, k, v, q_positions, k_positions, q_segments, k_segments):
    """`_partial` over one block of keys, its scores whole."""
    batch, q_len, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    group = n_heads // n_kv_heads
    qg = q.reshape(batch, q_len, n_kv_heads, group, head_dim) * jnp.asarray(
        1.0 / math.sqrt(head_dim), q.dtype
    )
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    visible = (q_positions[:, None] >= k_positions[None, :])[None] & (
        q_segments[:, :, None] == k_segments[:, None, :]
    )
    visible = visible[:, None, None]  # [b, 1, 1, Sq, Sk]
    scores = jnp.where(visible, scores, _MASKED)
    peak = scores.max(axis=-1)
    p = jnp.where(visible, jnp.exp(scores - peak[..., None]), 0.0)
    total = p.sum(axis=-1)
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, peak + jnp.log(safe_total), _MASKED)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / safe_total.transpose(0, 3, 1, 2)[..., None]
    lse = lse.transpose(0, 3, 1, 2).reshape(batch, q_len, n_heads)
    return out.reshape(batch, q_len, n_heads, head_dim), lse
