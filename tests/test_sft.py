"""SFT: the packed loss is exact, the step learns, and the tiny policy is deterministic and cached."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tltjax import data, sft, tiny_policy
from tltjax.config import load_config
from tltjax.models import CausalLM, ModelConfig
from tltjax.models.tokenizer import char_tokenizer
from tltjax.rl import tasks


@pytest.fixture(scope="module")
def setup():
    task = tasks.get_task("longtail_arith")
    tok = char_tokenizer(task.alphabet)
    cfg = ModelConfig(
        model_type="qwen2", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, attention_bias=True, tie_word_embeddings=True,
    )
    return task, tok, cfg


def test_packed_loss_equals_separate_rows(setup):
    """Packing examples into one row with segment ids gives the same loss sum and count as padding them apart."""
    task, tok, cfg = setup
    model = CausalLM(cfg, rngs=nnx.Rngs(1))
    ex = task.generate(6, seed=3)
    packed = next(iter(data.PackedSFTBatches(ex, tok, batch_size=1, seq_len=512, seed=0)))
    assert packed["segment_ids"].max() == 6
    padded = next(iter(data.sft_batches(ex, tok, batch_size=6, seq_len=256, seed=0)))
    s1, c1 = jax.jit(sft.next_token_loss)(model, *(jnp.asarray(packed[k]) for k in
                                                   ("tokens", "loss_mask", "segment_ids", "positions")))
    s2, c2 = jax.jit(sft.next_token_loss)(model, jnp.asarray(padded["tokens"]), jnp.asarray(padded["loss_mask"]))
    assert float(c1) == float(c2) > 0
    np.testing.assert_allclose(float(s1), float(s2), rtol=1e-5)


def test_packed_loss_detects_leaks_across_segments(setup):
    """Without the segment mask the packed loss differs: the exactness test above can fail."""
    task, tok, cfg = setup
    model = CausalLM(cfg, rngs=nnx.Rngs(1))
    packed = next(iter(data.PackedSFTBatches(task.generate(6, seed=3), tok, batch_size=1, seq_len=512, seed=0)))
    args = [jnp.asarray(packed[k]) for k in ("tokens", "loss_mask", "segment_ids", "positions")]
    s1, _ = sft.next_token_loss(model, *args)
    s2, _ = sft.next_token_loss(model, args[0], args[1])
    assert abs(float(s1) - float(s2)) > 1e-3


def test_sft_step_reduces_loss(setup):
    """Thirty steps on a fixed batch drive its loss well down (the step really optimises)."""
    task, tok, cfg = setup
    state = sft.TrainState.create(CausalLM(cfg, rngs=nnx.Rngs(0)), sft.make_optimizer(1e-2, 30, 3))
    batch = next(iter(data.PackedSFTBatches(task.generate(64, seed=1), tok, 4, 256, seed=0)))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    losses = []
    for _ in range(30):
        state, m = sft.sft_step(state, batch)
        losses.append(float(m["loss"]))
    assert int(state.step) == 30
    assert losses[-1] < 0.6 * losses[0]


def test_tiny_policy_is_deterministic_cached_and_loadable(tmp_path):
    """Same config and seed → byte-identical weights; the second call reuses the cache; it loads and generates."""
    overrides = [f"--config.cache_dir={tmp_path / 'a'}", "--config.sft.steps=6", "--config.task.num_train=128"]
    cfg_a = load_config("configs/micro.py", overrides)
    cfg_b = load_config("configs/micro.py", [f"--config.cache_dir={tmp_path / 'b'}", *overrides[1:]])
    logs = []
    pa = tiny_policy.get_tiny_policy(cfg_a, progress=False, log=logs.append)
    pb = tiny_policy.get_tiny_policy(cfg_b, progress=False, log=logs.append)
    assert (pa / "model.safetensors").read_bytes() == (pb / "model.safetensors").read_bytes()
    again = tiny_policy.get_tiny_policy(cfg_a, progress=False, log=logs.append)
    assert again == pa and any("cached" in line for line in logs)
    assert not list(pa.parent.glob("*.tmp*"))
    info = json.loads((pa / "tltjax_sft.json").read_text())
    assert info["steps"] == 6 and info["params"] > 0
    model, tok = tiny_policy.load_policy(pa)
    task = tasks.get_task(cfg_a.task.name)
    acc, texts = tiny_policy.accuracy(model, tok, task.generate(4, seed=9), task, max_new_tokens=8)
    assert 0.0 <= acc <= 1.0 and len(texts) == 4
    cfg_c = load_config("configs/micro.py", [*overrides, "--config.seed=1"])
    assert tiny_policy.cache_key(cfg_c) != tiny_policy.cache_key(cfg_a)
