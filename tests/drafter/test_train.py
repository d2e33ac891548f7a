"""`tltjax.drafter.train` and the offline ``train_drafter`` job (`tltjax.drafter.offline`).

Properties of the loss and the update are shown on a tiny random target with
random variable-length sequences; every test here shares one optimiser, so
`drafter_update` compiles once per batch type for the module. "Harvested"
features are what the rollout engine returns: the target's features at every
position but the last, here taken from `target_features`. Learning is shown on the micro
config's tiny policy (trained by SFT in seconds into a module-private cache),
by running the job through `tltjax.main` once and reading what it measured.
"""

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.random_init import fill, random_module
from tltjax import main, sft, tiny_policy
from tltjax.config import ConfigError, load_config
from tltjax.drafter import (
    Drafter,
    DrafterBuffer,
    DrafterConfig,
    DrafterTrainState,
    drafter_loss,
    drafter_update,
    load_drafter,
    make_batch,
    pack_windows,
    shard_for_update,
    target_features,
    train_drafter,
)
from tltjax.drafter import offline
from tltjax.models import CausalLM, ModelConfig

CONFIG = ModelConfig(
    model_type="qwen2", vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True, max_position_embeddings=128,
)
SEQ = 32
TX = sft.make_optimizer(1e-2, 40, 2)  # one optimiser object: one compilation of drafter_update for the module
loss_jit = nnx.jit(drafter_loss, static_argnames=("ce_weight", "feat_weight", "unroll_steps"))
FINAL = CONFIG.num_hidden_layers


@pytest.fixture(scope="module")
def target():
    return fill(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0))), 0, 0.3)


@pytest.fixture(scope="module")
def sequences():
    """24 random token sequences of 3..40 tokens (so some rows are padded and some cut at SEQ)."""
    rng = np.random.RandomState(1)
    return [list(rng.randint(0, CONFIG.vocab_size, size=rng.randint(3, 41))) for _ in range(24)]


def _drafter(seed, feature_layers=None):
    return random_module(Drafter, DrafterConfig.for_target(CONFIG, feature_layers), seed, 0.1)


def _harvest(target, sequences, feature_layers):
    """A `DrafterBuffer` (step 0) of ``sequences`` (cut to SEQ + 1 tokens) with the features a rollout returns.

    Row t of a sequence's features is the target's feature at position t, for every position but the last;
    final hidden states are added when the feature layers lack the final layer.
    """
    seqs = [list(s[: SEQ + 1]) for s in sequences]
    ids = np.zeros((len(seqs), SEQ + 1), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    feats, hidden, _ = jax.device_get(target_features(target, ids, feature_layers))
    buf = DrafterBuffer.for_drafter(DrafterConfig.for_target(CONFIG, feature_layers), FINAL, 2048)
    for i, s in enumerate(seqs):
        buf.add(0, s, feats[i, : len(s) - 1], None if buf.hidden is None else hidden[i, : len(s) - 1])
    return buf, seqs


def _whole(buf):
    """Each live sequence of ``buf`` as one window."""
    return [buf.window(s, 0, int(buf.seq_length[s])) for s in buf.live()]


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_update_compiles_once_reads_the_live_target_and_never_changes_it(target, sequences):
    """Many steps and a new set of target weights reuse one compilation; the target's weights stay bit-identical.

    The perturbed target changes the step's result, so its weights are inputs, not constants baked in.
    """
    state = DrafterTrainState.create(_drafter(1), target, TX)
    tparams = nnx.state(target)
    before = _leaves(tparams)
    drafter_before = _leaves(state.params)
    compiled = drafter_update._cache_size()
    batches = [make_batch(target, sequences[i : i + 8], SEQ, (CONFIG.num_hidden_layers,)) for i in (0, 8, 16)]
    for step in range(9):
        state, metrics = drafter_update(state, tparams, batches[step % 3])
    assert int(state.step) == 9 and np.isfinite(float(metrics["loss"]))
    assert drafter_update._cache_size() == compiled + 1
    for a, b in zip(before, _leaves(nnx.state(target))):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(drafter_before, _leaves(state.params)))

    other = jax.tree.map(lambda x: x * 1.5, tparams)
    _, m_same = drafter_update(jax.tree.map(jnp.copy, state), tparams, batches[0])
    _, m_other = drafter_update(jax.tree.map(jnp.copy, state), other, batches[0])
    assert drafter_update._cache_size() == compiled + 1
    assert float(m_same["loss"]) != float(m_other["loss"])


