"""Masked grouped-query attention: the XLA reference every kernel is checked against.

The mask is explicit (``[batch, queries, keys]`` booleans), which covers causal
prefill, decode against a cache, packed segments and speculative-tree masks with
one function. Softmax runs in float32 whatever the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

_NEG = -1e30  # finite, so a fully masked (padding) row gives zeros, never NaN


def attention(
    q: Float[Array, "batch q heads dim"],
    k: Float[Array, "batch kv kv_heads dim"],
    v: Float[Array, "batch kv kv_heads dim"],
    mask: Bool[Array, "batch q kv"],
    *,
    scale: float | None = None,
) -> Float[Array, "batch q heads dim"]:
    """softmax(q·kᵀ·scale + mask)·v with query heads grouped over shared kv heads.

    A query row whose mask is all False returns zeros.
    """
    b, t, h, d = q.shape
    kvh = k.shape[2]
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")
    g = h // kvh
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kvh, g, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    m = mask[:, None, None, :, :]
    s = jnp.where(m, s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(m, p, 0.0)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, h, d).astype(q.dtype)
