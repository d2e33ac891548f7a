"""`tltjax.rollout.dense`: batched generation with a contiguous cache, on a tiny random Qwen2 model."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tltjax.models import CausalLM, ModelConfig, forward
from tltjax.rollout.dense import generate, pad_prompts
from tltjax.rollout.sampling import SamplingParams, processed_logprobs

CONFIG = ModelConfig(
    model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True, max_position_embeddings=128,
)
PROMPTS = [[7, 3, 21, 40], [1, 2, 3, 4, 5, 6, 7, 8, 9], [50, 12, 33, 9, 9, 60]]  # ragged: lengths 4, 9, 6
NEW = 12
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=48, top_p=0.95)


@pytest.fixture(scope="module")
def model():
    """A 2-layer Qwen2-style model with every parameter drawn at a scale that gives logits of std ~1.5,
    so greedy choices are decisive (not float-noise near-ties) and sampled sequences vary.

    Built shape-only and filled from numpy: eager random init would compile a kernel per parameter shape.
    """
    m = nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0)))
    rng = np.random.RandomState(0)
    for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        noise = rng.normal(size=var.shape).astype(np.float32)
        var.set_value(jnp.asarray(1.0 + 0.1 * noise if "norm" in ".".join(map(str, path)) else 0.3 * noise))
    return m


@pytest.fixture(scope="module")
def greedy(model):
    return generate(model, PROMPTS, max_new_tokens=NEW, params=GREEDY)


@pytest.fixture(scope="module")
def sampled(model):
    return generate(model, PROMPTS, max_new_tokens=NEW, params=SAMPLED, seed=0)


def teacher_forced_logprobs(model, prompts, gens, params):
    """Per row, processed_logprobs of each generated token given prompt + earlier tokens, by one uncached forward."""
    ids, _ = pad_prompts([p + g.tokens for p, g in zip(prompts, gens)])  # right padding: causal, so harmless
    logp = np.asarray(processed_logprobs(forward(model, jnp.asarray(ids)).logits, params))
    return [row[np.arange(len(g.tokens)) + len(p) - 1, g.tokens] for p, g, row in zip(prompts, gens, logp)]


def test_greedy_ragged_batch_equals_each_prompt_alone(model, greedy):
    """Padding and batching change nothing: each row of a ragged batch equals generating its prompt alone."""
    for prompt, row in zip(PROMPTS, greedy):
        (alone,) = generate(model, [prompt], max_new_tokens=NEW, params=GREEDY)
        assert row.tokens == alone.tokens
        assert row.logprobs == alone.logprobs


def test_without_stop_ids_rows_run_to_max_new_tokens(greedy):
    """No stop ids: every row has exactly max_new_tokens tokens, finish_reason "length", greedy log-probs 0."""
    for row in greedy:
        assert len(row.tokens) == len(row.logprobs) == NEW
        assert row.finish_reason == "length"
        assert all(0 <= t < CONFIG.vocab_size for t in row.tokens)
        assert row.logprobs == [0.0] * NEW
    assert len({tuple(r.tokens) for r in greedy}) == len(PROMPTS)  # the model is not degenerate


def test_greedy_tokens_are_the_argmax_of_an_uncached_forward(model, greedy):
    """The cached decode agrees with teacher forcing: each greedy token is the argmax of the full-forward logits."""
    for lp in teacher_forced_logprobs(model, PROMPTS, greedy, GREEDY):
        np.testing.assert_array_equal(lp, 0.0)


def test_sampled_logprobs_equal_teacher_forced_recomputation(model, sampled):
    """Reported log-probs are processed_logprobs (temperature, top-k, top-p) of the drawn tokens under an
    uncached forward of prompt + generated tokens, within 1e-5; every drawn token is in the support."""
    for row, lp in zip(sampled, teacher_forced_logprobs(model, PROMPTS, sampled, SAMPLED)):
        assert len(row.tokens) == NEW and row.finish_reason == "length"
        assert np.isfinite(lp).all()
        np.testing.assert_allclose(row.logprobs, lp, atol=1e-5, rtol=0)


def test_same_seed_same_tokens_other_seed_other_tokens(model, sampled):
    """Sampling is a function of the seed: seed 0 again reproduces tokens and log-probs; seed 1 differs."""
    again = generate(model, PROMPTS, max_new_tokens=NEW, params=SAMPLED, seed=0)
    other = generate(model, PROMPTS, max_new_tokens=NEW, params=SAMPLED, seed=1)
    assert [(r.tokens, r.logprobs) for r in again] == [(r.tokens, r.logprobs) for r in sampled]
    assert [r.tokens for r in other] != [r.tokens for r in sampled]


def test_stop_ids_end_rows_and_are_kept(model, greedy):
    """With stop ids, each row is the stop-free generation cut just after its first stop token
    (kept, finish_reason "stop"); a row without one runs to max_new_tokens ("length")."""
    first, third = greedy[0].tokens, greedy[2].tokens
    stops = (first[3], third[5])
    gens = generate(model, PROMPTS, max_new_tokens=NEW, params=GREEDY, stop_ids=stops)
    cut_anywhere = False
    for full, row in zip(greedy, gens):
        hits = [i for i, t in enumerate(full.tokens) if t in stops]
        n = hits[0] + 1 if hits else NEW
        assert row.tokens == full.tokens[:n]
        assert row.logprobs == full.logprobs[:n]
        assert row.finish_reason == ("stop" if hits else "length")
        cut_anywhere |= n < NEW
    assert gens[0].finish_reason == gens[2].finish_reason == "stop" and cut_anywhere


def test_pad_prompts_right_pads_and_reports_lengths():
    """Prompts are right-padded with pad_id to the longest; lengths are the prompt lengths."""
    ids, lens = pad_prompts([[5, 6], [7], [1, 2, 3]], pad_id=9)
    np.testing.assert_array_equal(ids, [[5, 6, 9], [7, 9, 9], [1, 2, 3]])
    np.testing.assert_array_equal(lens, [2, 1, 3])
    assert ids.dtype == lens.dtype == np.int32


@pytest.mark.parametrize("prompts", [[], [[1, 2], []]], ids=["no-prompts", "one-empty-prompt"])
def test_empty_prompts_are_rejected(model, prompts):
    """No prompts, or a prompt without tokens, is a ValueError before anything runs."""
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, prompts, max_new_tokens=4)
