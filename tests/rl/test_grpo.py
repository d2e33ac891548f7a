"""`tltjax.rl.grpo`: advantages, aggregations, the clipped loss and KL terms against hand computations;
`grpo_update` is exact under micro-batching and on a mesh, needs no reference without KL, and learns.

Update tests share a tiny random model, a batch shape and one optimiser (plain SGD with step 1, so a
parameter difference is a gradient difference), so `grpo_update` compiles only a few times.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float

from tests.random_init import fill
from tltjax import sft
from tltjax import sharding as shd
from tltjax.models import CausalLM, ModelConfig
from tltjax.rl import grpo

CONFIG = ModelConfig(
    model_type="qwen2", vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True, max_position_embeddings=64,
)
BATCH, SEQ = 8, 12
SGD = optax.sgd(1.0)  # params_after - params_before = -grad: compares gradients directly
KL_CFG = grpo.loss_config("drgrpo", kl_coef=0.1, kl_kind="kl")


def _state(tx, seed=0) -> sft.TrainState:
    """A fresh TrainState (its own buffers: grpo_update donates it) of the tiny random model."""
    return sft.TrainState.create(fill(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0))), seed, 0.3), tx)


def _rows(seed):
    """Right-padded (tokens, loss_mask) with varied prompt/response lengths; row 3 has no response tokens."""
    rng = np.random.RandomState(seed)
    tokens = np.zeros((BATCH, SEQ), np.int32)
    mask = np.zeros((BATCH, SEQ), np.float32)
    for i in range(BATCH):
        p = rng.randint(1, 5)
        r = 0 if i == 3 else rng.randint(1, SEQ - p + 1)
        tokens[i, : p + r] = rng.randint(1, CONFIG.vocab_size, p + r)
        mask[i, p : p + r] = 1.0
    return tokens, mask


def _batch(state, seed=0, *, noise=0.3, ref=False) -> grpo.GRPOBatch:
    """A batch whose old_logp is the state's own log-prob plus ``noise`` (so some ratios clip)."""
    rng = np.random.RandomState(seed + 100)
    tokens, mask = _rows(seed)
    logp = np.asarray(grpo.compute_logprobs(state.graphdef, state.params, jnp.asarray(tokens)))
    old = (logp + noise * rng.normal(size=logp.shape)) * mask
    ref_logp = (logp + 0.5 * rng.normal(size=logp.shape)) * mask if ref else None
    return grpo.GRPOBatch(
        tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), old_logp=jnp.asarray(old, jnp.float32),
        advantages=jnp.asarray(rng.normal(size=BATCH), jnp.float32),
        ref_logp=None if ref_logp is None else jnp.asarray(ref_logp, jnp.float32),
    )


def _update(tx, cfg, m, *, ref=False, seed=0):
    state = _state(tx)
    batch = _batch(state, seed, ref=ref)
    return grpo.grpo_update(state, batch, cfg, micro_batches=m)


def _assert_same_update(a, b, atol):
    (sa, ma), (sb, mb) = a, b
    for x, y in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sb.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)
    for k in ma:
        np.testing.assert_allclose(float(ma[k]), float(mb[k]), rtol=1e-5, atol=1e-6, err_msg=k)


# ----------------------------------------------------------------------------- advantages
def test_advantages_on_hand_made_rewards():
    """grpo: (r - mean)/(std, ddof 1); drgrpo: r - mean; equal-reward groups give exactly 0; numpy input works."""
    rewards = np.array([[1, 0, 0, 0], [0.1, 0.1, 0.1, 0.1], [2, 0, 1, 1]], np.float32)
    a = grpo.get_advantage_estimator("grpo")(rewards)
    assert isinstance(a, Float[Array, "3 4"])
    s3 = np.sqrt(1.5)  # (2,0,1,1): deviations (1,-1,0,0), sample variance 2/3
    np.testing.assert_allclose(np.asarray(a), [[1.5, -0.5, -0.5, -0.5], [0, 0, 0, 0], [s3, -s3, 0, 0]], rtol=1e-5)
    assert np.all(np.asarray(a)[1] == 0.0)
    d = grpo.get_advantage_estimator("drgrpo")(jnp.asarray(rewards))
    np.testing.assert_allclose(np.asarray(d), [[0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0], [1, -1, 0, 0]], atol=1e-7)
    assert np.all(np.asarray(d)[1] == 0.0)


def test_single_sample_groups_get_zero_advantage():
    """A group of one sample has no baseline to compare with: 0 under every estimator, never nan."""
    for name in grpo.ADVANTAGE_ESTIMATORS:
        out = np.asarray(grpo.get_advantage_estimator(name)(np.array([[3.0], [-1.0]])))
        assert out.shape == (2, 1) and np.all(out == 0.0), name