def test_loss_falls_under_repeated_updates(target, sequences):
    """Thirty steps on one batch cut its loss by more than a third and raise agreement with the target's argmax."""
    state = DrafterTrainState.create(_drafter(2), target, TX)
    tparams = nnx.state(target)
    batch = make_batch(target, sequences[:8], SEQ, (CONFIG.num_hidden_layers,))
    history = []
    for _ in range(30):
        state, m = drafter_update(state, tparams, batch)
        history.append(jax.device_get(m))
    assert history[-1]["loss"] < 0.65 * history[0]["loss"], [float(h["loss"]) for h in history]
    assert history[-1]["top1"] > history[0]["top1"] + 0.3


def test_loss_sums_over_micro_batches_equal_the_full_batch(target, sequences):
    """(sum, count) and the metric sums of two halves add up to those of the whole batch."""
    drafter, layers = _drafter(3), (CONFIG.num_hidden_layers,)
    full = make_batch(target, sequences[:8], SEQ, layers)
    loss, count, sums = loss_jit(drafter, target, *full.aligned())
    halves = [sequences[i : i + 4] + [[]] * 4 for i in (0, 4)]  # padded to the full shape: one compilation
    parts = [loss_jit(drafter, target, *make_batch(target, h, SEQ, layers).aligned()) for h in halves]
    np.testing.assert_allclose(float(loss), sum(float(p[0]) for p in parts), rtol=1e-5)
    assert float(count) == sum(float(p[1]) for p in parts)
    for k in sums:
        np.testing.assert_allclose(float(sums[k]), sum(float(p[2][k]) for p in parts), rtol=1e-5)


def test_only_real_token_pairs_count(target, sequences):
    """A sequence of n tokens (cut at SEQ) gives n - 1 drafter positions; padding and empty rows give none."""
    rows = [sequences[0][:10], sequences[1][:3], [], sequences[2] + sequences[3], [5]] + [[]] * 3
    batch = make_batch(target, rows, SEQ, (CONFIG.num_hidden_layers,))
    *_, valid = batch.aligned()
    assert valid.sum(1).tolist() == [9, 2, 0, SEQ - 1, 0, 0, 0, 0]


def test_bad_training_arguments_are_clear_errors(target, sequences):
    dcfg = DrafterConfig.for_target(CONFIG)
    kw = dict(steps=1, batch_size=4, seq_len=SEQ, lr=1e-3, progress=False)
    with pytest.raises(ValueError, match="steps=0 must be >= 1"):
        train_drafter(target, dcfg, sequences, **{**kw, "steps": 0})
    with pytest.raises(ValueError, match="seq_len=1"):
        train_drafter(target, dcfg, sequences, **{**kw, "seq_len": 1})
    with pytest.raises(ValueError, match="2 or more tokens"):
        train_drafter(target, dcfg, [[1], []], **kw)
    with pytest.raises(ValueError, match="ce_weight"):
        DrafterTrainState.create(_drafter(4), target, TX, ce_weight=-1.0)


# ----------------------------------------------------------------------------- harvested features, packed rows
@pytest.mark.parametrize("feature_layers", [(FINAL,), (1, FINAL), (1,)], ids=["eagle1", "with_final", "no_final"])
def test_harvested_features_train_like_a_target_forward(target, sequences, feature_layers):
    """The packed loss on harvested features equals the dense loss with a fresh target forward, term by term.

    EAGLE-1 reads h from the features, (1, final) from the final layer's slot, (1,) from the stored hidden
    array; the target's logits are its LM head on h either way. A sequence of L tokens gives L - 2
    positions, as the dense batch of its first L - 1 tokens does (the last token has no feature).
    """
    drafter = _drafter(5, feature_layers)
    buf, seqs = _harvest(target, sequences[:8], feature_layers)
    assert (buf.hidden is None) == (FINAL in feature_layers)
    packed = pack_windows(_whole(buf), 4, 2 * SEQ)
    dense = make_batch(target, [s[:-1] for s in seqs], SEQ, feature_layers)
    got = loss_jit(drafter, target, *packed.aligned(drafter.config, FINAL), **packed.layout())
    want = loss_jit(drafter, target, *dense.aligned())
    assert float(got[1]) == float(want[1]) == sum(len(s) - 2 for s in seqs)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=2e-5)
    for k in want[2]:
        np.testing.assert_allclose(float(got[2][k]), float(want[2][k]), rtol=2e-5, atol=1e-5)


def test_packed_update_compiles_once_and_learns_from_harvested_features(target, sequences):
    """Twenty updates on fresh packed batches sampled from the buffer compile once and cut a held-out batch's loss."""
    buf, _ = _harvest(target, sequences, (FINAL,))
    rng = np.random.default_rng(0)
    held_out = buf.sample_batch(rng, 8, SEQ, window=16)
    state = DrafterTrainState.create(_drafter(6), target, TX)
    tparams = nnx.state(target)
    before = loss_jit(state.drafter(), target, *held_out.aligned(state.drafter().config, FINAL), **held_out.layout())
    compiled = drafter_update._cache_size()
    for _ in range(20):
        state, metrics = drafter_update(state, tparams, buf.sample_batch(rng, 8, SEQ, window=16))
    assert drafter_update._cache_size() == compiled + 1
    assert np.isfinite(float(metrics["loss"])) and float(metrics["positions"]) > 8 * (SEQ - 4)
    after = loss_jit(state.drafter(), target, *held_out.aligned(state.drafter().config, FINAL), **held_out.layout())
    assert float(after[0]) < 0.75 * float(before[0]), (float(before[0]), float(after[0]))


