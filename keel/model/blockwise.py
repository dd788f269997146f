"""Blockwise (flash-style) causal attention: an online softmax over key blocks, never S x S.

Shapes: q [batch, seq, n_heads, head_dim]; k, v [batch, seq, n_kv_heads, head_dim] with n_heads a
multiple of n_kv_heads (grouped-query attention: each key/value head serves n_heads / n_kv_heads
query heads); segment_ids [batch, seq] (int) or None. Output: [batch, seq, n_heads, head_dim] in
q's dtype.

The sequence is cut into blocks of `block_size` positions (padded at the end to a whole block;
padded keys come after every real query, so the causal mask hides them). For query block i the
forward pass walks key blocks 0..i only (blocks above the diagonal are entirely masked and
skipped), keeping a running max m, sum l and output o per query row in float32; scores are
[batch, kv_heads, group, block, block] per step, so the memory is O(seq x head_dim), not
O(seq^2). The backward pass is a custom VJP that recomputes each block's probabilities from the
saved log-sum-exp (FlashAttention-2's backward): one sweep over query blocks for dq, one over key
blocks for dk and dv, each skipping the blocks above the diagonal.

With `segment_ids`, a position attends only to earlier positions with the same id (document
masking); every row sees at least its own position, so no row is empty.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_BLOCK_SIZE = 256
"""Positions per query and key block. Forward + backward of one tiny-dense layer's attention on
this project's 2-core CPU (medians of 3, loaded machine): at 2K tokens 0.59 s with 256, 1.0 s
with 512; at 4K 1.9 s with 256, 2.0 s with 512, 2.2 s with 128. A score block is
batch x n_heads x 256 x 256 x 4 bytes (1 MiB for batch 1 and 4 heads)."""

_MASKED = -1e30
"""The score of a masked pair: finite, so a row whose block is all masked gives no NaN."""


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> jax.Array:
    """Causal softmax(q k^T / sqrt(head_dim)) v, blockwise: q [B, S, H, D], k and v
    [B, S, H_kv, D], segment_ids [B, S] or None -> [B, S, H, D] (q's dtype)."""
    batch, seq, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) is not a multiple of n_kv_heads ({n_kv_heads})")
    block = min(block_size, seq)
    n_blocks = -(-seq // block)
    padded = n_blocks * block
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, seq), jnp.int32)
    if padded != seq:
        pad = ((0, 0), (0, padded - seq), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded - seq)), constant_values=-1)
    group = n_heads // n_kv_heads
    # Block-major layouts: q [n, B, b, H_kv, G, D]; k, v [n, B, b, H_kv, D]; ids [n, B, b].
    qb = q.reshape(batch, n_blocks, block, n_kv_heads, group, head_dim).swapaxes(0, 1)
    kb = k.reshape(batch, n_blocks, block, n_kv_heads, head_dim).swapaxes(0, 1)
    vb = v.reshape(batch, n_blocks, block, n_kv_heads, head_dim).swapaxes(0, 1)
    ids = segment_ids.astype(jnp.int32).reshape(batch, n_blocks, block).swapaxes(0, 1)
    out = _flash(qb, kb, vb, ids)  # [n, B, b, H_kv, G, D]
    out = out.swapaxes(0, 1).reshape(batch, padded, n_heads, head_dim)
    return out[:, :seq]