def test_zero_variance_and_dynamic_sampling_masks():
    """Groups with equal rewards (or one sample) are flagged; dynamic sampling keeps the others, or all when off."""
    rewards = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0], [1, 0, 1]], np.float32)
    zv = grpo.zero_variance_groups(rewards)
    assert isinstance(zv, Bool[Array, " 4"])
    assert zv.tolist() == [True, False, True, False]
    assert grpo.dynamic_sampling_mask(rewards).tolist() == [False, True, False, True]
    assert grpo.dynamic_sampling_mask(rewards, enabled=False).tolist() == [True] * 4
    assert grpo.zero_variance_groups(np.array([[0.3], [1.0]])).tolist() == [True, True]


def test_unknown_names_are_clear_errors():
    """Unknown estimator, algorithm, registry name or override field: the error names it and lists the options."""
    with pytest.raises(KeyError, match=r"advantage estimator 'ppo'.*\['drgrpo', 'grpo'\]"):
        grpo.get_advantage_estimator("ppo")
    with pytest.raises(KeyError, match=r"algorithm 'gpro'.*'dapo'"):
        grpo.loss_config("gpro")
    with pytest.raises(ValueError, match=r"\['clip_hgh'\].*clip_high"):
        grpo.loss_config("dapo", clip_hgh=0.3)
    with pytest.raises(KeyError, match=r"loss aggregation 'mean'.*token-mean"):
        grpo.loss_config("grpo", aggregation="mean")
    with pytest.raises(KeyError, match=r"KL penalty 'k9'.*low_var_kl"):
        grpo.loss_config("grpo", kl_kind="k9")
    with pytest.raises(ValueError, match="kl_coef"):
        grpo.loss_config("grpo", kl_coef=-0.1)


def test_presets():
    """dapo = grpo advantages, token-mean, clip 0.2/0.28, dynamic sampling; grpo and drgrpo as published; hashable."""
    dapo = grpo.loss_config("dapo")
    assert (dapo.advantage, dapo.aggregation, dapo.clip_low, dapo.clip_high) == ("grpo", "token-mean", 0.2, 0.28)
    assert dapo.dynamic_sampling and dapo.kl_coef == 0.0
    g = grpo.loss_config("grpo")
    assert (g.advantage, g.aggregation, g.clip_low, g.clip_high, g.dynamic_sampling) == (
        "grpo", "seq-mean-token-mean", 0.2, 0.2, False)
    d = grpo.loss_config("drgrpo")
    assert (d.advantage, d.aggregation, d.clip_low, d.clip_high) == ("drgrpo", "seq-mean-token-sum-norm", 0.2, 0.2)
    over = grpo.loss_config("dapo", kl_coef=0.01, max_len=64)
    assert over.kl_coef == 0.01 and over.max_len == 64 and over.clip_high == 0.28
    assert hash(over) == hash(grpo.loss_config("dapo", kl_coef=0.01, max_len=64))
    assert grpo.ALGORITHMS["dapo"].kl_coef == 0.0  # presets are not mutated by overrides


# ----------------------------------------------------------------------------- aggregations
VALUES = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]], np.float32)
MASK = np.array([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]], np.float32)  # row 2: no response tokens


@pytest.mark.parametrize(
    "name, want_sum, want_count",
    [
        ("token-mean", 2 + 3 + 4 + 7, 4),
        ("seq-mean-token-mean", (2 + 3 + 4) / 3 + 7, 2),
        ("seq-mean-token-sum-norm", (2 + 3 + 4) / 8 + 7 / 8, 2),
    ],
)
def test_aggregation_against_hand_computation(name, want_sum, want_count):
    """(sum, count) as computed by hand (max_len 8); rows without tokens count nowhere; row halves add up exactly."""
    agg = grpo.LOSS_AGGREGATIONS[name]
    s, c = agg(jnp.asarray(VALUES), jnp.asarray(MASK), max_len=8)
    np.testing.assert_allclose(float(s), want_sum, rtol=1e-6)
    assert float(c) == want_count
    parts = [agg(jnp.asarray(VALUES[i : i + 1]), jnp.asarray(MASK[i : i + 1]), max_len=8) for i in range(3)]
    np.testing.assert_allclose(sum(float(p[0]) for p in parts), want_sum, rtol=1e-6)
    assert sum(float(p[1]) for p in parts) == want_count


