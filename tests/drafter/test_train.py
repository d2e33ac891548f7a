"""`tltjax.drafter.train` and the offline job: the drafter learns to agree with its target.

Unit tests of the loss and the update run on a tiny random target. Learning is
shown on the micro config's tiny policy (trained by SFT in seconds, cached in a
temporary dir for this module): on its own sampled outputs a trained drafter
agrees with the policy's argmax far more often than at init.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.random_init import fill
from tltjax.drafter import Drafter, DrafterConfig, load_drafter
from tltjax.drafter.train import (
    drafter_loss,
    evaluate,
    init_state,
    make_batch,
    make_optimizer,
    make_update,
    train_drafter,
)
from tltjax.models import CausalLM, ModelConfig
from tltjax.rollout.dense import generate
from tltjax.rollout.sampling import SamplingParams

CONFIG = ModelConfig(
    model_type="qwen2", vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True, max_position_embeddings=128,
)
SEQ = 40


@pytest.fixture(scope="module")
def target():
    return fill(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0))), 0, 0.3)


@pytest.fixture(scope="module")
def sequences(target):
    """The random target's greedy continuations of 32 random prompts (prompt + response)."""
    rng = np.random.RandomState(1)
    prompts = [list(rng.randint(0, 48, size=4)) for _ in range(32)]
    gens = generate(target, prompts, max_new_tokens=SEQ - 4, params=SamplingParams(0.0))
    return [p + g.tokens for p, g in zip(prompts, gens)]


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """(config, policy dir, cache dir) of the micro config's tiny policy, trained into a module-private cache."""
    from tltjax import tiny_policy
    from tltjax.config import load_config

    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TLTJAX_CACHE", str(cache))
        cfg = load_config("configs/micro.py")
        path = tiny_policy.get_tiny_policy(cfg, progress=False, log=lambda *a: None)
    return cfg, path, cache


@pytest.fixture(scope="module")
def trained(micro):
    from tltjax import data, tiny_policy

    cfg, path, _ = micro
    policy, tok = tiny_policy.load_policy(path)
    examples = tiny_policy.task_examples(cfg, 96, seed=5)
    prompts = data.encode_prompts([e.prompt for e in examples], tok)
    gens = generate(policy, prompts, max_new_tokens=64, params=SamplingParams(1.0), stop_ids=[tok.eos_id], seed=3)
    seqs = [p + g.tokens for p, g in zip(prompts, gens)]
    drafter = Drafter(DrafterConfig.for_target(policy.config), rngs=nnx.Rngs(0))
    before = evaluate(drafter, policy, seqs[:16], seq_len=96)
    history = train_drafter(drafter, policy, seqs[16:], steps=150, batch_size=16, seq_len=96, lr=3e-3,
                            progress=False, log_every=10)
    after = evaluate(drafter, policy, seqs[:16], seq_len=96)
    return drafter, before, after, history


def test_training_raises_top1_agreement_on_held_out_target_outputs(trained):
    """From near chance to well above it after 150 steps; the loss falls."""
    _, before, after, history = trained
    assert before["top1"] < 0.2, before
    assert after["top1"] > max(0.45, 3 * before["top1"]), after
    assert history[-1]["loss"] < 0.75 * history[0]["loss"]  # history[0] is already at step 10
    assert after["loss"] < before["loss"]


def test_update_compiles_once_and_leaves_the_target_alone(target, sequences):
    drafter = Drafter(DrafterConfig.for_target(CONFIG), rngs=nnx.Rngs(1))
    opt = make_optimizer(1e-3, 2, 10)
    update = make_update(drafter, target, opt)
    state = init_state(drafter, opt)
    tparams = nnx.state(target)
    snapshot = jax.tree.map(np.asarray, tparams)
    for i in range(4):
        batch = make_batch(target, sequences[4 * i : 4 * i + 8], SEQ, drafter.config.feature_layers)
        state, metrics = update(state, tparams, batch)
    assert update._cache_size() == 1
    assert int(state.step) == 4 and np.isfinite(float(metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, snapshot, jax.tree.map(np.asarray, nnx.state(target)))


def test_loss_sums_over_micro_batches_equal_the_full_batch(target, sequences):
    drafter = Drafter(DrafterConfig.for_target(CONFIG), rngs=nnx.Rngs(2))
    full = make_batch(target, sequences[:8], SEQ, drafter.config.feature_layers)
    halves = [make_batch(target, sequences[i : i + 4], SEQ, drafter.config.feature_layers) for i in (0, 4)]
    loss, count, m = drafter_loss(drafter, target, full)
    parts = [drafter_loss(drafter, target, h) for h in halves]
    np.testing.assert_allclose(float(loss), sum(float(p[0]) for p in parts), rtol=1e-5)
    assert float(count) == sum(float(p[1]) for p in parts)
    np.testing.assert_allclose(float(m["top1"]), sum(float(p[2]["top1"]) for p in parts), rtol=1e-6)


def test_padding_positions_do_not_count(target, sequences):
    drafter = Drafter(DrafterConfig.for_target(CONFIG), rngs=nnx.Rngs(3))
    short = [s[:10] for s in sequences[:4]]
    b = make_batch(target, short, SEQ, drafter.config.feature_layers)
    _, count, _ = drafter_loss(drafter, target, b)
    assert float(count) == 4 * 9  # 10 tokens: pairs (f_t, x_{t+1}) with h_{t+1} known, t = 0..8


def test_bad_training_arguments_are_clear_errors(target, sequences):
    drafter = Drafter(DrafterConfig.for_target(CONFIG), rngs=nnx.Rngs(4))
    with pytest.raises(ValueError, match="steps"):
        train_drafter(drafter, target, sequences, steps=0, batch_size=4, seq_len=SEQ, lr=1e-3, progress=False)


@pytest.mark.slow
def test_train_drafter_job_on_the_micro_config(micro, monkeypatch, capsys):
    """The job trains the micro policy's drafter, saves it loadably, and reports agreement before/after."""
    from tltjax import main, tiny_policy

    _, path, cache = micro
    monkeypatch.setenv("TLTJAX_CACHE", str(cache))
    assert main.main(["--config=configs/micro.py", "--config.job=train_drafter"]) == 0
    out = capsys.readouterr().out
    assert "top-1 agreement" in out
    [drafter_dir] = list((cache / "drafter").iterdir())
    report = json.loads((drafter_dir / "tltjax_drafter_train.json").read_text())
    assert report["after"]["top1"] > report["before"]["top1"] + 0.1
    policy, _ = tiny_policy.load_policy(path)
    drafter = load_drafter(drafter_dir, policy.config)
    assert drafter.config.hidden_size == policy.config.hidden_size
