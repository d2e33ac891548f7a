"""The paged KV cache behaves exactly like the contiguous one, and its allocator never shares a page."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tltjax.kernels.paged import gather_pages
from tltjax.models import CausalLM, ContiguousKVCache, ModelConfig, forward
from tltjax.rollout.paged_cache import SCRATCH_PAGE, PageAllocator, PagedKVCache

CFG = ModelConfig(
    model_type="qwen2", vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True,
)
PAGE = 4
# One set of shapes for the model tests, so the jitted programs compile once and are shared.
BATCH, PROMPT_T, NUM_PAGES, PPS, FULL_T = 3, 9, 24, 5, 20


@pytest.fixture(scope="module")
def model():
    return CausalLM(CFG, rngs=nnx.Rngs(0))


def _padded(seqs, width):
    """Right-padded [B, width] int32 ids (padding is 0; causal models never look right)."""
    out = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return jnp.asarray(out)


def _full_logits(model, seqs):
    """Plain (cache-free) forward logits of each sequence, as a right-padded [B, FULL_T, vocab] array."""
    return np.asarray(forward(model, _padded(seqs, FULL_T)).logits)


def _assert_disjoint(alloc, rows):
    pages = [p for r in rows for p in alloc.pages(r)]
    assert len(pages) == len(set(pages)), f"a page is shared: {pages}"
    assert SCRATCH_PAGE not in pages


def _grow(alloc, cache, rows, tokens):
    """Host step between device chunks: rows get pages for ``tokens[i]`` tokens; the cache gets the new table."""
    for r, n in zip(rows, tokens):
        assert alloc.ensure(r, int(n))
    return cache.with_table(alloc.table(rows, cache.pages_per_seq))


def test_paged_decode_equals_contiguous_and_full_forward(model):
    """Ragged prefill (advance=lens) then token-by-token decode through a PagedKVCache whose pages are
    shuffled and grown on the host each step gives the ContiguousKVCache's logits and the full forward's
    (1e-5), and the pages hold the same committed keys as the contiguous cache."""
    rng = np.random.RandomState(0)
    lens, steps = [5, 9, 2], 7  # capacity PPS * PAGE = 20 >= the 9-token prefill block and 9 + 7 tokens
    prompts = [rng.randint(0, CFG.vocab_size, n) for n in lens]
    gen = rng.randint(0, CFG.vocab_size, (3, steps))
    rows = ["r0", "r1", "r2"]
    alloc = PageAllocator(num_pages=NUM_PAGES, page_size=PAGE, seed=0)
    paged = _grow(alloc, PagedKVCache.init(CFG, BATCH, NUM_PAGES, PAGE, PPS), rows, lens)
    contig = ContiguousKVCache.init(CFG, BATCH, PPS * PAGE)
    adv = jnp.asarray(lens, jnp.int32)
    out_p = forward(model, _padded(prompts, PROMPT_T), cache=paged, advance=adv)
    out_c = forward(model, _padded(prompts, PROMPT_T), cache=contig, advance=adv)
    last = np.array(lens) - 1
    got_p, got_c = [np.asarray(out_p.logits)[np.arange(3), last]], [np.asarray(out_c.logits)[np.arange(3), last]]
    paged, contig = out_p.cache, out_c.cache
    for k in range(steps):
        paged = _grow(alloc, paged, rows, np.array(lens) + k + 1)
        out_p = forward(model, jnp.asarray(gen[:, k : k + 1]), cache=paged)
        out_c = forward(model, jnp.asarray(gen[:, k : k + 1]), cache=contig)
        paged, contig = out_p.cache, out_c.cache
        got_p.append(np.asarray(out_p.logits[:, 0]))
        got_c.append(np.asarray(out_c.logits[:, 0]))
    got_p, got_c = np.stack(got_p, 1), np.stack(got_c, 1)  # [B, steps + 1, V]
    full = _full_logits(model, [np.concatenate([p, g]) for p, g in zip(prompts, gen)])
    want = np.stack([full[b, lens[b] - 1 : lens[b] + steps] for b in range(3)])
    np.testing.assert_allclose(got_p, got_c, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_p, want, atol=1e-5, rtol=0)
    assert paged.lengths.tolist() == [n + steps for n in lens]
    _assert_disjoint(alloc, rows)
    assert [len(alloc.pages(r)) for r in rows] == [-(-(n + steps) // PAGE) for n in lens]
    for layer in range(CFG.num_hidden_layers):
        k_dense = np.asarray(gather_pages(paged.k_pages[layer], paged.page_table))
        for b, n in enumerate(paged.lengths.tolist()):
            np.testing.assert_allclose(k_dense[b, :n], np.asarray(contig.k[layer, b, :n]), atol=1e-6, rtol=0)


def test_tree_extend_and_keep_equals_forward_of_accepted_path(model):
    """A draft tree written with advance=0, then `keep` of each row's accepted path (entries moving across a
    page boundary), then one more decode token equals the plain forward of prefix + path + token: the tree
    nodes on the path and the next token all get the full-forward logits (1e-5)."""
    rng = np.random.RandomState(1)
    lens = [6, 3, 9]
    prompts = [rng.randint(0, CFG.vocab_size, n) for n in lens]
    # Tree [a, b, c, d]: b and c are children of a (siblings that must not see each other), d a child of c.
    tree_tok = rng.randint(0, CFG.vocab_size, (BATCH, 4))
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
    mask = jnp.broadcast_to(jnp.asarray(tree), (BATCH, 4, 4))
    depth = np.array([0, 1, 1, 2])
    # Row 0 (6 committed) accepts a, c, d: c moves from position 8 (page 2) to 7 (page 1), d from 9 to 8.
    # Row 1 (3 committed) accepts a, c: c moves from position 5 to 4; its third index is ignored.
    # Row 2 (9 committed) accepts a, b: both stay where they are.
    idx, count = np.array([[0, 2, 3], [0, 2, 1], [0, 1, 0]]), np.array([3, 2, 2])
    nxt = rng.randint(0, CFG.vocab_size, (BATCH, 1))
    rows = [0, 1, 2]
    alloc = PageAllocator(num_pages=NUM_PAGES, page_size=PAGE, seed=1)
    cache = _grow(alloc, PagedKVCache.init(CFG, BATCH, NUM_PAGES, PAGE, PPS), rows, lens)
    cache = forward(model, _padded(prompts, PROMPT_T), cache=cache, advance=jnp.asarray(lens)).cache

    cache = _grow(alloc, cache, rows, np.array(lens) + 4)
    positions = jnp.asarray(np.array(lens)[:, None] + depth[None, :], jnp.int32)
    tree = forward(model, jnp.asarray(tree_tok), positions=positions, mask=mask, cache=cache, advance=0)
    assert tree.cache.lengths.tolist() == lens
    kept = tree.cache.keep(jnp.asarray(idx), jnp.asarray(count))
    assert kept.lengths.tolist() == [9, 5, 11]
    kept = _grow(alloc, kept, rows, [10, 6, 12])
    out = forward(model, jnp.asarray(nxt), cache=kept)

    paths = [tree_tok[b, idx[b, : count[b]]] for b in rows]
    full = _full_logits(model, [np.concatenate([prompts[b], paths[b], nxt[b]]) for b in rows])
    for b in rows:
        n, c = lens[b], count[b]
        np.testing.assert_allclose(
            np.asarray(tree.logits[b, idx[b, :c]]), full[b, n : n + c], atol=1e-5, rtol=0
        )
        np.testing.assert_allclose(np.asarray(out.logits[b, 0]), full[b, n + c], atol=1e-5, rtol=0)
    _assert_disjoint(alloc, rows)


def test_select_rows_compaction_keeps_decoding_exact(model):
    """Dropping a finished row and re-ordering the rest with `select_rows` (a smaller batch over the same pages,
    the finished row's pages freed) continues decoding with exactly the logits of the uncompacted cache."""
    rng = np.random.RandomState(2)
    lens, steps = [4, 7, 5], 3
    prompts = [rng.randint(0, CFG.vocab_size, n) for n in lens]
    gen = rng.randint(0, CFG.vocab_size, (3, 1 + steps))
    rows = ["a", "b", "c"]
    alloc = PageAllocator(num_pages=NUM_PAGES, page_size=PAGE, seed=2)
    cache = _grow(alloc, PagedKVCache.init(CFG, BATCH, NUM_PAGES, PAGE, PPS), rows, lens)
    cache = forward(model, _padded(prompts, PROMPT_T), cache=cache, advance=jnp.asarray(lens)).cache
    cache = _grow(alloc, cache, rows, np.array(lens) + 1)
    cache = forward(model, jnp.asarray(gen[:, :1]), cache=cache).cache  # all rows decode one token

    ref, want = cache, []
    for k in range(1, 1 + steps):  # uncompacted: "b" keeps decoding (its tokens are simply ignored)
        ref = _grow(alloc, ref, rows, np.array(lens) + k + 1)
        out = forward(model, jnp.asarray(gen[:, k : k + 1]), cache=ref)
        ref = out.cache
        want.append(np.asarray(out.logits[:, 0]))
    want = np.stack(want, 1)

    alloc.free("b")  # "b" finished: its pages go back; "c" and "a" move into a bucket of 2
    live, keep_rows = ["c", "a"], [2, 0]
    small = cache.select_rows(keep_rows)
    assert small.k_pages is cache.k_pages and small.v_pages is cache.v_pages  # pages stay put
    assert small.lengths.tolist() == [lens[2] + 1, lens[0] + 1]
    np.testing.assert_array_equal(np.asarray(small.page_table), np.asarray(cache.page_table)[keep_rows])
    got = []
    for k in range(1, 1 + steps):
        small = _grow(alloc, small, live, np.array(lens)[keep_rows] + k + 1)
        out = forward(model, jnp.asarray(gen[keep_rows, k : k + 1]), cache=small)
        small = out.cache
        got.append(np.asarray(out.logits[:, 0]))
    np.testing.assert_allclose(np.stack(got, 1), want[keep_rows], atol=1e-5, rtol=0)
    _assert_disjoint(alloc, live)

    padded = cache.select_rows([0, -1])  # a bucket padded with an empty row
    assert padded.lengths.tolist() == [lens[0] + 1, 0]
    assert np.asarray(padded.page_table)[1].tolist() == [SCRATCH_PAGE] * PPS


def test_allocator_exhaustion_free_and_no_sharing():
    """Pages go to one row at a time; a request the free list cannot meet returns False and allocates nothing;
    freed pages come back and are handed out again; tables pad with the reserved scratch page."""
    alloc = PageAllocator(num_pages=9, page_size=4)
    assert alloc.num_free == 8  # page SCRATCH_PAGE is reserved
    assert alloc.ensure("a", 10) and len(alloc.pages("a")) == 3
    assert alloc.ensure("b", 16) and len(alloc.pages("b")) == 4
    assert not alloc.ensure("c", 5) and "c" not in alloc and alloc.num_free == 1
    assert not alloc.ensure("b", 24) and len(alloc.pages("b")) == 4 and alloc.num_free == 1
    assert alloc.ensure("a", 12) and alloc.num_free == 1  # 3 pages already hold 12 tokens
    assert alloc.ensure("a", 13) and alloc.num_free == 0
    _assert_disjoint(alloc, ["a", "b"])
    b_pages = set(alloc.pages("b"))
    assert alloc.free("b") == 4 and alloc.num_free == 4 and "b" not in alloc
    assert alloc.ensure("c", 16) and set(alloc.pages("c")) == b_pages
    table = alloc.table(["a", None, "c"], 5)
    assert table.dtype == np.int32 and table.shape == (3, 5)
    assert table[0].tolist() == list(alloc.pages("a")) + [SCRATCH_PAGE]
    assert table[1].tolist() == [SCRATCH_PAGE] * 5
    assert table[2, :4].tolist() == list(alloc.pages("c"))

    # Random ensure/free traffic: pages are never shared and none is lost.
    rng = np.random.RandomState(0)
    alloc = PageAllocator(num_pages=33, page_size=8, seed=3)
    for _ in range(300):
        row = int(rng.randint(6))
        if row in alloc and rng.rand() < 0.3:
            alloc.free(row)
        else:
            before = alloc.num_free
            held = len(alloc.pages(row)) if row in alloc else 0
            ok = alloc.ensure(row, int(rng.randint(0, 80)))
            if not ok:
                assert alloc.num_free == before and (len(alloc.pages(row)) if row in alloc else 0) == held
        rows = [r for r in range(6) if r in alloc]
        _assert_disjoint(alloc, rows)
        assert alloc.num_free + sum(len(alloc.pages(r)) for r in rows) == 32


def test_allocator_and_cache_reject_bad_arguments():
    """Bad sizes, unknown rows and too-short tables are errors that name the value."""
    for bad in (0, 6, 3.0):
        with pytest.raises(ValueError, match="page_size"):
            PageAllocator(8, bad)
        with pytest.raises(ValueError, match="page_size"):
            PagedKVCache.init(CFG, 1, 8, bad, 2)
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(1, 4)
    alloc = PageAllocator(8, 4)
    with pytest.raises(ValueError, match="tokens_needed=-1"):
        alloc.ensure("a", -1)
    for call in (lambda: alloc.free("ghost"), lambda: alloc.pages("ghost"), lambda: alloc.table(["ghost"], 2)):
        with pytest.raises(KeyError, match="ghost"):
            call()
    assert alloc.ensure("a", 9)
    with pytest.raises(ValueError, match="holds 3 pages.*2 per row"):
        alloc.table(["a"], 2)
    cache = PagedKVCache.init(CFG, 2, 8, 4, 3)
    with pytest.raises(ValueError, match=r"\(1, 3\).*\(2, 3\)"):
        cache.with_table(alloc.table(["a"], 3))


def test_from_budget_arithmetic():
    """from_budget holds floor(budget / page bytes) pages, where a page is k+v over all layers and kv heads,
    and a cache of that many pages takes exactly that many bytes."""
    per_page = 2 * CFG.num_hidden_layers * CFG.num_key_value_heads * 4 * CFG.head_dim * 4  # f32
    assert PageAllocator.page_bytes(CFG, 4) == per_page == 1024
    alloc = PageAllocator.from_budget(10 * per_page + per_page - 1, CFG, 4)
    assert alloc.num_pages == 10 and alloc.num_free == 9 and alloc.page_size == 4
    assert PageAllocator.from_budget(10 * per_page, CFG, 4, dtype=jnp.bfloat16).num_pages == 20
    assert PageAllocator.from_budget(10 * per_page, CFG, 16).num_pages == 2
    cache = PagedKVCache.init(CFG, 1, alloc.num_pages, 4, 2)
    assert cache.k_pages.nbytes + cache.v_pages.nbytes == alloc.num_pages * per_page
    with pytest.raises(ValueError, match="holds 1 pages"):
        PageAllocator.from_budget(per_page, CFG, 4)


@pytest.mark.cpu_only
def test_pallas_decode_kernel_drops_in():
    """With impl="pallas_interpret" the decode steps run the Pallas decode kernel (interpret mode) behind the
    same cache interface and give the full-forward logits (1e-5). head_dim 16: the kernels' smallest tile."""
    cfg = CFG.replace(head_dim=16)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.RandomState(3)
    lens, steps, pps = [5, 3], 3, 3
    prompts = [rng.randint(0, cfg.vocab_size, n) for n in lens]
    gen = rng.randint(0, cfg.vocab_size, (2, steps))
    rows = [0, 1]
    alloc = PageAllocator(num_pages=8, page_size=PAGE, seed=4)
    cache = _grow(alloc, PagedKVCache.init(cfg, 2, alloc.num_pages, PAGE, pps), rows, lens)
    cache = forward(model, _padded(prompts, 5), cache=cache, advance=jnp.asarray(lens)).cache  # reference prefill
    cache = cache.replace(impl="pallas_interpret")
    got = []
    for k in range(steps):
        cache = _grow(alloc, cache, rows, np.array(lens) + k + 1)
        out = forward(model, jnp.asarray(gen[:, k : k + 1]), cache=cache)
        cache = out.cache
        got.append(np.asarray(out.logits[:, 0]))
    full = _full_logits(model, [np.concatenate([p, g]) for p, g in zip(prompts, gen)])
    want = np.stack([full[b, lens[b] : lens[b] + steps] for b in rows])
    np.testing.assert_allclose(np.stack(got, 1), want, atol=1e-5, rtol=0)