# ----------------------------------------------------------------------------- policy loss and KL
def test_ppo_clip_zeroes_the_gradient_only_where_the_clipped_branch_is_active():
    """Positive A above 1+clip_high and negative A below 1-clip_low are clipped (zero gradient); the other
    sides are not (pessimistic bound). Per-side epsilons: ratio 1.25 clips at clip_high 0.2, not at 0.28."""
    ratio = np.array([1.3, 1.25, 0.5, 0.7, 1.5, 0.9], np.float32)
    adv = jnp.asarray([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    logp, old = jnp.log(jnp.asarray(ratio)), jnp.zeros(6)

    def run(cfg):
        loss, clipped = grpo.ppo_clip_loss(logp, old, adv, cfg)
        grad = jax.grad(lambda lp: grpo.ppo_clip_loss(lp, old, adv, cfg)[0].sum())(logp)
        return np.asarray(loss), np.asarray(clipped), np.asarray(grad)

    loss, clipped, grad = run(grpo.loss_config("dapo"))  # clip 0.2 / 0.28
    assert clipped.tolist() == [True, False, False, True, False, False]
    np.testing.assert_allclose(loss, [-1.28, -1.25, -0.5, 0.8, 1.5, 0.9], rtol=1e-6)
    # d/dlogp of -A·ρ is -A·ρ where unclipped, 0 where clipped.
    np.testing.assert_allclose(grad, [0.0, -1.25, -0.5, 0.0, 1.5, 0.9], rtol=1e-6)
    _, clipped, grad = run(grpo.loss_config("grpo"))  # clip 0.2 / 0.2
    assert clipped.tolist() == [True, True, False, True, False, False]
    assert grad[1] == 0.0


def test_kl_penalties_match_numpy():
    """k1, k3 (clamped to [-10, 10]) and mse equal their numpy formulas, including a clamped entry."""
    rng = np.random.RandomState(0)
    logp = -rng.uniform(0.1, 3.0, 20).astype(np.float32)
    ref = -rng.uniform(0.1, 3.0, 20).astype(np.float32)
    ref[0], logp[0] = -0.1, -15.0  # k3 = exp(14.9) - ... → clamped to 10
    d = ref - logp
    want = {"kl": logp - ref, "low_var_kl": np.clip(np.exp(d) - d - 1, -10, 10), "mse": 0.5 * (logp - ref) ** 2}
    for kind, w in want.items():
        got = np.asarray(grpo.KL_PENALTIES[kind](jnp.asarray(logp), jnp.asarray(ref)))
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6, err_msg=kind)
    assert np.asarray(grpo.kl_k3(jnp.asarray(logp), jnp.asarray(ref)))[0] == 10.0


# ----------------------------------------------------------------------------- the update
def test_micro_batching_is_exact():
    """grpo_update with M = 4 micro-batches gives M = 1's gradient step (SGD: params differ by the gradient)
    and metrics, under seq-mean-token-mean weighting with a padding row in the batch."""
    cfg = grpo.loss_config("grpo")
    full = _update(SGD, cfg, 1)
    assert 0 < float(full[1]["clip_fraction"]) < 1  # the batch exercises both branches
    _assert_same_update(full, _update(SGD, cfg, 4), atol=1e-6)


@pytest.mark.parametrize("algorithm", ["grpo", "drgrpo", "dapo"])
def test_accumulate_over_micro_batches_of_any_width_is_exact(algorithm):
    """grpo_accumulate + grpo_apply over the rows sorted by length, cut into micro-batches of 3, 3 and 2 rows each
    padded only to its own longest row, give grpo_update's full-batch step and metrics (KL on; Dr.GRPO's
    divisor fixed by max_len, as the trainer sets it)."""
    cfg = grpo.loss_config(algorithm, kl_coef=0.1, kl_kind="kl", max_len=SEQ)
    full = _update(SGD, cfg, 1, ref=True)
    state = _state(SGD)
    batch = _batch(state, ref=True)
    used = np.asarray(batch.tokens != 0).sum(1)  # tokens are >= 1 up to each row's length, 0 after
    order = np.argsort(used, kind="stable")
    acc, widths = None, []
    for rows in np.split(order, [3, 6]):
        width = max(int(used[rows].max()), 1)
        widths.append(width)
        part = jax.tree.map(lambda x: x[rows][:, :width] if x.ndim == 2 else x[rows], batch)
        acc = grpo.grpo_accumulate(acc, state, part, cfg)
    assert len(set(widths)) > 1, widths  # the micro-batches really differ in width
    _assert_same_update(full, grpo.grpo_apply(state, acc), atol=1e-6)


def test_kl_penalty_enters_the_loss_and_kl_reports_k3():
    """With Dr.GRPO's sum-norm aggregation and a k1 penalty to a reference, loss = pg_loss + kl_coef · (k1 summed
    / max_len / sequences), and the `kl` metric is the mean k3 estimate against the reference."""
    full = _update(SGD, KL_CFG, 1, ref=True)
    state = _state(SGD)
    batch = _batch(state, ref=True)
    logp = grpo.compute_logprobs(state.graphdef, state.params, batch.tokens)
    mask = np.asarray(batch.loss_mask)
    k1 = np.asarray(logp - batch.ref_logp) * mask
    seqs = (mask.sum(1) > 0).sum()
    np.testing.assert_allclose(
        float(full[1]["loss"]) - float(full[1]["pg_loss"]), 0.1 * k1.sum() / SEQ / seqs, rtol=1e-4, atol=1e-6)
    k3 = np.asarray(grpo.kl_k3(logp, batch.ref_logp))
    np.testing.assert_allclose(float(full[1]["kl"]), (k3 * mask).sum() / mask.sum(), rtol=1e-5)


def test_kl_coef_zero_needs_no_reference():
    """With kl_coef 0 the batch has no ref_logp and `kl` is mean(old_logp - logp); kl_coef > 0 without it is an
    error that says what is missing."""
    state = _state(SGD)
    batch = _batch(state)
    assert batch.ref_logp is None
    logp = np.asarray(grpo.compute_logprobs(state.graphdef, state.params, batch.tokens))
    mask = np.asarray(batch.loss_mask)
    want = ((np.asarray(batch.old_logp) - logp) * mask).sum() / mask.sum()
    _, metrics = grpo.grpo_update(state, batch, grpo.loss_config("grpo"), micro_batches=1)
    np.testing.assert_allclose(float(metrics["kl"]), want, rtol=1e-5)
    assert float(metrics["tokens"]) == mask[:, 1:].sum()
    with pytest.raises(ValueError, match="needs batch.ref_logp"):
        grpo.grpo_update(_state(SGD), batch, grpo.loss_config("grpo", kl_coef=0.1), micro_batches=1)


def test_on_policy_old_logp_matches_the_recompute():
    """old_logp from the same params: logp_mismatch_max ≈ 0, nothing clipped, kl ≈ 0, ratio 1."""
    state = _state(SGD)
    batch = _batch(state, noise=0.0)
    _, m = grpo.grpo_update(state, batch, grpo.loss_config("grpo"), micro_batches=1)
    assert float(m["logp_mismatch_max"]) < 1e-5
    assert float(m["clip_fraction"]) == 0.0 and abs(float(m["kl"])) < 1e-6
    assert float(m["entropy"]) > 0 and np.isfinite(float(m["grad_norm"]))
    stale = _batch(_state(SGD), noise=0.3)
    _, m = grpo.grpo_update(_state(SGD), stale, grpo.loss_config("grpo"), micro_batches=1)
    assert float(m["logp_mismatch_max"]) > 0.1


def test_positive_advantage_raises_the_response_logprob():
    """Five on-policy updates with advantage +1 on fixed responses raise their summed log-prob (it learns)."""
    state = _state(SGD, seed=1)
    tokens, mask = _rows(1)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)

    def response_logp(s):
        return float((grpo.compute_logprobs(s.graphdef, s.params, tokens) * mask).sum()), None

    before, _ = response_logp(state)
    for _ in range(5):
        old = grpo.compute_logprobs(state.graphdef, state.params, tokens) * mask
        batch = grpo.GRPOBatch(tokens=tokens, loss_mask=mask, old_logp=old, advantages=jnp.ones(BATCH))
        state, m = grpo.grpo_update(state, batch, grpo.loss_config("grpo"), micro_batches=1)
    after, _ = response_logp(state)
    assert int(state.step) == 5
    assert after > before + 1.0, (before, after)


