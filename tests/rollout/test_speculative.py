"""Losslessness of tree acceptance, proven by exact enumeration and by statistical tests.

The target is a bigram model over a small vocabulary (the distribution of the
next token depends on the current one), so the target's logits at every tree
node are known in closed form and the exact joint distribution of any number
of generated tokens can be enumerated.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from tltjax.rollout.sampling import SamplingParams, processed_logprobs
from tltjax.rollout.speculative import accept, node_depths, tree_mask

V = 4
ROOT = 2
BIGRAM = np.random.RandomState(0).randn(V, V).astype(np.float32) * 1.5
# root -> {0, 1}; 0 -> {3}; 1 -> {2}; 3 -> {1}: siblings distinct, depth 3
TREE = (np.array([0, 1, 3, 2, 1]), np.array([-1, -1, 0, 1, 2]))
CHAIN = (np.array([3, 1, 0]), np.array([-1, 0, 1]))
PARAMS = [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.0, top_p=0.8), SamplingParams(0.0)]


def _probs(params):
    """The processed target distribution per previous token, renormalised in float64."""
    p = np.exp(np.asarray(processed_logprobs(jnp.asarray(BIGRAM), params), np.float64))
    return p / p.sum(-1, keepdims=True)


def _target_joint(params, length):
    """Exact P(x_1..x_length) of plain target sampling from ROOT."""
    p = _probs(params)
    out = {}
    for seq in itertools.product(range(V), repeat=length):
        prob, prev = 1.0, ROOT
        for x in seq:
            prob *= p[prev, x]
            prev = x
        out[seq] = prob
    return out


def _exact_emitted_joint(tree, params, length):
    """Exact distribution of the first ``length`` tokens when acceptance emits a prefix and plain
    target sampling continues it, by enumerating every combination of the per-node samples."""
    tokens, parents = tree
    p = _probs(params)
    ctx = np.concatenate([[ROOT], tokens])
    n1 = len(ctx)
    out = dict.fromkeys(itertools.product(range(V), repeat=length), 0.0)
    for samples in itertools.product(range(V), repeat=n1):
        w = np.prod([p[ctx[u], samples[u]] for u in range(n1)])
        if w == 0:
            continue
        # the walk, written independently of the implementation
        emitted, u = [], 0
        while True:
            kids = [i + 1 for i in range(len(tokens)) if parents[i] + 1 == u and tokens[i] == samples[u]]
            if not kids:
                emitted.append(samples[u])
                break
            u = kids[0]
            emitted.append(ctx[u])
        seq = emitted[:length]
        for cont in itertools.product(range(V), repeat=length - len(seq)):
            full = tuple(seq + list(cont))
            prob, prev = w, seq[-1]
            for x in cont:
                prob *= p[prev, x]
                prev = x
            out[full] += prob
    return out


def _run(tree, params, n, seed=0, biased=False):
    tokens, parents = tree
    ctx = np.concatenate([[ROOT], tokens])
    logp = processed_logprobs(jnp.asarray(BIGRAM[ctx]), params)  # the same for every row
    logp = jnp.broadcast_to(logp, (n, len(ctx), V))
    f = jax.jit(lambda k: accept(k, logp, jnp.broadcast_to(jnp.asarray(tokens), (n, len(tokens))),
                                 jnp.broadcast_to(jnp.asarray(parents), (n, len(tokens)))))
    a = f(jax.random.key(seed))
    toks, cnt = np.asarray(a.tokens), np.asarray(a.count)
    if biased:  # a broken acceptor: the first drafted child is always taken at the root
        toks = toks.copy()
        toks[:, 0] = np.where(np.random.RandomState(seed).rand(n) < 0.3, tokens[0], toks[:, 0])
    return toks, cnt, np.asarray(a.logprobs), np.asarray(a.path)


def test_tree_mask_and_depths():
    """Each tree position attends to exactly itself and its ancestors; depths count edges from the root."""
    m = np.asarray(tree_mask(jnp.asarray(TREE[1][None])))[0]
    expected = np.zeros((6, 6), bool)
    anc = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 1, 3, 5]}
    for i, js in anc.items():
        expected[i, js] = True
    np.testing.assert_array_equal(m, expected)
    assert np.asarray(node_depths(jnp.asarray(TREE[1][None])))[0].tolist() == [1, 1, 2, 2, 3]


@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("tree", [TREE, CHAIN], ids=["tree", "chain"])
def test_exact_enumeration_equals_target_joint(tree, params):
    """Summed over every possible set of node samples, the joint law of the first 4 tokens equals the target's."""
    want = _target_joint(params, 4)
    got = _exact_emitted_joint(tree, params, 4)
    for k in want:
        assert abs(got[k] - want[k]) < 1e-12, (k, got[k], want[k])


@pytest.mark.parametrize("params", PARAMS[:3], ids=str)
@pytest.mark.parametrize("tree", [TREE, CHAIN], ids=["tree", "chain"])
def test_sampled_prefix_matches_target_g_test(tree, params):
    """200k jitted acceptances: the first emitted token, and the first two when two are emitted,
    follow the target's (conditional) law by a G-test at p > 1e-3."""
    n = 200_000
    toks, cnt, _, _ = _run(tree, params, n)
    p = _probs(params)
    counts = np.bincount(toks[:, 0], minlength=V)
    _assert_fits(counts, p[ROOT])
    for a in range(V):  # the second token, conditioned on the first, is a draw from p[a]
        sel = (cnt >= 2) & (toks[:, 0] == a)
        if sel.sum() > 2000:
            _assert_fits(np.bincount(toks[sel, 1], minlength=V), p[a])


