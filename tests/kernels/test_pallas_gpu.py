"""Pallas paged-attention kernels against the XLA reference, and the dispatch point.

On a GPU the kernels are compiled through Triton; elsewhere they run in interpret mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tltjax.kernels as kernels
from tltjax.kernels import pallas_gpu
from tltjax.kernels.paged import paged_attention_reference
from tests.kernels.test_paged import random_paged, tree_mask

_reference = jax.jit(paged_attention_reference)
INTERPRET = jax.default_backend() != "gpu"  # compiled kernels on a GPU, interpret mode elsewhere


@pytest.mark.parametrize(
    "group,page_size,head_dim,pages_per_seq,lengths,num_splits,dtype",
    [
        (1, 4, 16, 4, [0, 1, 8, 13], None, jnp.float32),  # empty row, one token, a length on a page boundary
        (4, 4, 32, 12, [5, 12, 48, 1], 3, jnp.float32),  # three key splits, a full page table
        (2, 8, 32, 3, [1, 16, 23, 0], None, jnp.bfloat16),
    ],
)
def test_decode_kernel_equals_reference(group, page_size, head_dim, pages_per_seq, lengths, num_splits, dtype):
    """paged_decode_attention == the reference with the token as a 1-block (keys 0..len-1 visible) over
    shuffled pages, ragged lengths and GQA; a length-0 row returns zeros. f32 to 1e-5, bf16 to bf16 rounding."""
    rng = np.random.RandomState(2)
    b, kvh = 4, 2
    k_pages, v_pages, table = random_paged(
        rng, batch=b, kv_heads=kvh, head_dim=head_dim, page_size=page_size, pages_per_seq=pages_per_seq, dtype=dtype
    )
    q = jnp.asarray(rng.randn(b, kvh * group, head_dim), dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    got = pallas_gpu.paged_decode_attention(
        q, k_pages, v_pages, table, lengths, scale=0.3, interpret=INTERPRET, block_keys=16, num_splits=num_splits
    )
    up = lambda x: x.astype(jnp.float32)  # noqa: E731 - the reference in f32 on the same (rounded) inputs
    decode_mask = jnp.ones((b, 1, 1), bool)
    want = _reference(up(q)[:, None], up(k_pages), up(v_pages), table, lengths - 1, decode_mask, scale=0.3)
    atol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(up(got)), np.asarray(want[:, 0]), atol=atol, rtol=0)
    np.testing.assert_array_equal(np.asarray(up(got))[np.asarray(lengths) == 0], 0.0)


def _random_trees(rng, batch, t):
    """A different random draft tree per row (each node's parent is an earlier node)."""
    return np.stack([tree_mask([-1] + [rng.randint(i) for i in range(1, t)]) for _ in range(batch)])


@pytest.mark.parametrize(
    "group,page_size,head_dim,pages_per_seq,lengths,mask,block_rows,num_splits",
    [
        (1, 4, 16, 5, [0, 1, 8, 13], np.tril(np.ones((4, 4), bool)), 64, None),  # a chain: plain causal
        (2, 8, 32, 4, [1, 16, 9, 0], tree_mask([-1, 0, 0, 1, 1, 2, 2]), 64, None),  # a full binary tree
        (4, 4, 16, 9, [0, 4, 21, 30], "random", 16, 2),  # per-row trees, 2 query-row tiles, 2 key splits
    ],
)
def test_tree_kernel_equals_reference(group, page_size, head_dim, pages_per_seq, lengths, mask, block_rows, num_splits):
    """tree_verify_attention == the reference: committed keys all visible, the tree block (already in the pages)
    per the tree mask, over shuffled pages, ragged lengths (0, 1, page boundaries) and GQA; to 1e-5 in f32."""
    rng = np.random.RandomState(3)
    b, kvh = 4, 2
    k_pages, v_pages, table = random_paged(
        rng, batch=b, kv_heads=kvh, head_dim=head_dim, page_size=page_size, pages_per_seq=pages_per_seq
    )
    t = 6 if isinstance(mask, str) else mask.shape[0]
    new_mask = jnp.asarray(_random_trees(rng, b, t) if isinstance(mask, str) else np.broadcast_to(mask, (b, t, t)))
    q = jnp.asarray(rng.randn(b, t, kvh * group, head_dim), jnp.float32)
    lengths = jnp.asarray(lengths, jnp.int32)
    got = pallas_gpu.tree_verify_attention(
        q, k_pages, v_pages, table, lengths, new_mask,
        interpret=INTERPRET, block_keys=16, block_rows=block_rows, num_splits=num_splits,
    )
    want = _reference(q, k_pages, v_pages, table, lengths, new_mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_kernels_reject_layouts_triton_cannot_tile():
    """A page size that is not a power of two is refused with a message naming it."""
    rng = np.random.RandomState(4)
    k_pages, v_pages, table = random_paged(rng, batch=1, kv_heads=1, head_dim=16, page_size=6, pages_per_seq=2)
    with pytest.raises(ValueError, match="page_size=6"):
        pallas_gpu.paged_decode_attention(
            jnp.zeros((1, 1, 16)), k_pages, v_pages, table, jnp.array([3], jnp.int32), interpret=INTERPRET
        )


def _spy(monkeypatch, target, name, calls):
    original = target[name] if isinstance(target, dict) else getattr(target, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    if isinstance(target, dict):
        monkeypatch.setitem(target, name, spy)
    else:
        monkeypatch.setattr(target, name, spy)


@pytest.mark.parametrize(
    "backend,head_dim,page_size,expect",
    [
        ("gpu", 128, 16, "pallas"),
        ("gpu", 8, 16, "reference"),  # too narrow for a Triton tile
        ("gpu", 96, 16, "reference"),  # not a power of two
        ("gpu", 64, 12, "reference"),
        ("cpu", 128, 16, "reference"),
        ("tpu", 128, 16, "reference"),
    ],
)
def test_dispatch_auto_picks_by_backend_and_layout(monkeypatch, backend, head_dim, page_size, expect):
    """impl="auto" runs the Pallas kernels on GPU when they can tile the layout, and the XLA reference on every
    other backend and for layouts Triton cannot tile, for the whole pool (``layer``) as for one layer's pages."""
    for layer, pool in ((None, (2, 8, page_size, head_dim)), (1, (3, 2, 8, page_size, head_dim))):
        calls = []
        for name in kernels.PAGED_IMPLS:
            monkeypatch.setitem(kernels.PAGED_IMPLS, name, lambda *a, _n=name, **k: calls.append(_n))
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        q = jax.ShapeDtypeStruct((2, 1, 4, head_dim), jnp.float32)
        pages = jax.ShapeDtypeStruct(pool, jnp.float32)
        kernels.paged_attention(q, pages, pages, None, None, None, layer=layer)
        assert calls == [expect]


def test_dispatch_rejects_unknown_impl():
    """An unknown impl is an error that lists the valid names."""
    with pytest.raises(ValueError, match="'triton'.*pallas_interpret"):
        kernels.paged_attention(None, None, None, None, None, None, impl="triton")


@pytest.mark.cpu_only
def test_dispatch_interpret_routes_to_kernels(monkeypatch):
    """impl="pallas_interpret" runs the decode kernel for one new token, exact whatever its 1x1 mask (here True
    for some rows, False for others), and hands a block of several tokens to the tree kernel."""
    rng = np.random.RandomState(5)
    b, kvh, d = 3, 1, 16
    k_pages, v_pages, table = random_paged(rng, batch=b, kv_heads=kvh, head_dim=d, page_size=4, pages_per_seq=3)
    lengths = jnp.array([0, 5, 8], jnp.int32)
    dispatch = jax.jit(kernels.paged_attention, static_argnames=("impl",))
    calls = []
    _spy(monkeypatch, pallas_gpu, "paged_decode_attention", calls)
    q = jnp.asarray(rng.randn(b, 1, 2 * kvh, d), jnp.float32)
    new_mask = jnp.array([True, False, True])[:, None, None]
    args = (q, k_pages, v_pages, table, lengths, new_mask)
    got = dispatch(*args, impl="pallas_interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(dispatch(*args, impl="reference")), atol=1e-5, rtol=0)
    # The tree kernel's exactness is test_tree_kernel_equals_reference's; here only the routing.
    monkeypatch.setattr(pallas_gpu, "tree_verify_attention", lambda q, *a, **k: calls.append("tree") or q)
    q = jnp.zeros((b, 3, 2 * kvh, d))
    kernels.paged_attention(q, k_pages, v_pages, table, lengths, jnp.ones((b, 3, 3), bool), impl="pallas_interpret")
    assert calls == ["paged_decode_attention", "tree"]

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_to_triton_without_a_gpu(dtype):
    """Both kernels pass Pallas's Triton lowering (to Triton IR) at a Qwen2.5-7B-like shape: GQA 7, head_dim 128,
    16-token pages, a 32K-token page table, 48 tree tokens. Compiling that IR to PTX needs a GPU and is not checked."""
    from jax import export

    b, h, kvh, d, page, pps, t = 2, 28, 4, 128, 16, 2048, 48
    spec = jax.ShapeDtypeStruct
    pages = spec((kvh, b * pps, page, d), dtype)
    table, lengths = spec((b, pps), jnp.int32), spec((b,), jnp.int32)
    allow_triton = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

    def lower(f, *args):
        return export.export(jax.jit(f), platforms=["cuda"], disabled_checks=allow_triton)(*args)

    decode = lower(pallas_gpu.paged_decode_attention, spec((b, h, d), dtype), pages, pages, table, lengths)
    tree = lower(
        pallas_gpu.tree_verify_attention, spec((b, t, h, d), dtype), pages, pages, table, lengths, spec((b, t, t), bool)
    )
    for exported, name in ((decode, "paged_decode_attention"), (tree, "tree_verify_attention")):
        text = exported.mlir_module()
        assert "__gpu$xla.gpu.triton" in text and f'name = "{name}"' in text