def test_loss_weights_feature_and_token_terms(target, sequences):
    """loss = feat_weight · reg + ce_weight · ce over the same sums; the defaults (1, 0.1) keep the old loss."""
    drafter = _drafter(7)
    inputs = make_batch(target, sequences[:8], SEQ, (FINAL,)).aligned()
    loss, _, sums = loss_jit(drafter, target, *inputs)
    np.testing.assert_allclose(float(loss), float(sums["reg"] + 0.1 * sums["ce"]), rtol=1e-6)
    loss2, _, sums2 = loss_jit(drafter, target, *inputs, feat_weight=0.25, ce_weight=2.0)
    np.testing.assert_allclose(float(loss2), float(0.25 * sums2["reg"] + 2.0 * sums2["ce"]), rtol=1e-6)
    assert float(sums2["reg"]) == float(sums["reg"])


def test_unrolled_training_time_test(target, sequences):
    """unroll_steps=1 is the plain loss bit for bit; k=2 adds a step on the drafter's own predictions.

    k=2 counts each position whose predecessor also counted once more, gives a different loss, and
    its gradient (taken through the fed-back predictions inside drafter_update) is finite and non-zero.
    """
    drafter = _drafter(8)
    buf, seqs = _harvest(target, sequences[:8], (FINAL,))
    packed = pack_windows(_whole(buf), 4, 2 * SEQ)
    inputs, layout = packed.aligned(drafter.config, FINAL), packed.layout()
    plain = jax.device_get(loss_jit(drafter, target, *inputs, **layout))
    one = jax.device_get(loss_jit(drafter, target, *inputs, unroll_steps=1, **layout))
    two = jax.device_get(loss_jit(drafter, target, *inputs, unroll_steps=2, **layout))
    np.testing.assert_array_equal(plain[0], one[0])
    assert all(np.array_equal(plain[2][k], one[2][k]) for k in plain[2])
    assert float(two[1]) == float(plain[1]) + sum(len(s) - 3 for s in seqs)
    step2 = float(two[0]) - float(plain[0])  # the second step's loss sum alone
    assert step2 > 0 and not np.isclose(step2 / (float(two[1]) - float(plain[1])), float(plain[0] / plain[1]))

    state = DrafterTrainState.create(drafter, target, TX, unroll_steps=2)
    state, metrics = drafter_update(state, nnx.state(target), packed)
    assert float(metrics["positions"]) == float(two[1])
    np.testing.assert_allclose(float(metrics["loss"]), float(two[0] / two[1]), rtol=1e-5)
    assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0


