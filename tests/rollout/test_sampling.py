"""`tltjax.rollout.sampling`: the processed distribution against a numpy reference, and draws from it."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from tltjax.rollout.sampling import SamplingParams, processed_logprobs, sample

V = 11
TEMPERATURES = (0.5, 1.0, 2.0)
TOP_KS = (0, 1, 3, V)
TOP_PS = (1.0, 0.9, 0.5, 1e-6)


def reference_logprobs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The sampling distribution by its definition, row by row in float64.

    Greedy: one-hot on the first argmax. Otherwise temperature, then top-k (every
    token tied with the k-th largest stays), then top-p over groups of equal
    logits, most probable first: a group is kept while the mass of the groups
    before it is below ``top_p``.
    """
    out = np.full(logits.shape, -np.inf)
    for idx in np.ndindex(logits.shape[:-1]):
        x = logits[idx].astype(np.float64)
        row = out[idx]
        if temperature == 0:
            row[np.argmax(x)] = 0.0
            continue
        x = x / temperature
        keep = np.ones(x.shape, bool)
        if 0 < top_k < x.size:
            keep &= x >= np.sort(x)[::-1][top_k - 1]
        if top_p < 1:
            p = np.where(keep, np.exp(x - x.max()), 0.0)
            p /= p.sum()
            kept, mass_before = np.zeros(x.shape, bool), 0.0
            for value in np.unique(x[keep])[::-1]:
                if mass_before >= top_p:
                    break
                group = keep & (x == value)
                kept |= group
                mass_before += p[group].sum()
            keep = kept
        z = x[keep]
        row[keep] = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    return out


@pytest.fixture(scope="module")
def logits():
    """48 rows over 11 tokens: 32 Gaussian rows at several scales, 16 rows of integers in {0, 1, 2} (many ties)."""
    rng = np.random.RandomState(0)
    gauss = rng.normal(size=(32, V)) * rng.uniform(0.3, 4.0, size=(32, 1))
    ties = rng.randint(0, 3, size=(16, V))
    return np.concatenate([gauss, ties]).astype(np.float32)


ALL_PARAMS = [
    SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in itertools.product((0.0, *TEMPERATURES), TOP_KS, TOP_PS)
]


def _id(params: SamplingParams) -> str:
    return f"t{params.temperature}-k{params.top_k}-p{params.top_p}"


@pytest.mark.parametrize("params", ALL_PARAMS, ids=_id)
def test_processed_logprobs_match_numpy_reference(logits, params):
    """Same support (-inf exactly where the reference has it) and log-probs within 1e-5, ties included."""
    got = np.asarray(processed_logprobs(jnp.asarray(logits), params))
    want = reference_logprobs(logits, params.temperature, params.top_k, params.top_p)
    assert got.shape == logits.shape and got.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], atol=1e-5, rtol=0)


@pytest.mark.parametrize("params", ALL_PARAMS, ids=_id)
def test_processed_logprobs_are_a_normalised_distribution_on_their_support(logits, params):
    """Every row has a non-empty support, no NaN or +inf, and probabilities summing to 1 (1e-5)."""
    got = np.asarray(processed_logprobs(jnp.asarray(logits), params))
    assert not np.isnan(got).any() and not np.isposinf(got).any()
    assert np.isfinite(got).any(axis=-1).all()
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("top_k", TOP_KS)
@pytest.mark.parametrize("top_p", TOP_PS)
def test_greedy_is_one_hot_on_the_first_argmax(logits, top_k, top_p):
    """temperature 0: log-prob 0 at the argmax (lowest index among tied maxima), -inf elsewhere, whatever top_k/top_p."""
    got = np.asarray(processed_logprobs(jnp.asarray(logits), SamplingParams(temperature=0.0, top_k=top_k, top_p=top_p)))
    want = np.full(logits.shape, -np.inf)
    want[np.arange(len(logits)), np.argmax(logits, -1)] = 0.0
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("top_p", (0.9, 0.5, 0.2))
def test_top_p_support_is_the_smallest_top_group_set_reaching_top_p(logits, temperature, top_p):
    """The kept tokens' tempered mass is >= top_p, and dropping the least probable kept group brings it below."""
    got = np.asarray(processed_logprobs(jnp.asarray(logits), SamplingParams(temperature=temperature, top_p=top_p)))
    full = np.asarray(jax.nn.softmax(jnp.asarray(logits) / temperature, axis=-1), np.float64)
    for x, p, lp in zip(logits, full, got):
        kept = np.isfinite(lp)
        assert p[kept].sum() >= top_p - 1e-6
        assert x[kept].min() > x[~kept].max(initial=-np.inf)  # kept tokens are exactly the top ones
        smaller = kept & (x > x[kept].min())
        assert p[smaller].sum() < top_p + 1e-6


