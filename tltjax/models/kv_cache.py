"""KV caches behind one interface.

The transformer never indexes a cache itself. For each layer it calls
``cache.attend(layer, q, k_new, v_new, new_mask)``, which writes the new keys and
values after the row's committed tokens and attends over *committed tokens +
the new block*, where the new block sees itself through ``new_mask`` (causal for
prefill/decode, a tree mask for speculative verification). After the forward
pass the caller commits how many of the new tokens to keep (``advance``), or
keeps an arbitrary subset (``keep``, for an accepted tree path).

`ContiguousKVCache` stores ``[layers, batch, slots, kv_heads, head_dim]``; the
rollout engine's paged cache implements the same methods over page tables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from tltjax.kernels import attention


@struct.dataclass
class ContiguousKVCache:
    """A dense cache: each row owns ``slots`` positions; ``lengths`` are committed tokens.

    Invariant: slots ``[0, lengths[b])`` of row ``b`` hold the keys/values of its
    tokens in order; everything past them is scratch.
    """

    k: Float[Array, "layers batch slots kv_heads dim"]
    v: Float[Array, "layers batch slots kv_heads dim"]
    lengths: Int[Array, " batch"]

    @classmethod
    def init(cls, config, batch: int, slots: int, dtype=None) -> "ContiguousKVCache":
        """An empty cache for ``batch`` rows of up to ``slots`` tokens each."""
        dtype = dtype or config.jnp_dtype
        shape = (config.num_hidden_layers, batch, slots, config.num_key_value_heads, config.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32)
        )

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def attend(
        self,
        layer: int,
        q: Float[Array, "batch new heads dim"],
        k_new: Float[Array, "batch new kv_heads dim"],
        v_new: Float[Array, "batch new kv_heads dim"],
        new_mask: Bool[Array, "batch new new"],
    ) -> tuple[Float[Array, "batch new heads dim"], "ContiguousKVCache"]:
        """Writes the new block at ``lengths`` and attends over committed + visible new tokens.

        The caller guarantees ``lengths + new <= slots`` (the engine allocates
        ahead); the committed length is not changed here.
        """
        t = q.shape[1]
        write = jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice_in_dim(c, x, s, axis=0))
        k_l = write(self.k[layer], k_new.astype(self.k.dtype), self.lengths)
        v_l = write(self.v[layer], v_new.astype(self.v.dtype), self.lengths)
        slot = jnp.arange(self.slots)[None, :]  # [1, S]
        rel = slot - self.lengths[:, None]  # [B, S] position inside the new block
        in_new = (rel >= 0) & (rel < t)
        from_new = jnp.take_along_axis(
            new_mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (q.shape[0], t, self.slots)), axis=2
        )
        mask = (rel < 0)[:, None, :] | (in_new[:, None, :] & from_new)
        out = attention(q, k_l, v_l, mask)
        cache = self.replace(k=self.k.at[layer].set(k_l), v=self.v.at[layer].set(v_l))
        return out, cache

    def advance(self, n: Int[Array, " batch"] | int) -> "ContiguousKVCache":
        """Commits the first ``n`` tokens of the block just written (per row)."""
        return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

    def keep(self, idx: Int[Array, "batch n"], count: Int[Array, " batch"]) -> "ContiguousKVCache":
        """Commits the block tokens ``idx[b, :count[b]]`` (indices into the block just written).

        Used after tree verification: the accepted path's entries move to the
        front of the block; entries not kept become scratch.
        """
        src = self.lengths[:, None] + idx  # [B, n] absolute slots
        dst = self.lengths[:, None] + jnp.arange(idx.shape[1])[None, :]
        valid = jnp.arange(idx.shape[1])[None, :] < count[:, None]

        def move(c):  # c: [L, B, S, KV, D]
            gathered = jnp.take_along_axis(c, src[None, :, :, None, None], axis=2)
            cur = jnp.take_along_axis(c, dst[None, :, :, None, None], axis=2)
            new = jnp.where(valid[None, :, :, None, None], gathered, cur)
            b_idx = jnp.arange(c.shape[1])[:, None]
            return c.at[:, b_idx, dst].set(new)

        return self.replace(k=move(self.k), v=move(self.v), lengths=self.lengths + count.astype(jnp.int32))
