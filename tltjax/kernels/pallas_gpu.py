"""Pallas kernels (Triton lowering) for attention over the paged KV cache.

Two kernels, both exactly `tltjax.kernels.paged.paged_attention_reference`:

- `paged_decode_attention`: one new token per row (its own key already written).
- `tree_verify_attention`: a block of speculative tree tokens per row, seeing the
  committed tokens and each other through the tree mask.

Work split: one program per (row, kv head[, query-row tile], key split). A program
takes the whole query-head group of its kv head (GQA), so each key/value page is
read once per group rather than once per query head, and walks its key split in
blocks of whole pages with an online softmax. Splitting the keys (flash-decoding)
keeps the GPU busy in the long tail, where a handful of rows with 32K-token
contexts would otherwise give one program per kv head. XLA merges the splits'
partial results (a log-sum-exp reduction over a tiny array).

Triton constraints shape the wrappers: every loaded tile has power-of-two sides
and every matmul side is at least 16 (`tl.dot`), so the query group is padded to
16 rows and a key block spans at least 16 tokens. Without a GPU, ``interpret=True``
checks the semantics and exporting for "cuda" checks the lowering to Triton IR;
Triton's own compilation (to PTX) and the speed are only checked on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Bool, Float, Int

from tltjax.kernels.paged import token_slots

_NEG = -1e30  # finite, so a program that sees no key keeps m finite and l = 0
_MIN_TILE = 16  # smallest side tl.dot accepts
_TARGET_PROGRAMS = 256  # about two waves on an H100's 132 SMs


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def layout_problem(q_heads: int, head_dim: int, kv_shape: tuple[int, ...], v_shape: tuple[int, ...] | None = None,
                   table_dtype=jnp.int32) -> str | None:
    """Why the kernels cannot take this paged layout (Triton tiles, GQA), or None when they can.

    ``kv_shape`` is one layer's ``[kv_heads, pages, page_size, head_dim]`` page pool.
    """
    if v_shape is not None and tuple(kv_shape) != tuple(v_shape):
        return f"k_pages {tuple(kv_shape)} and v_pages {tuple(v_shape)} must have the same shape"
    kvh, _, page_size, d = kv_shape
    if d != head_dim:
        return f"queries have head_dim {head_dim} but pages hold {d}"
    if q_heads % kvh:
        return f"{q_heads} query heads are not a multiple of {kvh} kv heads"
    for name, n in (("page_size", page_size), ("head_dim", head_dim)):
        if n & (n - 1):
            return f"{name}={n}: the Triton kernels need a power of two; pick one for the paged cache"
    if head_dim < _MIN_TILE:
        return f"head_dim={head_dim}: the Triton kernels need head_dim >= {_MIN_TILE}"
    if table_dtype != jnp.int32:
        return f"page_table must be int32, got {table_dtype}"
    return None


def _check_layout(q_heads: int, head_dim: int, k_pages, v_pages, page_table) -> None:
    """Raises a ValueError naming the value that does not fit the paged layout or Triton."""
    problem = layout_problem(q_heads, head_dim, k_pages.shape, v_pages.shape, page_table.dtype)
    if problem:
        raise ValueError(problem)


def _key_splits(page_table, num_pages: int, page_size: int, block_keys: int, programs: int, num_splits):
    """Pads the page table into ``num_splits`` equal runs of whole key blocks.

    Returns (page table [B, splits * pages_per_split], pages_per_block, splits).
    """
    # A power of two (a Triton tile side) of whole pages, spanning at least _MIN_TILE keys.
    pages_per_block = _next_pow2(max(1, max(block_keys, _MIN_TILE) // page_size))
    n_blocks = pl.cdiv(page_table.shape[1], pages_per_block)
    if num_splits is None:
        # Enough programs to fill the GPU, but each split keeps a few blocks to amortise its merge.
        num_splits = max(1, min(pl.cdiv(_TARGET_PROGRAMS, programs), n_blocks // 4))
    splits = max(1, min(num_splits, n_blocks))
    pages_per_split = pl.cdiv(n_blocks, splits) * pages_per_block
    pad = splits * pages_per_split - page_table.shape[1]
    # Pages past a row's length are still loaded when they share a block with live ones (and masked),
    # so every id must point inside the page array, whatever the engine left in unused slots.
    table = jnp.clip(jnp.pad(page_table, ((0, 0), (0, pad))), 0, num_pages - 1)
    return table, pages_per_block, splits


def _dot(a, b, contract_b: int):
    """a @ b (contract_b=0) or a @ b.T (contract_b=1), accumulated in f32.

    HIGHEST keeps f32 inputs in IEEE f32 on Triton (its default is TF32, too coarse to match
    the reference); for bf16/f16 inputs it changes nothing.
    """
    return lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def _attend_block(carry, q, k, v, visible, scale: float):
    """One online-softmax step of the running (o, m, l) over a block of keys.

    ``o`` stays unnormalised; masked keys get probability exactly 0 (not exp(_NEG - m),
    which is 1 while every key seen so far is masked).
    """
    o, m, l = carry
    s = jnp.where(visible, _dot(q, k, 1) * scale, _NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = alpha * l + p.sum(axis=1)
    o_new = alpha[:, None] * o + _dot(p.astype(v.dtype), v, 0)
    return o_new, m_new, l_new


def _committed_loop(carry, q, length, first_page, pages_ref, k_ref, v_ref, *, scale, page_size, pages_per_block):
    """Runs `_attend_block` over the keys ``[0, length)`` that fall in this split's pages.

    Loops only over blocks holding a live key: the split's page run is sized for the
    longest row the table can hold, not this row.
    """
    pages_per_split = pages_ref.shape[0]
    block_k = pages_per_block * page_size
    rows, d = q.shape
    live_pages = jnp.clip(pl.cdiv(length, page_size) - first_page, 0, pages_per_split)

    def body(i, carry):
        ids = pages_ref[pl.ds(i * pages_per_block, pages_per_block)]
        k = k_ref[ids].reshape(block_k, d)
        v = v_ref[ids].reshape(block_k, d)
        pos = (first_page + i * pages_per_block) * page_size + jnp.arange(block_k)
        visible = lax.broadcast_in_dim(pos < length, (rows, block_k), (1,))
        return _attend_block(carry, q, k, v, visible, scale)

    return lax.fori_loop(0, pl.cdiv(live_pages, pages_per_block), body, carry)


def _init_carry(rows: int, d: int):
    return (
        jnp.zeros((rows, d), jnp.float32),
        jnp.full((rows,), _NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def _store(o_ref, m_ref, l_ref, carry):
    o, m, l = carry
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _merge_splits(o, m, l):
    """Combines per-split partials (o [..., S, R, D] unnormalised, m/l [..., S, R]) into [..., R, D].

    Rows that saw no key in any split (l = 0) come out as zeros, like the reference.
    """
    m_max = m.max(axis=-2, keepdims=True)
    w = jnp.exp(m - m_max)
    l_sum = (w * l).sum(axis=-2)
    o_sum = (w[..., None] * o).sum(axis=-3)
    return jnp.where(l_sum[..., None] > 0, o_sum / jnp.where(l_sum > 0, l_sum, 1.0)[..., None], 0.0)


def _decode_kernel(
    lengths_ref, pages_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, scale, page_size, pages_per_block
):
    length = lengths_ref[0]
    first_page = pl.program_id(2) * pages_ref.shape[0]
    q = q_ref[...]
    carry = _committed_loop(
        _init_carry(*q.shape), q, length, first_page, pages_ref, k_ref, v_ref,
        scale=scale, page_size=page_size, pages_per_block=pages_per_block,
    )
    _store(o_ref, m_ref, l_ref, carry)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_keys", "num_splits"))
def paged_decode_attention(
    q: Float[Array, "batch heads dim"],
    k_pages: Float[Array, "kv_heads pages page dim"],
    v_pages: Float[Array, "kv_heads pages page dim"],
    page_table: Int[Array, "batch pages_per_seq"],
    lengths_incl_new: Int[Array, " batch"],
    *,
    scale: float | None = None,
    interpret: bool = False,
    block_keys: int = 64,
    num_splits: int | None = None,
) -> Float[Array, "batch heads dim"]:
    """Attention of one new token per row over its keys ``0 .. lengths_incl_new - 1``.

    The token's own key/value must already be written (`paged.write_block`); all keys
    are visible. Rows of length 0 return zeros. ``block_keys`` tokens (whole pages,
    at least 16) are read per step; ``num_splits`` parallel key splits per row and kv
    head (default: enough to fill the GPU).
    """
    b, h, d = q.shape
    _check_layout(h, d, k_pages, v_pages, page_table)
    kvh, num_pages, page_size, _ = k_pages.shape
    g = h // kvh
    rows = max(_MIN_TILE, _next_pow2(g))
    scale = d**-0.5 if scale is None else scale
    table, pages_per_block, splits = _key_splits(page_table, num_pages, page_size, block_keys, b * kvh, num_splits)
    q_r = jnp.pad(q.reshape(b, kvh, g, d), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    kernel = functools.partial(_decode_kernel, scale=scale, page_size=page_size, pages_per_block=pages_per_block)
    pages_spec = pl.BlockSpec((None, num_pages, page_size, d), lambda b, h, s: (h, 0, 0, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, table.shape[1] // splits), lambda b, h, s: (b, s)),
            pl.BlockSpec((None, None, rows, d), lambda b, h, s: (b, h, 0, 0)),
            pages_spec,
            pages_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kvh, splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="paged_decode_attention",
    )(lengths_incl_new.astype(jnp.int32), table, q_r, k_pages, v_pages)
    out = _merge_splits(o, m, l)[:, :, :g]  # [B, KV, G, D]
    return out.reshape(b, h, d).astype(q.dtype)


def _tree_kernel(
    lengths_ref, pages_ref, q_ref, mask_ref, kt_ref, vt_ref, k_ref, v_ref, o_ref, m_ref, l_ref,
    *, scale, page_size, pages_per_block,
):
    split = pl.program_id(3)
    first_page = split * pages_ref.shape[0]
    q = q_ref[...]
    carry = _committed_loop(
        _init_carry(*q.shape), q, lengths_ref[0], first_page, pages_ref, k_ref, v_ref,
        scale=scale, page_size=page_size, pages_per_block=pages_per_block,
    )

    def tree_block(carry):
        return _attend_block(carry, q, kt_ref[...], vt_ref[...], mask_ref[...] != 0, scale)

    # The tree block joins exactly one split's softmax; the last split is usually the
    # lightest (it covers the end of the table, past most rows' lengths).
    carry = lax.cond(split == pl.num_programs(3) - 1, tree_block, lambda c: c, carry)
    _store(o_ref, m_ref, l_ref, carry)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_keys", "block_rows", "num_splits"))
def tree_verify_attention(
    q: Float[Array, "batch new heads dim"],
    k_pages: Float[Array, "kv_heads pages page dim"],
    v_pages: Float[Array, "kv_heads pages page dim"],
    page_table: Int[Array, "batch pages_per_seq"],
    lengths: Int[Array, " batch"],
    new_mask: Bool[Array, "batch new new"],
    *,
    scale: float | None = None,
    interpret: bool = False,
    block_keys: int = 64,
    block_rows: int = 64,
    num_splits: int | None = None,
) -> Float[Array, "batch new heads dim"]:
    """Attention of a block of tree tokens over committed tokens + the tree.

    The block's keys/values must already be written at ``lengths .. lengths + new - 1``
    (`paged.write_block`). Keys before ``lengths`` are all visible; tree keys per
    ``new_mask`` (query token, key token). Query rows are (token, head-in-group)
    pairs, tiled ``block_rows`` at a time.
    """
    b, t, h, d = q.shape
    _check_layout(h, d, k_pages, v_pages, page_table)
    kvh, num_pages, page_size, _ = k_pages.shape
    g = h // kvh
    scale = d**-0.5 if scale is None else scale
    rows = t * g
    tile = min(max(_MIN_TILE, _next_pow2(block_rows)), max(_MIN_TILE, _next_pow2(rows)))
    rows_pad = pl.cdiv(rows, tile) * tile
    t_pad = max(_MIN_TILE, _next_pow2(t))
    programs = b * kvh * (rows_pad // tile)
    table, pages_per_block, splits = _key_splits(page_table, num_pages, page_size, block_keys, programs, num_splits)

    # Row r = token * g + head-in-group, so the kv head's whole group shares each key tile.
    q_r = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, rows, d)
    q_r = jnp.pad(q_r, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
    mask_r = jnp.repeat(new_mask, g, axis=1)  # [B, rows, T]
    mask_r = jnp.pad(mask_r, ((0, 0), (0, rows_pad - rows), (0, t_pad - t))).astype(jnp.int32)
    # The tree's keys are at most a few dozen tokens that may straddle pages at any
    # offset; XLA gathers them densely so the kernel's tree step is one plain tile.
    pos = lengths[:, None] + jnp.arange(t_pad, dtype=lengths.dtype)[None, :]
    page, off = token_slots(page_table, pos, page_size)
    page = jnp.clip(page, 0, num_pages - 1)
    k_tree = k_pages[:, page, off].transpose(1, 0, 2, 3)  # [B, KV, T_pad, D]
    v_tree = v_pages[:, page, off].transpose(1, 0, 2, 3)

    kernel = functools.partial(_tree_kernel, scale=scale, page_size=page_size, pages_per_block=pages_per_block)
    pages_spec = pl.BlockSpec((None, num_pages, page_size, d), lambda b, h, r, s: (h, 0, 0, 0))
    tree_spec = pl.BlockSpec((None, None, t_pad, d), lambda b, h, r, s: (b, h, 0, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, kvh, rows_pad // tile, splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, r, s: (b,)),
            pl.BlockSpec((None, table.shape[1] // splits), lambda b, h, r, s: (b, s)),
            pl.BlockSpec((None, None, tile, d), lambda b, h, r, s: (b, h, r, 0)),
            pl.BlockSpec((None, tile, t_pad), lambda b, h, r, s: (b, r, 0)),
            tree_spec,
            tree_spec,
            pages_spec,
            pages_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, tile, d), lambda b, h, r, s: (b, h, s, r, 0)),
            pl.BlockSpec((None, None, None, tile), lambda b, h, r, s: (b, h, s, r)),
            pl.BlockSpec((None, None, None, tile), lambda b, h, r, s: (b, h, s, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kvh, splits, rows_pad, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, rows_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, rows_pad), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="tree_verify_attention",
    )(lengths.astype(jnp.int32), table, q_r, mask_r, k_tree, v_tree, k_pages, v_pages)
    out = _merge_splits(o, m, l)[:, :, :rows]  # [B, KV, T*G, D]
    out = out.reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, d).astype(q.dtype)