def _assert_fits(counts, probs, alpha=1e-3):
    support = probs > 0
    assert counts[~support].sum() == 0
    exp = probs[support] * counts.sum()
    g, pval = stats.power_divergence(counts[support], exp, lambda_="log-likelihood")
    assert pval > alpha, (counts, exp, pval)


def test_g_test_rejects_a_biased_acceptor():
    """The same G-test flags an acceptor that over-accepts the first drafted child: the test can fail."""
    toks, _, _, _ = _run(TREE, SamplingParams(1.0), 200_000, biased=True)
    with pytest.raises(AssertionError):
        _assert_fits(np.bincount(toks[:, 0], minlength=V), _probs(SamplingParams(1.0))[ROOT])


def test_logprobs_and_path_are_consistent():
    """Reported log-probs are the processed target log-probs of each emitted token at its parent,
    and the path lists accepted node indices whose tokens are the emitted prefix."""
    params = SamplingParams(0.7, top_p=0.9)
    toks, cnt, lps, path = _run(TREE, params, 2000, seed=3)
    logp = np.log(_probs(params))
    tokens, _ = TREE
    for r in range(2000):
        c = cnt[r]
        assert [tokens[i] for i in path[r, : c - 1]] == toks[r, : c - 1].tolist()
        prev = ROOT
        for j in range(c):
            np.testing.assert_allclose(lps[r, j], logp[prev, toks[r, j]], atol=1e-5)
            prev = toks[r, j]


def test_greedy_accepts_exactly_the_argmax_chain():
    """Greedy: the emitted tokens are the target's argmax chain as far as the draft matches it, plus one."""
    toks, cnt, _, _ = _run(TREE, SamplingParams(0.0), 1)
    chain, prev = [], ROOT
    for _ in range(cnt[0]):
        prev = int(np.argmax(BIGRAM[prev]))
        chain.append(prev)
    assert toks[0, : cnt[0]].tolist() == chain


# ----------------------------------------------------------------------------- drafting helpers
from tltjax.rollout.speculative import Strategy, ngram_draft, select_tree  # noqa: E402


def test_select_tree_keeps_the_best_nodes_that_form_a_tree():
    """Top-`num` by score, closed under parents, compacted with parents re-indexed and first."""
    # candidates: 0,1 at depth 1; 2 (child of 0), 3 (child of 1), 4 (child of 2)
    tokens = jnp.array([[10, 11, 12, 13, 14]])
    parents = jnp.array([[-1, -1, 0, 1, 2]])
    scores = jnp.array([[-0.1, -2.0, -0.5, -2.5, -0.9]])
    tree = select_tree(tokens, parents, scores, 3)
    assert tree.tokens.tolist() == [[10, 12, 14]]
    assert tree.parents.tolist() == [[-1, 0, 1]]
    # a child whose parent is not selected is dropped (scores that break monotonicity), leaving padding
    tree = select_tree(tokens, parents, jnp.array([[-3.0, -0.1, -0.2, -5.0, -0.3]]), 3)
    assert tree.tokens.tolist()[0][:1] == [11] and tree.parents.tolist() == [[-1, -2, -2]]


def test_ngram_draft_proposes_what_followed_the_latest_match():
    s = Strategy("ngram", depth=3)
    hist = jnp.array([[5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 0, 0]])  # context ends "... 5 6"
    sib = jnp.zeros((1, 1, 14), jnp.int32)
    tree = ngram_draft(hist, jnp.array([12]), sib, jnp.array([[0]]), s)
    # "5 6" last occurred at positions 5-6 (before the query at 10-11), followed by 7 1 2
    assert tree.tokens.tolist() == [[7, 1, 2]] and tree.parents.tolist() == [[-1, 0, 1]]


def test_ngram_draft_reads_siblings_and_handles_no_match():
    s = Strategy("ngram", depth=3, ngram_max=2)
    hist = jnp.array([[1, 2, 3, 0, 0, 0]])
    sib = jnp.array([[[9, 2, 3, 4, 0, 0]]])  # sibling continues "2 3" with "4", then ends
    tree = ngram_draft(hist, jnp.array([3]), sib, jnp.array([[4]]), s)
    assert tree.tokens.tolist()[0][0] == 4 and tree.parents.tolist() == [[-1, -2, -2]]
    tree = ngram_draft(jnp.array([[1, 2, 3, 0, 0, 0]]), jnp.array([3]), sib * 0 + 7, jnp.array([[4]]), s)
    assert tree.parents.tolist() == [[-2, -2, -2]]


def test_strategy_parse_and_validation():
    assert Strategy.parse("eagle:depth=4,top_k=2,num_verify=6") == Strategy("eagle", 4, 2, 6)
    assert Strategy("eagle", 4, 2, 6).num_nodes == 6 and Strategy("eagle", 4, 2).num_nodes == 8
    assert Strategy("eagle", 4, 1).max_emitted == 5
    with pytest.raises(ValueError, match="num_verify"):
        Strategy("eagle", 2, 2, 9)
    with pytest.raises(ValueError, match="chain"):
        Strategy("ngram", 3, 2)