def _mask(i: jax.Array, j: jax.Array, ids_q: jax.Array, ids_k: jax.Array) -> jax.Array:
    """[B, 1, 1, b_q, b_k]: key j-block position <= query i-block position, same segment."""
    block = ids_q.shape[-1]
    positions = jnp.arange(block)
    causal = (i * block + positions)[:, None] >= (j * block + positions)[None, :]
    same = ids_q[:, :, None] == ids_k[:, None, :]
    return (causal[None] & same)[:, None, None]


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [B, b, H_kv, G, D] (already scaled), k [B, b, H_kv, D] -> [B, H_kv, G, b_q, b_k] f32."""
    return jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32)


def _probabilities(qi, kj, ids_i, ids_j, i, j, lse_i) -> jax.Array:
    """exp(score - logsumexp) of block (i, j), zero where masked: [B, H_kv, G, b_q, b_k] f32."""
    mask = _mask(i, j, ids_i, ids_j)
    return jnp.where(mask, jnp.exp(_scores(qi, kj) - lse_i[..., None]), 0.0)


@jax.custom_vjp
def _flash(qb, kb, vb, ids):
    return _forward(qb, kb, vb, ids)[0]


def _forward(qb, kb, vb, ids):
    """The output [n, B, b, H_kv, G, D] and each row's log-sum-exp [n, B, H_kv, G, b] (f32)."""
    n_blocks, batch, block, n_kv_heads, group, head_dim = qb.shape
    scale = 1.0 / math.sqrt(head_dim)

    def query_block(i):
        qi, ids_i = qb[i] * jnp.asarray(scale, qb.dtype), ids[i]
        rows = (batch, n_kv_heads, group, block)

        def key_block(j, carry):
            o, m, total = carry
            s = jnp.where(_mask(i, j, ids_i, ids[j]), _scores(qi, kb[j]), _MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(s > _MASKED, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            pv = jnp.einsum(
                "bhgqk,bkhd->bhgqd", p.astype(vb.dtype), vb[j], preferred_element_type=jnp.float32
            )
            return o * correction[..., None] + pv, m_new, total * correction + p.sum(axis=-1)

        init = (
            jnp.zeros((*rows, head_dim), jnp.float32),
            jnp.full(rows, _MASKED, jnp.float32),
            jnp.zeros(rows, jnp.float32),
        )
        o, m, total = jax.lax.fori_loop(0, i + 1, key_block, init)
        out = (o / total[..., None]).transpose(0, 3, 1, 2, 4)  # [B, b, H_kv, G, D]
        return out.astype(qb.dtype), m + jnp.log(total)

    return jax.lax.map(query_block, jnp.arange(n_blocks))


def _flash_forward(qb, kb, vb, ids):
    out, lse = _forward(qb, kb, vb, ids)
    return out, (qb, kb, vb, ids, out, lse)


def _flash_backward(residuals, d_out):
    qb, kb, vb, ids, out, lse = residuals
    n_blocks, head_dim = qb.shape[0], qb.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    scaled_q = qb * jnp.asarray(scale, qb.dtype)
    # delta = rowsum(dO * O) [n, B, H_kv, G, b]: the softmax's Jacobian term per query row.
    delta = jnp.einsum("nbqhgd,nbqhgd->nbhgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    d_out = d_out.astype(vb.dtype)

    def d_scores(i, j):
        """dS of block (i, j) [B, H_kv, G, b_q, b_k] f32, and its probabilities P."""
        p = _probabilities(scaled_q[i], kb[j], ids[i], ids[j], i, j, lse[i])
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", d_out[i], vb[j], preferred_element_type=jnp.float32)
        return p * (dp - delta[i][..., None]), p

    def dq_block(i):
        def step(j, dq):
            ds, _ = d_scores(i, j)
            return dq + jnp.einsum(
                "bhgqk,bkhd->bqhgd", ds.astype(kb.dtype), kb[j], preferred_element_type=jnp.float32
            )

        dq = jax.lax.fori_loop(0, i + 1, step, jnp.zeros(qb.shape[1:], jnp.float32))
        return (dq * scale).astype(qb.dtype)

    def dkv_block(j):
        def step(i, carry):
            dk, dv = carry
            ds, p = d_scores(i, j)
            dv = dv + jnp.einsum(
                "bhgqk,bqhgd->bkhd",
                p.astype(vb.dtype),
                d_out[i],
                preferred_element_type=jnp.float32,
            )
            dk = dk + jnp.einsum(
                "bhgqk,bqhgd->bkhd",
                ds.astype(qb.dtype),
                scaled_q[i],
                preferred_element_type=jnp.float32,
            )
            return dk, dv

        zeros = jnp.zeros(kb.shape[1:], jnp.float32)
        dk, dv = jax.lax.fori_loop(j, n_blocks, step, (zeros, zeros))
        return dk.astype(kb.dtype), dv.astype(vb.dtype)

    dq = jax.lax.map(dq_block, jnp.arange(n_blocks))
    dk, dv = jax.lax.map(dkv_block, jnp.arange(n_blocks))
    return dq, dk, dv, np.zeros(ids.shape, jax.dtypes.float0)


_flash.defvjp(_flash_forward, _flash_backward)


def reference_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None
) -> jax.Array:
    """The same attention through XLA's `jax.nn.dot_product_attention` with a [B, 1, S, S] mask:
    what blockwise_attention must equal (it forms the S x S scores)."""
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