def test_data_parallel_update_equals_the_single_device_update(target, sequences):
    """drafter_update on a batch sharded over a 1-D mesh of 4 devices (state replicated) matches one device to ~1e-5."""
    devices = jax.devices()[:4]
    assert len(devices) == 4, "tests/conftest.py asks XLA for 8 CPU devices; this test needs 4 of them"
    mesh = jax.sharding.Mesh(np.asarray(devices), ("data",))
    buf, _ = _harvest(target, sequences, (FINAL,))
    batch = buf.sample_batch(np.random.default_rng(1), 8, SEQ, window=16)
    tx = optax.sgd(0.5)  # a plain step: parameter differences are gradient differences
    state = DrafterTrainState.create(_drafter(9), target, tx)
    tparams = nnx.state(target)
    one, m_one = jax.device_get(drafter_update(jax.tree.map(jnp.copy, state), tparams, batch))
    dp_state, dp_tparams, dp_batch = shard_for_update(mesh, jax.tree.map(jnp.copy, state), tparams, batch)
    assert dp_batch.ids.sharding.num_devices == 4 and dp_batch.ids.addressable_shards[0].data.shape == (2, SEQ)
    many, m_many = drafter_update(dp_state, dp_tparams, dp_batch)
    assert all(x.sharding.num_devices == 4 for x in jax.tree.leaves(many.params))  # replicated on the mesh
    many, m_many = jax.device_get((many, m_many))
    for k in m_one:
        np.testing.assert_allclose(m_many[k], m_one[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(_leaves(one.params), _leaves(many.params)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(state.params), _leaves(one.params)))
    with pytest.raises(ValueError, match="6 rows cannot be split over the 4 devices"):
        shard_for_update(mesh, state, tparams, buf.sample_batch(0, 6, SEQ))


def test_bad_harvested_training_settings_are_clear_errors(target, sequences):
    buf, _ = _harvest(target, sequences[:2], (FINAL,))
    packed = pack_windows(_whole(buf), 2, SEQ)
    with pytest.raises(ValueError, match=r"feature_layers \(1,\) do not include the final layer 2"):
        packed.aligned(DrafterConfig.for_target(CONFIG, (1,)), FINAL)
    with pytest.raises(ValueError, match="feat_weight must be >= 0.*unroll_steps must be an integer >= 1"):
        DrafterTrainState.create(_drafter(4), target, TX, feat_weight=-1.0, unroll_steps=0)


def test_drafter_settings_do_not_change_the_tiny_policy():
    """config.drafter is outside the tiny policy's cache key, and inside the drafter's."""
    a = load_config("configs/micro.py")
    b = load_config("configs/micro.py", ["--config.drafter.steps=7", "--config.drafter.seq_len=33",
                                         "--config.drafter.feature_layers=1,2"])
    assert tiny_policy.cache_key(a) == tiny_policy.cache_key(b)
    assert offline.cache_key(a, "p") != offline.cache_key(b, "p")


@pytest.mark.parametrize("override, field", [
    ("steps=0", "config.drafter.steps=0"),
    ("temperature=-1", "config.drafter.temperature=-1.0"),
    ("seq_len=1", "config.drafter.seq_len=1"),
    ("lr=0", "config.drafter.lr=0.0"),
])
def test_bad_config_values_exit_with_a_message(override, field, capsys, tmp_path):
    """The job refuses bad config.drafter values before any training, naming the field."""
    argv = ["--config=configs/micro.py", "--config.job=train_drafter", f"--config.cache_dir={tmp_path}",
            f"--config.drafter.{override}"]
    assert main.main(argv) == 2
    assert field in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was trained


# ----------------------------------------------------------------------------- the job on the micro tiny policy
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Runs ``train_drafter`` on configs/micro.py into a fresh cache; (cache dir, stdout, drafter dir, report)."""
    cache = tmp_path_factory.mktemp("cache")
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setenv("TLTJAX_CACHE", str(cache))
        assert main.main(["--config=configs/micro.py", "--config.job=train_drafter"]) == 0
    [out] = list((cache / "drafter").iterdir())
    return cache, stdout.getvalue(), out, json.loads((out / offline.REPORT).read_text())


@pytest.mark.slow
def test_job_raises_top1_agreement_on_the_policys_greedy_outputs(job):
    """Held-out top-1 agreement with the policy goes from chance to far above it; the loss falls.

    configs/micro.py: the micro tiny policy (30 SFT steps), 60 drafter steps on 48 greedy responses,
    16 held-out greedy responses (measured: about 2% before, about 80% after).
    """
    _, out, _, report = job
    before, after = report["before"], report["after"]
    assert before["top1"] < 0.1 and after["top1"] > max(0.6, 10 * before["top1"]), (before, after)
    assert after["loss"] < before["loss"]
    assert report["history"][-1]["loss"] < 0.75 * report["history"][0]["loss"]
    assert f"{before['top1']:.1%} before training, {after['top1']:.1%} after" in out


@pytest.mark.slow
def test_job_writes_a_drafter_that_loads_on_the_policy(job):
    cache, out, drafter_dir, report = job
    assert f"saved to {drafter_dir}" in out and not list(drafter_dir.parent.glob("*.tmp*"))
    cfg = load_config("configs/micro.py", [f"--config.cache_dir={cache}"])
    policy_dir = tiny_policy.get_tiny_policy(cfg, log=lambda *a: None)
    assert report["policy"] == str(policy_dir)
    policy, _ = tiny_policy.load_policy(policy_dir)
    drafter = load_drafter(drafter_dir, policy.config)
    assert drafter.config.feature_layers == (policy.config.num_hidden_layers,)


@pytest.mark.slow
def test_job_reuses_its_cached_drafter(job, monkeypatch, capsys):
    cache, _, out, _ = job
    monkeypatch.setenv("TLTJAX_CACHE", str(cache))
    assert main.main(["--config=configs/micro.py", "--config.job=train_drafter"]) == 0
    assert f"using the cached drafter at {out}" in capsys.readouterr().out


def test_feature_layers_that_do_not_fit_the_policy_are_config_errors():
    cfg = load_config("configs/micro.py", ["--config.drafter.feature_layers=1,9"])
    target = nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0)))
    with pytest.raises(ConfigError, match=r"config.drafter.feature_layers=\(1, 9\).*hidden layers 0..2"):
        offline.drafter_config(cfg, target)
