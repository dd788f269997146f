"""The small pieces every block uses: RMSNorm, the SwiGLU MLP, and parameter initialisation.

Shapes: x [..., d_model]; an MLP of hidden width f has w_gate, w_up [d_model, f] and
w_down [f, d_model]. Norms compute in float32 whatever the input dtype and return that dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MlpParams:
    w_gate: jax.Array
    """[d_in, f]"""
    w_up: jax.Array
    """[d_in, f]"""
    w_down: jax.Array
    """[f, d_out]"""


def normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    """float32 normal(0, std) weights: the one initialiser of the model's matrices."""
    return std * jax.random.normal(key, shape, jnp.float32)


def init_mlp(key: jax.Array, d_model: int, hidden: int, std: float, n_layers: int) -> MlpParams:
    """A SwiGLU MLP; the output projection is scaled by 1/sqrt(2 * n_layers) (GPT-2's residual
    scaling) so the residual stream's variance does not grow with depth."""
    k_gate, k_up, k_down = jax.random.split(key, 3)
    return MlpParams(
        w_gate=normal(k_gate, (d_model, hidden), std),
        w_up=normal(k_up, (d_model, hidden), std),
        w_down=normal(k_down, (hidden, d_model), std / (2 * n_layers) ** 0.5),
    )


def swiglu(params: MlpParams, x: jax.Array) -> jax.Array:
    """[..., d_in] -> [..., d_out]: (silu(x W_gate) * x W_up) W_down."""
    return (jax.nn.silu(x @ params.w_gate) * (x @ params.w_up)) @ params.w_down


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * scale over the last axis, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)
