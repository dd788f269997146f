"""Which attention implementation computes softmax(q k^T / sqrt(d)) v: one registry, one choice.

Implementations share one contract, `fn(q [B, S, H, D], k [B, S, H_kv, D], v [B, S, H_kv, D],
segment_ids [B, S] | None) -> [B, S, H, D]`, causal, with document masking by segment ids:
- "xla": `jax.nn.dot_product_attention`'s XLA implementation; forms the S x S scores (and a
  [B, 1, S, S] mask with document masking), so its memory grows with S^2.
- "blockwise": keel.model.blockwise, an online softmax over key blocks; memory grows with S.
- "cudnn": cuDNN's fused flash attention on NVIDIA GPUs (bfloat16/float16, no document masks).
`model.attention: auto` picks cudnn on a GPU when it can (16-bit compute, no document mask),
else blockwise from BLOCKWISE_FROM_SEQ_LEN tokens per sequence, else xla.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from keel.core.errors import ConfigError
from keel.model.blockwise import blockwise_attention, reference_attention

BLOCKWISE_FROM_SEQ_LEN = 2048
"""`auto` uses blockwise attention from this many tokens per sequence. Measured for tiny-dense
on this project's 2-core CPU (docs/training.md, "Attention implementations"): below it XLA's
attention is as fast or faster and its S x S scores are small; from 2K on blockwise is faster
and its temporaries are a fraction."""

_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def _cudnn(q, k, v, segment_ids):
    if segment_ids is not None:
        raise ConfigError(
            "model.attention=cudnn cannot mask documents (mask_documents: true); use "
            "model.attention=blockwise or auto"
        )
    if q.dtype not in _CUDNN_DTYPES:
        raise ConfigError(
            f"model.attention=cudnn needs bfloat16 or float16 compute, got {q.dtype}; set "
            "compute_dtype: bfloat16 or use model.attention=blockwise"
        )
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


IMPLEMENTATIONS: dict[str, Callable[..., jax.Array]] = {
    "blockwise": blockwise_attention,
    "xla": reference_attention,
    "cudnn": _cudnn,
}
"""By name, the implementations `model.attention` may name (besides "auto")."""


def choose(kind: str, seq_len: int, dtype, has_segments: bool) -> str:
    """The implementation `kind` stands for at `seq_len` tokens per sequence: `kind` itself, or
    for "auto" cudnn / blockwise / xla as the module docstring says."""
    if kind != "auto":
        if kind not in IMPLEMENTATIONS:
            known = ", ".join(["auto", *IMPLEMENTATIONS])
            raise ConfigError(f"model.attention: unknown implementation {kind!r}; known: {known}")
        return kind
    if jax.default_backend() == "gpu" and not has_segments and dtype in _CUDNN_DTYPES:
        return "cudnn"
    return "blockwise" if seq_len >= BLOCKWISE_FROM_SEQ_LEN else "xla"


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    kind: str = "auto",
) -> jax.Array:
    """Causal attention by implementation `kind`: q [B, S, H, D], k and v [B, S, H_kv, D],
    segment_ids [B, S] or None -> [B, S, H, D]."""
    name = choose(kind, q.shape[1], q.dtype, segment_ids is not None)
    return IMPLEMENTATIONS[name](q, k, v, segment_ids)