@pytest.mark.parametrize("params", [p for p in ALL_PARAMS if not p.greedy], ids=_id)
def test_tokens_with_equal_logits_get_equal_probability(logits, params):
    """Equal logits give bit-equal log-probs, and permuting the vocabulary permutes the output (same support,
    log-probs to 1e-6): the distribution never depends on the order of tied tokens."""
    perm = np.random.RandomState(1).permutation(V)
    tied = logits[32:]
    got = np.asarray(processed_logprobs(jnp.asarray(tied), params))
    for x, lp in zip(tied, got):
        for value in np.unique(x):
            assert len(np.unique(lp[x == value])) == 1
    permuted = np.asarray(processed_logprobs(jnp.asarray(tied[:, perm]), params))
    np.testing.assert_array_equal(np.isneginf(permuted), np.isneginf(got[:, perm]))
    np.testing.assert_allclose(permuted, got[:, perm], atol=1e-6, rtol=0)


def test_ties_at_the_top_k_and_top_p_boundaries_are_kept_together():
    """Both filters keep a token tied with the last one kept (top_p=0.4 on logits [1, 1, 0] keeps both 1s)."""
    x = jnp.asarray([1.0, 1.0, 0.0])
    half = np.log(0.5)
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=0.4), SamplingParams(top_p=1e-6)):
        np.testing.assert_allclose(np.asarray(processed_logprobs(x, params)), [half, half, -np.inf], atol=1e-6)


# ----------------------------------------------------------------------------- draws

DRAWS = 200_000
SIX = np.asarray([1.2, -0.3, 0.5, 2.0, 0.0, -1.0], np.float32)
DRAW_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=4),
    SamplingParams(temperature=1.5, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
]


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs`` (over tokens with probs > 0)."""
    on = probs > 0
    return float(stats.chisquare(counts[on], counts[on].sum() * probs[on] / probs[on].sum()).pvalue)


@pytest.fixture(scope="module", params=DRAW_PARAMS, ids=_id)
def draws(request):
    """(params, tokens [N], log-probs [N]) of 200k draws on vocab 6, in one jitted call vmapped over keys."""
    params = request.param
    keys = jax.random.split(jax.random.key(0), DRAWS)
    draw = jax.jit(jax.vmap(lambda k: sample(k, jnp.asarray(SIX)[None], params)))
    toks, lps = draw(keys)
    assert toks.shape == lps.shape == (DRAWS, 1) and toks.dtype == jnp.int32
    return params, np.asarray(toks[:, 0]), np.asarray(lps[:, 0])


def test_draw_frequencies_match_the_processed_distribution(draws):
    """Chi-square accepts the processed distribution (p > 1e-3), never draws outside its support, and
    rejects (p < 1e-3) the same distribution with half a percentage point of mass moved: the test has power."""
    params, toks, _ = draws
    probs = np.exp(np.asarray(processed_logprobs(jnp.asarray(SIX), params), np.float64))
    counts = np.bincount(toks, minlength=SIX.size)
    assert counts[probs == 0].sum() == 0
    assert (probs > 0).sum() >= 3  # a support worth testing
    assert _chi_square_p(counts, probs) > 1e-3
    wrong = probs.copy()
    on = np.flatnonzero(probs > 0)
    wrong[on[np.argmax(probs[on])]] -= 0.005
    wrong[on[np.argmin(probs[on])]] += 0.005
    assert _chi_square_p(counts, wrong) < 1e-3


def test_returned_logprobs_are_the_processed_logprobs_of_the_drawn_tokens(draws):
    """sample's second output is processed_logprobs at the drawn token (1e-6), finite for every draw."""
    params, toks, lps = draws
    table = np.asarray(processed_logprobs(jnp.asarray(SIX), params))
    assert np.isfinite(lps).all()
    np.testing.assert_allclose(lps, table[toks], atol=1e-6, rtol=0)


def test_greedy_sample_is_the_argmax_with_logprob_zero(logits):
    """temperature 0 ignores the key: tokens are the row argmax, log-probs exactly 0."""
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.5)
    for seed in (0, 1):
        toks, lps = sample(jax.random.key(seed), jnp.asarray(logits), params)
        np.testing.assert_array_equal(np.asarray(toks), np.argmax(logits, -1))
        np.testing.assert_array_equal(np.asarray(lps), 0.0)


# ----------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_sampling_params_reject_invalid_values(kwargs, field):
    """An out-of-range (or NaN/inf) value is a ValueError naming the field and the value."""
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**kwargs)
    assert str(next(iter(kwargs.values()))) in str(err.value)


def test_sampling_params_are_hashable_and_greedy_means_temperature_zero():
    """Equal params hash equal (usable as a static jit argument); greedy is exactly temperature == 0."""
    assert hash(SamplingParams(0.7, 0.9, 5)) == hash(SamplingParams(temperature=0.7, top_p=0.9, top_k=5))
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=1e-3).greedy
    assert SamplingParams() == SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
