"""Losslessness of the whole speculative pipeline, proven statistically on a small vocabulary.

A tiny random target with 5 tokens and a random (poorly aligned) drafter run
through the real engine: prefill, then speculative chunks only (chain and
EAGLE-2 tree), on 200k samples of one prompt. The joint distribution of the
first 4 generated tokens (625 outcomes) is compared with the target's exact
joint, enumerated with full forward passes, by a G-test. The same test run
with a deliberately biased acceptor must reject, so the test can fail.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from tests.random_init import fill
from tltjax.drafter import Drafter, DrafterConfig
from tltjax.models import CausalLM, ModelConfig, forward
from tltjax.rollout import speculative
from tltjax.rollout.engine import Engine, EngineConfig
from tltjax.rollout.sampling import SamplingParams, processed_logprobs

pytestmark = pytest.mark.slow

V = 5
NEW = 4
PROMPT = [1, 3, 0]
SAMPLES = 200_000
CONFIG = ModelConfig(
    model_type="qwen2", vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, attention_bias=True, max_position_embeddings=64,
)
CHAIN, TREE = "eagle:depth=3", "eagle:depth=3,top_k=2,num_verify=5"


@pytest.fixture(scope="module")
def models():
    target = fill(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0))), 0, 0.5)
    drafter = fill(nnx.eval_shape(lambda: Drafter(DrafterConfig.for_target(CONFIG), rngs=nnx.Rngs(0))), 1, 0.3)
    return target, drafter


def _engine(models, sampling):
    target, drafter = models
    cfg = EngineConfig(
        max_batch=4096, batch_buckets=(4096,), max_seq_len=16, page_size=8, decode_steps=2, spec_rounds=3,
        spec_threshold=4096, strategies=(CHAIN, TREE), prefill_batch=4096, prefill_lengths=(4,), max_group=0,
    )
    eng = Engine(target, cfg, drafter)
    eng.warmup(sampling)
    return eng


def _exact_joint(target, sampling) -> np.ndarray:
    """P(x_1..x_4 | PROMPT) of plain sampling, for all V**4 continuations (float64)."""
    seqs = np.array(list(itertools.product(range(V), repeat=NEW)), np.int32)
    ids = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], axis=1)
    logits = forward(target, jnp.asarray(ids)).logits
    lp = np.asarray(processed_logprobs(logits, sampling), np.float64)
    p0 = len(PROMPT) - 1
    per_token = lp[np.arange(len(seqs))[:, None], p0 + np.arange(NEW)[None], seqs]
    joint = np.exp(per_token.sum(1))
    return joint / joint.sum()


def _observed(engine, strategy, n, seed) -> tuple[np.ndarray, object]:
    seqs, st = engine.generate([PROMPT], n=n, sampling=engine._sampling, max_new_tokens=NEW, seed=seed,
                               strategy=strategy)
    assert all(len(s.tokens) == NEW for s in seqs)
    codes = np.array([s.tokens for s in seqs]) @ (V ** np.arange(NEW - 1, -1, -1))
    return np.bincount(codes, minlength=V**NEW), st


def _g_test(observed, expected_p) -> float:
    """p-value of a G-test, pooling outcomes whose expected count is below 5."""
    expected = expected_p * observed.sum()
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.power_divergence(obs, exp, lambda_="log-likelihood").pvalue)


@pytest.mark.parametrize(
    "sampling", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.8)], ids=["T1", "T0.7-top_p0.8"]
)
def test_speculative_sampling_matches_the_target_joint_exactly(models, sampling):
    """Chain and tree speculation: 200k samples of 4 tokens fit the exact joint (G-test p > 1e-3),
    with multi-token acceptance actually happening."""
    engine = _engine(models, sampling)
    exact = _exact_joint(models[0], sampling)
    for strategy, seed in [(CHAIN, 1), (TREE, 2)]:
        observed, st = _observed(engine, strategy, SAMPLES, seed)
        assert st.decode_calls == 0 and st.spec_calls > 0  # every token after the first is speculative
        assert st.mean_accept_length > 1.05, st.mean_accept_length
        p = _g_test(observed, exact)
        assert p > 1e-3, (strategy, p)


def test_a_biased_acceptor_is_detected(models, monkeypatch):
    """Accepting drafted tokens a little too often (their target log-prob +0.4) fails the same test."""
    real_accept = speculative.accept

    def biased_accept(key, logp, tokens, parents):
        rows = jnp.arange(tokens.shape[0])[:, None]
        boost = jnp.zeros_like(logp).at[rows, jnp.clip(parents + 1, 0), tokens].add(jnp.where(parents >= -1, 0.4, 0.0))
        return real_accept(key, jax.nn.log_softmax(logp + boost, axis=-1), tokens, parents)

    monkeypatch.setattr(speculative, "accept", biased_accept)
    sampling = SamplingParams(1.0)
    engine = _engine(models, sampling)
    observed, _ = _observed(engine, TREE, SAMPLES // 4, 3)
    assert _g_test(observed, _exact_joint(models[0], sampling)) < 1e-3
