"""Attention kernels and the one dispatch point that chooses them by backend."""

from __future__ import annotations

import jax
from jaxtyping import Array, Bool, Float, Int

from tltjax.kernels import pallas_gpu
from tltjax.kernels.attention import attention
from tltjax.kernels.paged import paged_attention_reference, write_block

__all__ = ["attention", "paged_attention", "paged_attention_reference", "write_block", "PAGED_IMPLS"]


def _paged_pallas(q, k_pages, v_pages, page_table, lengths, new_mask, *, scale, interpret):
    if q.shape[1] == 1:
        # A lone new token sees the committed keys and, per its 1x1 mask, itself: counting
        # it into the length makes the decode kernel exact for either mask value.
        lengths_incl_new = lengths + new_mask[:, 0, 0].astype(lengths.dtype)
        out = pallas_gpu.paged_decode_attention(
            q[:, 0], k_pages, v_pages, page_table, lengths_incl_new, scale=scale, interpret=interpret
        )
        return out[:, None]
    return pallas_gpu.tree_verify_attention(
        q, k_pages, v_pages, page_table, lengths, new_mask, scale=scale, interpret=interpret
    )


def _reference(q, k_pages, v_pages, page_table, lengths, new_mask, *, scale, layer):
    return paged_attention_reference(q, k_pages, v_pages, page_table, lengths, new_mask, scale=scale, layer=layer)


def _layer(pages, layer):
    # The Triton kernels read one layer's pool; slicing it out of the [layers, ...] pool is a copy.
    return pages if layer is None else pages[layer]


def _pallas(q, k_pages, v_pages, *args, scale, layer):
    return _paged_pallas(q, _layer(k_pages, layer), _layer(v_pages, layer), *args, scale=scale, interpret=False)


def _pallas_interpret(q, k_pages, v_pages, *args, scale, layer):
    return _paged_pallas(q, _layer(k_pages, layer), _layer(v_pages, layer), *args, scale=scale, interpret=True)


def _pallas_fits(q, k_pages, layer) -> bool:
    """On a GPU, whether the Triton kernels take this layout (shapes are static, so this is a trace-time choice)."""
    if jax.default_backend() != "gpu":
        return False
    pool = k_pages.shape if layer is None else k_pages.shape[1:]
    return pallas_gpu.layout_problem(q.shape[2], q.shape[3], pool) is None


# Implementations of `paged_attention` by name; "auto" picks one by backend.
PAGED_IMPLS = {"reference": _reference, "pallas": _pallas, "pallas_interpret": _pallas_interpret}


def paged_attention(
    q: Float[Array, "batch new heads dim"],
    k_pages: Float[Array, "kv_heads pages page dim"],
    v_pages: Float[Array, "kv_heads pages page dim"],
    page_table: Int[Array, "batch pages_per_seq"],
    lengths: Int[Array, " batch"],
    new_mask: Bool[Array, "batch new new"],
    *,
    scale: float | None = None,
    impl: str = "auto",
    layer: int | None = None,
) -> Float[Array, "batch new heads dim"]:
    """Attention of a new block over a paged cache: the one dispatch point.

    Semantics are `paged_attention_reference`'s (the block already written at
    ``lengths`` by `write_block`). ``impl``: "auto" runs the Pallas kernels on GPU
    (the decode kernel for one new token, the tree kernel otherwise) and the XLA
    reference elsewhere, and on a GPU too for a layout the kernels cannot tile
    (`pallas_gpu.layout_problem`: head_dim < 16 or not a power of two, a page size
    that is not a power of two); "pallas", "pallas_interpret" (the kernels in interpret
    mode, for CPU tests) and "reference" force one. With ``layer``, ``k_pages`` and
    ``v_pages`` are the whole ``[layers, kv_heads, pages, page, dim]`` pool.
    """
    if impl == "auto":
        impl = "pallas" if _pallas_fits(q, k_pages, layer) else "reference"
    if impl not in PAGED_IMPLS:
        raise ValueError(f"paged_attention impl={impl!r} is unknown; choose 'auto' or one of {sorted(PAGED_IMPLS)}")
    return PAGED_IMPLS[impl](q, k_pages, v_pages, page_table, lengths, new_mask, scale=scale, layer=layer)
