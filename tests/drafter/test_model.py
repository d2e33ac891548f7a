"""The EAGLE-style drafter: alignment, causality, cached drafting, live target weights, save/load."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tltjax.drafter import Drafter, DrafterConfig, drafter_forward, load_drafter, pair_inputs, save_drafter
from tltjax.models import CausalLM, CheckpointError, ContiguousKVCache, ModelConfig, forward

TARGET = ModelConfig(
    model_type="qwen2",
    vocab_size=61,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    attention_bias=True,
    tie_word_embeddings=True,
)
L = TARGET.num_hidden_layers


@pytest.fixture(scope="module")
def target():
    return CausalLM(TARGET, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def drafter():
    return Drafter(DrafterConfig.for_target(TARGET), rngs=nnx.Rngs(1))


def _ids(shape, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, TARGET.vocab_size, shape))


def _inputs(target, ids, layers=(L,)):
    """Drafter inputs for ``ids``: tokens x_1.. and the concatenated target features f_0.."""
    hs = forward(target, ids, hidden_layers=layers).hidden_states
    return pair_inputs(ids, jnp.concatenate(hs, -1))


def test_shapes_and_alignment(target, drafter):
    """Features of positions 0..T-1 with tokens 1..T give T outputs; output t sees only tokens ≤ t+1, features ≤ t.

    Perturbing the inputs at drafter positions ≥ k (token x_{k+1}.., feature f_k..)
    leaves outputs < k bit-identical and changes output k; the token and the
    feature at k each reach output k on their own.
    """
    ids = _ids((2, 13))
    tok, feat = _inputs(target, ids)
    full = forward(target, ids, hidden_layers=(L,)).hidden_states[0]
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ids[:, 1:]))  # x_{t+1} at t
    np.testing.assert_array_equal(np.asarray(feat), np.asarray(full[:, :-1]))  # f_t at t
    out = drafter_forward(drafter, target, tok, feat)
    assert out.hidden.shape == (2, 12, TARGET.hidden_size)
    assert out.logits.shape == (2, 12, TARGET.vocab_size) and out.logits.dtype == jnp.float32
    assert out.cache is None

    key = jax.random.PRNGKey(0)
    for k in (0, 5, 11):
        tok2 = tok.at[:, k:].set((tok[:, k:] + 7) % TARGET.vocab_size)
        feat2 = feat.at[:, k:].add(jax.random.normal(key, feat[:, k:].shape))
        for t2, f2 in ((tok2, feat2), (tok2, feat), (tok, feat2)):
            o2 = drafter_forward(drafter, target, t2, f2)
            np.testing.assert_array_equal(np.asarray(o2.hidden[:, :k]), np.asarray(out.hidden[:, :k]))
            np.testing.assert_array_equal(np.asarray(o2.logits[:, :k]), np.asarray(out.logits[:, :k]))
            assert np.abs(np.asarray(o2.logits[:, k] - out.logits[:, k])).max() > 1e-5


def test_cached_drafting_equals_full_forward(target, drafter):
    """Prefilling 5 positions then drafting one at a time through the drafter's cache equals the full pass (1e-5)."""
    tok, feat = _inputs(target, _ids((2, 13), seed=1))
    full = drafter_forward(drafter, target, tok, feat)
    cache = ContiguousKVCache.init(drafter.config.layer_config, 2, 16)
    assert cache.k.shape[0] == 1  # one layer of its own
    out = drafter_forward(drafter, target, tok[:, :5], feat[:, :5], cache=cache)
    hidden, logits, cache = [out.hidden], [out.logits], out.cache
    for t in range(5, 12):
        out = drafter_forward(drafter, target, tok[:, t : t + 1], feat[:, t : t + 1], cache=cache)
        hidden.append(out.hidden)
        logits.append(out.logits)
        cache = out.cache
    assert cache.lengths.tolist() == [12, 12]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(hidden, 1)), np.asarray(full.hidden), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(logits, 1)), np.asarray(full.logits), atol=1e-5, rtol=0)


def test_reads_live_target_embedding_and_head(target, drafter):
    """The drafter holds no vocabulary-sized tensor and follows the target's embedding and LM head as they change.

    Tied target: scaling the embedding changes both the drafter's hidden states
    and logits. Untied target: changing only ``lm_head`` changes the logits by
    exactly the new head applied to unchanged hidden states. The drafter is never touched.
    """
    for _, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(drafter)):
        assert TARGET.vocab_size not in leaf.shape
    tok, feat = _inputs(target, _ids((1, 9), seed=2))
    before = drafter_forward(drafter, target, tok, feat)
    moved = nnx.clone(target)
    w = moved.model.embed_tokens.weight
    w.set_value(w[...] * 1.5 + 0.01)
    after = drafter_forward(drafter, moved, tok, feat)
    assert np.abs(np.asarray(after.hidden - before.hidden)).max() > 1e-4
    assert np.abs(np.asarray(after.logits - before.logits)).max() > 1e-3

    untied = CausalLM(TARGET.replace(tie_word_embeddings=False), rngs=nnx.Rngs(3))
    before = drafter_forward(drafter, untied, tok, feat)
    head = untied.lm_head.weight
    head.set_value(-head[...])
    after = drafter_forward(drafter, untied, tok, feat)
    np.testing.assert_array_equal(np.asarray(after.hidden), np.asarray(before.hidden))
    np.testing.assert_allclose(np.asarray(after.logits), -np.asarray(before.logits), atol=1e-6, rtol=0)


def test_multi_layer_features(target):
    """EAGLE-3 style: features of layers (1, 2) concatenate to width 2·hidden, and fc maps 3·hidden → hidden.

    Features of the wrong width, and layers the target lacks, are clear errors.
    """
    cfg = DrafterConfig.for_target(TARGET, feature_layers=(1, 2))
    assert cfg.feature_size == 2 * TARGET.hidden_size
    d = Drafter(cfg, rngs=nnx.Rngs(4))
    assert d.fc.weight.shape == (TARGET.hidden_size, 3 * TARGET.hidden_size)
    tok, feat = _inputs(target, _ids((2, 10), seed=4), layers=(1, 2))
    out = drafter_forward(d, target, tok, feat)
    assert out.hidden.shape == (2, 9, TARGET.hidden_size) and out.logits.shape == (2, 9, TARGET.vocab_size)
    assert np.isfinite(np.asarray(out.logits)).all()
    with pytest.raises(ValueError, match=r"features have shape \(2, 9, 32\), expected \(2, 9, 64\)"):
        d(target, tok, feat[..., :32])
    with pytest.raises(ValueError, match=r"include \[3\].*0\.\.2"):
        DrafterConfig.for_target(TARGET, feature_layers=(1, 3))


def test_save_load_round_trip(target, drafter, tmp_path):
    """save_drafter → load_drafter restores the config and every tensor bit for bit; a target of another
    hidden size is refused with both sizes named."""
    save_drafter(drafter, tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    loaded = load_drafter(tmp_path, TARGET)
    assert loaded.config == drafter.config
    a = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(drafter, nnx.Param))}
    b = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(loaded, nnx.Param))}
    assert "fc/weight" in a and "layers/0/self_attn/q_proj/weight" in a and a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name][...]), np.asarray(b[name][...]), err_msg=name)
    wide = TARGET.replace(hidden_size=48)
    with pytest.raises(CheckpointError, match=r"drafter hidden_size 32 != target hidden_size 48"):
        load_drafter(tmp_path, wide)
