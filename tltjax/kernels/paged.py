"""The paged KV layout and its XLA references.

Layout: ``k_pages``/``v_pages`` are ``[kv_heads, num_pages, page_size, head_dim]``;
``page_table[b]`` lists the pages of row ``b`` in order and ``lengths[b]`` counts
its committed tokens. Token ``i`` of row ``b`` lives in page
``page_table[b, i // page_size]`` at offset ``i % page_size``. Rows own pages, not
slots, so cache memory follows the tokens actually held, and compacting a batch
moves page tables, never pages.

The functions here define the semantics that the Pallas kernels
(`tltjax.kernels.pallas_gpu`) must reproduce exactly.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from tltjax.kernels.attention import attention


def token_slots(
    page_table: Int[Array, "batch pages_per_seq"],
    positions: Int[Array, "batch n"],
    page_size: int,
) -> tuple[Int[Array, "batch n"], Int[Array, "batch n"]]:
    """(page id, offset in page) of each token position of each row."""
    page = jnp.take_along_axis(page_table, positions // page_size, axis=1, mode="clip")
    return page, positions % page_size


def write_block(
    k_pages: Float[Array, "*layers kv_heads pages page dim"],
    v_pages: Float[Array, "*layers kv_heads pages page dim"],
    page_table: Int[Array, "batch pages_per_seq"],
    lengths: Int[Array, " batch"],
    k_new: Float[Array, "batch new kv_heads dim"],
    v_new: Float[Array, "batch new kv_heads dim"],
    layer: int | None = None,
) -> tuple[Float[Array, "*layers kv_heads pages page dim"], Float[Array, "*layers kv_heads pages page dim"]]:
    """Pages with row ``b``'s new block written at token positions ``lengths[b] ..+ new``.

    Pure (a scatter); committed lengths are not changed. With ``layer``, the
    pages are the whole ``[layers, ...]`` pool and only that layer is written,
    in place (no copy of a layer's pool). The caller guarantees that each row's
    page table covers ``lengths + new`` tokens and that rows being written do
    not share pages.
    """
    t = k_new.shape[1]
    pos = lengths[:, None] + jnp.arange(t, dtype=lengths.dtype)[None, :]
    page, off = token_slots(page_table, pos, k_pages.shape[-2])
    # [B, T, KV, D] -> [KV, B, T, D] to match the advanced-index result pages[(layer,) kv, page, off].
    k_vals = k_new.transpose(2, 0, 1, 3).astype(k_pages.dtype)
    v_vals = v_new.transpose(2, 0, 1, 3).astype(v_pages.dtype)
    if layer is None:
        return k_pages.at[:, page, off].set(k_vals), v_pages.at[:, page, off].set(v_vals)
    kv = jnp.arange(k_pages.shape[1])[:, None, None]
    idx = (layer, kv, page[None], off[None])
    return k_pages.at[idx].set(k_vals), v_pages.at[idx].set(v_vals)


def gather_pages(
    pages: Float[Array, "*layers kv_heads pages page dim"],
    page_table: Int[Array, "batch pages_per_seq"],
    layer: int | None = None,
) -> Float[Array, "batch keys kv_heads dim"]:
    """Each row's pages laid out densely: ``[batch, pages_per_seq * page_size, kv_heads, dim]``.

    With ``layer``, ``pages`` is the whole pool and one gather reads that layer's pages.
    """
    if layer is None:
        kvh, _, page_size, d = pages.shape
        b, pps = page_table.shape
        dense = pages[:, page_table]  # [KV, B, PPS, P, D]
        return dense.reshape(kvh, b, pps * page_size, d).transpose(1, 2, 0, 3)
    _, kvh, _, page_size, d = pages.shape
    b, pps = page_table.shape
    dense = pages[layer, :, page_table]  # [B, PPS, KV, P, D]
    return dense.transpose(0, 1, 3, 2, 4).reshape(b, pps * page_size, kvh, d)


def cache_mask(
    lengths: Int[Array, " batch"],
    new_mask: Bool[Array, "batch new new"],
    num_keys: int,
) -> Bool[Array, "batch new keys"]:
    """Which of ``num_keys`` cache positions each new token sees.

    Positions before ``lengths`` (committed) are all visible; the block at
    ``lengths .. lengths + new - 1`` is visible per ``new_mask``; the rest is scratch.
    """
    b, t, _ = new_mask.shape
    rel = jnp.arange(num_keys)[None, :] - lengths[:, None]  # [B, S] position inside the new block
    in_new = (rel >= 0) & (rel < t)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (b, t, num_keys))
    from_new = jnp.take_along_axis(new_mask, idx, axis=2)
    return (rel < 0)[:, None, :] | (in_new[:, None, :] & from_new)


def paged_attention_reference(
    q: Float[Array, "batch new heads dim"],
    k_pages: Float[Array, "*layers kv_heads pages page dim"],
    v_pages: Float[Array, "*layers kv_heads pages page dim"],
    page_table: Int[Array, "batch pages_per_seq"],
    lengths: Int[Array, " batch"],
    new_mask: Bool[Array, "batch new new"],
    *,
    scale: float | None = None,
    layer: int | None = None,
) -> Float[Array, "batch new heads dim"]:
    """Attention of a new block over committed tokens + the block, read from pages.

    Exactly `ContiguousKVCache.attend` after the block was written
    (`write_block`): keys ``0 .. lengths-1`` are all visible, keys
    ``lengths .. lengths+new-1`` per ``new_mask``. Decode is ``new == 1``.
    A query that sees no key returns zeros. With ``layer``, the pages are the
    whole ``[layers, ...]`` pool.
    """
    k = gather_pages(k_pages, page_table, layer)
    v = gather_pages(v_pages, page_table, layer)
    mask = cache_mask(lengths, new_mask, k.shape[1])
    return attention(q, k, v, mask, scale=scale)
