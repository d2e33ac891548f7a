"""`tltjax.drafter.train` and the offline ``train_drafter`` job (`tltjax.drafter.offline`).

Properties of the loss and the update are shown on a tiny random target with
random variable-length sequences; every test here shares one optimiser, so
`drafter_update` compiles once for the module. Learning is shown on the micro
config's tiny policy (trained by SFT in seconds into a module-private cache),
by running the job through `tltjax.main` once and reading what it measured.
"""

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.random_init import fill, random_module
from tltjax import main, sft, tiny_policy
from tltjax.config import ConfigError, load_config
from tltjax.drafter import (
    Drafter,
    DrafterConfig,
    DrafterTrainState,
    drafter_loss,
    drafter_update,
    load_drafter,
    make_batch,
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
loss_jit = nnx.jit(drafter_loss, static_argnames=("ce_weight",))


@pytest.fixture(scope="module")
def target():
    return fill(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0))), 0, 0.3)


@pytest.fixture(scope="module")
def sequences():
    """24 random token sequences of 3..40 tokens (so some rows are padded and some cut at SEQ)."""
    rng = np.random.RandomState(1)
    return [list(rng.randint(0, CONFIG.vocab_size, size=rng.randint(3, 41))) for _ in range(24)]


def _drafter(seed):
    return random_module(Drafter, DrafterConfig.for_target(CONFIG), seed, 0.1)


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