def test_sharded_update_equals_single_device():
    """Params sharded on a 2 (fsdp) x 4 (tensor) mesh of 8 CPU devices, batch rows split over fsdp, 2 micro-batches:
    params and metrics match the single-device, single-micro-batch update to 1e-5 (KL penalty and sum-norm on,
    so this also shows M = 2 exactness), and the params stay sharded."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS before jax is imported)")
    single = _update(SGD, KL_CFG, 1, ref=True)
    mesh = shd.make_mesh({"fsdp": 2, "tensor": 4})
    model = shd.shard_model(fill(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0))), 0, 0.3), mesh)
    state = sft.TrainState.create(model, SGD)
    rows = lambda x: jax.device_put(x, shd.named_sharding(x.shape, ("batch",) + (None,) * (x.ndim - 1), mesh))
    batch = jax.tree.map(rows, _batch(_state(SGD), ref=True))
    with shd.use_mesh(mesh):
        sharded = grpo.grpo_update(state, batch, KL_CFG, micro_batches=2)
    q = sharded[0].params["model"]["layers"][0]["self_attn"]["q_proj"]["weight"][...]
    assert isinstance(q.sharding, NamedSharding) and q.sharding.spec == P("tensor", "fsdp")
    _assert_same_update(single, sharded, atol=1e-5)
