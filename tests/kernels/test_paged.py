"""The paged KV layout: block writes and the reference attention against the contiguous cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tltjax.kernels.paged import gather_pages, paged_attention_reference, write_block
from tltjax.models.kv_cache import ContiguousKVCache


def tree_mask(parents):
    """[T, T] mask of a draft tree given each node's parent (-1: root): a node sees its ancestors and itself."""
    t = len(parents)
    mask = np.eye(t, dtype=bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return mask


def random_paged(rng, *, batch, kv_heads, head_dim, page_size, pages_per_seq, spare_pages=3, dtype=jnp.float32):
    """Random k/v pages plus a shuffled page table (rows own disjoint pages, some pages unused)."""
    num_pages = batch * pages_per_seq + spare_pages
    shape = (kv_heads, num_pages, page_size, head_dim)
    k = jnp.asarray(rng.randn(*shape), dtype)
    v = jnp.asarray(rng.randn(*shape), dtype)
    table = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    return k, v, jnp.asarray(table, jnp.int32)


def test_write_block_round_trip():
    """write_block puts token i of row b at page_table[b, i // P], offset i % P: gathering gives the data back,
    and no other token (other rows, other positions, unused pages) changes."""
    rng = np.random.RandomState(0)
    b, kvh, d, p, pps, t = 3, 2, 16, 4, 4, 6
    k_pages, v_pages, table = random_paged(rng, batch=b, kv_heads=kvh, head_dim=d, page_size=p, pages_per_seq=pps)
    lengths = jnp.array([0, 3, 10], jnp.int32)  # the last block crosses two page boundaries
    k_new = jnp.asarray(rng.randn(b, t, kvh, d), jnp.float32)
    v_new = jnp.asarray(rng.randn(b, t, kvh, d), jnp.float32)
    k2, v2 = jax.jit(write_block)(k_pages, v_pages, table, lengths, k_new, v_new)
    gather = jax.jit(gather_pages)
    for before, after, new in ((k_pages, k2, k_new), (v_pages, v2, v_new)):
        dense_after = gather(after, table)
        expect = np.array(gather(before, table))
        for row, n in enumerate(np.asarray(lengths)):
            expect[row, n : n + t] = new[row]
        np.testing.assert_array_equal(np.asarray(dense_after), expect)
        unused = np.setdiff1d(np.arange(before.shape[1]), np.asarray(table))
        np.testing.assert_array_equal(np.asarray(after[:, unused]), np.asarray(before[:, unused]))


def _contiguous_and_paged(rng, *, batch, kv_heads, head_dim, page_size, pages_per_seq, lengths):
    """The same committed tokens held by a ContiguousKVCache (1 layer) and by shuffled pages."""
    slots = page_size * pages_per_seq
    k_dense = jnp.asarray(rng.randn(batch, slots, kv_heads, head_dim), jnp.float32)
    v_dense = jnp.asarray(rng.randn(batch, slots, kv_heads, head_dim), jnp.float32)
    lengths = jnp.asarray(lengths, jnp.int32)
    cache = ContiguousKVCache(k=k_dense[None], v=v_dense[None], lengths=lengths)
    k_pages, v_pages, table = random_paged(
        rng, batch=batch, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, pages_per_seq=pages_per_seq
    )
    zeros = jnp.zeros((batch,), jnp.int32)
    k_pages, v_pages = jax.jit(write_block)(k_pages, v_pages, table, zeros, k_dense, v_dense)
    return cache, k_pages, v_pages, table


@pytest.mark.parametrize(
    "name,mask",
    [("decode", np.ones((1, 1), bool)), ("tree", tree_mask([-1, 0, 0, 1, 1, 2]))],
)
def test_reference_equals_contiguous_cache_attend(name, mask):
    """paged_attention_reference after write_block == ContiguousKVCache.attend on the same tokens
    (GQA 2, ragged lengths incl. 0 and a page boundary), and both caches then hold the same keys."""
    rng = np.random.RandomState(1)
    b, h, kvh, d, p, pps = 4, 4, 2, 16, 4, 5
    t = mask.shape[0]
    lengths = [0, 4, 7, 13]
    cache, k_pages, v_pages, table = _contiguous_and_paged(
        rng, batch=b, kv_heads=kvh, head_dim=d, page_size=p, pages_per_seq=pps, lengths=lengths
    )
    q = jnp.asarray(rng.randn(b, t, h, d), jnp.float32)
    k_new = jnp.asarray(rng.randn(b, t, kvh, d), jnp.float32)
    v_new = jnp.asarray(rng.randn(b, t, kvh, d), jnp.float32)
    new_mask = jnp.broadcast_to(jnp.asarray(mask), (b, t, t))

    want, cache = jax.jit(lambda c, *a: c.attend(0, *a))(cache, q, k_new, v_new, new_mask)

    @jax.jit
    def paged_attend(k_pages, v_pages):
        k_pages, v_pages = write_block(k_pages, v_pages, table, cache.lengths, k_new, v_new)
        out = paged_attention_reference(q, k_pages, v_pages, table, cache.lengths, new_mask)
        return out, gather_pages(k_pages, table)

    got, k_dense = paged_attend(k_pages, v_pages)

    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    for row, n in enumerate(lengths):
        np.testing.assert_array_equal(
            np.asarray(k_dense[row, : n + t]), np.asarray(cache.k[0, row, : n + t])
        )
