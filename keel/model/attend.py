"""Which attention implementation computes softmax(q k^T / sqrt(d)) v: one registry, one choice.

Implementations share one contract, `fn(q [B, S, H, D], k [B, S, H_kv, D], v [B, S, H_kv, D],
segment_ids [B, S] | None) -> [B, S, H, D]`, causal, with document masking by segment ids:
- "xla": `jax.nn.dot_product_attention`'s XLA implementation; forms the S x S scores (and a
  [B, 1, S, S] mask with document masking), so its memory grows with S^2.
- "blockwise": keel.model.blockwise, an online softmax over key blocks; memory grows with S.
- "cudnn": cuDNN's fused flash attention on NVIDIA GPUs (bfloat16/float16, no document masks).
`model.attention: auto` picks cudnn on a GPU when it can (16-bit compute, no document mask),
else blockwise from BLOCKWISE_FROM_SEQ_LEN tokens per sequence, else xla.
On a mesh whose `sequence` axis has more than one device, attention is ring attention
(keel.model.ring) whatever `model.attention` says: tokens arrive split over that axis.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from keel.core.errors import ConfigError
from keel.model.blockwise import blockwise_attention, reference_attention
from keel.model.ring import ring_attention
from keel.model.sharding import SEQUENCE_AXIS, axis_size

BLOCKWISE_FROM_SEQ_LEN = 512
"""`auto` uses blockwise attention from this many tokens per sequence. Measured for tiny-dense
(batch 1, forward + backward) on this project's 2-core CPU (benchmarks/attention_bench.py): the
same time at 128 and 256 tokens (0.03 s, 0.07 s), blockwise faster from 512 (0.46 s vs 0.61 s;
2K: 3.0 s vs 5.1 s) with a fraction of the temporaries. Unmeasured on GPUs, where float32 runs
take this rule too (bfloat16 ones take cudnn)."""

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
    mesh: Mesh | None = None,
) -> jax.Array:
    """Causal attention by implementation `kind`: q [B, S, H, D], k and v [B, S, H_kv, D],
    segment_ids [B, S] or None -> [B, S, H, D]. With a `mesh` whose sequence axis is split, ring
    attention over it (tokens in keel.model.ring.zigzag_order)."""
    if axis_size(mesh, SEQUENCE_AXIS) > 1:
        return ring_attention(q, k, v, segment_ids, mesh)
    name = choose(kind, q.shape[1], q.dtype, segment_ids is not None)
    return IMPLEMENTATIONS[name](q, k, v, segment_ids)
