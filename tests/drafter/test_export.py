"""EAGLE-1 export: layout, round trip, parity with an independent torch EAGLE-1 forward, refusals, bad files."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file
from safetensors.torch import load_file as load_torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tests.random_init import random_module
from tltjax.drafter import Drafter, DrafterConfig, drafter_forward, pair_inputs, save_drafter
from tltjax.drafter.export import RUNTIMES, export_eagle, import_eagle, main
from tltjax.models import CausalLM, CheckpointError, ModelConfig, forward, save_pretrained
from tltjax.models.config import RopeScaling

TARGETS = {
    # Qwen2-style: q/k/v biases, tied embedding.
    "qwen2": ModelConfig(
        model_type="qwen2", vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True, tie_word_embeddings=True,
    ),
    # Llama 3-style: no attention bias, untied head, llama3 RoPE scaling, head_dim != hidden / heads.
    "llama": ModelConfig(
        model_type="llama", vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16), max_position_embeddings=4096,
    ),
}
LAYER = {
    "layers.0.self_attn.q_proj.weight": lambda c: (c.num_attention_heads * c.head_dim, c.hidden_size),
    "layers.0.self_attn.k_proj.weight": lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
    "layers.0.self_attn.v_proj.weight": lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
    "layers.0.self_attn.o_proj.weight": lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim),
    "layers.0.self_attn.q_proj.bias": lambda c: (c.num_attention_heads * c.head_dim,),
    "layers.0.self_attn.k_proj.bias": lambda c: (c.num_key_value_heads * c.head_dim,),
    "layers.0.self_attn.v_proj.bias": lambda c: (c.num_key_value_heads * c.head_dim,),
    "layers.0.self_attn.o_proj.bias": lambda c: (c.hidden_size,),
    "layers.0.mlp.gate_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "layers.0.mlp.up_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "layers.0.mlp.down_proj.weight": lambda c: (c.hidden_size, c.intermediate_size),
    "layers.0.post_attention_layernorm.weight": lambda c: (c.hidden_size,),
    "fc.weight": lambda c: (c.hidden_size, 2 * c.hidden_size),
}


def _target(family):
    return random_module(CausalLM, TARGETS[family], 0, 0.1)


def _drafter(family, seed=1, **kw):
    """A tiny EAGLE-1 drafter with every parameter random (fc and q/k/v biases included)."""
    return random_module(Drafter, DrafterConfig.for_target(TARGETS[family], input_norm=False, **kw), seed, 0.1)


def _inputs(target, batch=2, seq=11, seed=0):
    cfg = target.config
    ids = jnp.asarray(np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, seq)))
    feats = forward(target, ids, hidden_layers=(cfg.num_hidden_layers,)).hidden_states[0]
    return pair_inputs(ids, feats)


def _params(module):
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


@pytest.mark.parametrize("family", sorted(TARGETS))
@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_round_trip(family, runtime, tmp_path):
    """export_eagle → import_eagle restores the drafter's config and parameters and its outputs (1e-5).

    Everything but the q/k/v biases is bit for bit; those carry the folded fc bias
    and come back within float32 rounding of ``W·b`` (exactly, when the drafter has none).
    """
    target, drafter = _target(family), _drafter(family)
    export_eagle(drafter, target.config, tmp_path, runtime=runtime)
    back = import_eagle(tmp_path, target.config)
    assert back.config == drafter.config
    a, b = _params(drafter), _params(back)
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            np.testing.assert_allclose(b[name], a[name], atol=1e-6, rtol=0, err_msg=name)
        else:
            np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    tok, feat = _inputs(target)
    want, got = drafter_forward(drafter, target, tok, feat), drafter_forward(back, target, tok, feat)
    np.testing.assert_allclose(np.asarray(got.hidden), np.asarray(want.hidden), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_layout(family, tmp_path):
    """The files hold exactly the EAGLE-1 tensors with their shapes, and config.json what the engines read.

    No ``layers.0.input_layernorm.weight`` (the drafter has none); q/k/v/o biases always
    (the fc bias is folded into them); ``fc.bias`` only for SGLang, as zeros;
    ``embed_tokens.weight`` only when asked for, equal to the target's.
    """
    target, drafter = _target(family), _drafter(family)
    tc = target.config
    assert not any("input_layernorm" in name for name in _params(drafter))
    layer = {name: shape(tc) for name, shape in LAYER.items()}
    for runtime, extra in (("sglang", {"fc.bias": (tc.hidden_size,)}), ("vllm", {})):
        out = export_eagle(drafter, tc, tmp_path / runtime, runtime=runtime)
        tensors = load_file(out / "model.safetensors")
        assert {k: v.shape for k, v in tensors.items()} == {**layer, **extra}
        assert all(v.dtype == np.float32 for v in tensors.values())
        if "fc.bias" in tensors:
            np.testing.assert_array_equal(tensors["fc.bias"], 0)
        np.testing.assert_array_equal(tensors["fc.weight"], np.asarray(drafter.fc.weight[...]))
        np.testing.assert_array_equal(tensors["layers.0.self_attn.o_proj.bias"], np.asarray(drafter.fc.bias[...]))
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == [RUNTIMES[runtime].architecture]
        expect = dict(
            model_type="llama", num_hidden_layers=1, hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size, num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim, vocab_size=tc.vocab_size,
            rope_theta=tc.rope_theta, rms_norm_eps=tc.rms_norm_eps, hidden_act="silu",
            max_position_embeddings=tc.max_position_embeddings, tie_word_embeddings=tc.tie_word_embeddings,
            attention_bias=True, mlp_bias=False, torch_dtype="float32",
        )
        assert {k: cfg[k] for k in expect} == expect
        assert ("rope_scaling" in cfg) == (tc.rope_scaling.kind == "llama3")

    out = export_eagle(drafter, tc, tmp_path / "emb", runtime="vllm", dtype="bfloat16", embedding_from=target)
    tensors = load_torch(out / "model.safetensors")
    assert set(tensors) == set(layer) | {"embed_tokens.weight"}
    assert all(v.dtype == torch.bfloat16 for v in tensors.values())
    np.testing.assert_array_equal(
        tensors["embed_tokens.weight"].float().numpy(),
        np.asarray(target.model.embed_tokens.weight[...].astype(jnp.bfloat16).astype(jnp.float32)),
    )
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _torch_eagle1(out_dir, tok, feat, target):
    """EAGLE-1 draft forward from the exported files alone, as the engines define it, in torch.

    fc over concat(embedding, feature) (with ``fc.bias`` when the file has one), then one
    ``transformers`` Llama decoder layer built from config.json whose input norm is the
    identity, then the target's LM head.
    """
    w = load_torch(out_dir / "model.safetensors")
    config = transformers.LlamaConfig.from_pretrained(out_dir)
    config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}, strict=True)
    emb = w["embed_tokens.weight"][torch.tensor(np.asarray(tok))]
    z = torch.cat([emb, torch.tensor(np.asarray(feat))], -1)
    x = torch.nn.functional.linear(z, w["fc.weight"], w.get("fc.bias"))
    b, t = tok.shape
    pos = torch.arange(t)[None].expand(b, t)
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None].expand(b, 1, t, t)
    with torch.no_grad():
        h = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=LlamaRotaryEmbedding(config)(x, pos))
        h = h[0] if isinstance(h, tuple) else h
    head = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    return h.numpy(), h.numpy() @ np.asarray(head[...]).T


@pytest.mark.parametrize("family", sorted(TARGETS))
@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_parity_with_torch_eagle1(family, runtime, tmp_path):
    """An independent torch EAGLE-1 forward over the exported files matches `Drafter` to 1e-5 (float32).

    The reference reads only config.json and model.safetensors (the embedding
    included) and builds the layer with ``transformers``: what SGLang and vLLM
    compute for an EAGLE-1 draft, so the export is the drafter under their loaders.
    """
    target, drafter = _target(family), _drafter(family)
    export_eagle(drafter, target.config, tmp_path, runtime=runtime, embedding_from=target)
    tok, feat = _inputs(target, seed=3)
    hidden, logits = _torch_eagle1(tmp_path, tok, feat, target)
    ours = drafter_forward(drafter, target, tok, feat)
    assert np.abs(np.asarray(ours.hidden)).max() > 0.1  # not a trivially small output
    np.testing.assert_allclose(hidden, np.asarray(ours.hidden), atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits, np.asarray(ours.logits), atol=1e-5, rtol=0)


def test_reads_unfolded_checkpoint(tmp_path):
    """A checkpoint in the engines' plain form (real ``fc.bias``, no attention biases) imports exactly."""
    target, drafter = _target("llama"), _drafter("llama")
    export_eagle(drafter, target.config, tmp_path, runtime="sglang")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["attention_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(tmp_path / "model.safetensors").items() if not k.endswith("proj.bias")}
    tensors["fc.bias"] = np.asarray(drafter.fc.bias[...])
    save_file(tensors, tmp_path / "model.safetensors")
    back = import_eagle(tmp_path, target.config)
    a, b = _params(drafter), _params(back)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


def test_refuses_inexact_drafters(tmp_path):
    """Drafters no EAGLE-1 engine runs exactly are refused with the reason and the fix.

    An input RMSNorm (the engines drop it), several feature layers (EAGLE-3),
    q/k norms (Qwen3-style), and an unknown runtime.
    """
    tc = TARGETS["qwen2"]
    cases = [
        (DrafterConfig.for_target(tc), r"input RMSNorm.*input_norm=False"),
        (DrafterConfig.for_target(tc, feature_layers=(1, 2), input_norm=False), r"\(1, 2\).*EAGLE-3"),
        (DrafterConfig.for_target(tc, input_norm=False, qk_norm=True), r"qk_norm=True"),
    ]
    for cfg, msg in cases:
        with pytest.raises(ValueError, match=msg):
            export_eagle(nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(0))), tc, tmp_path, runtime="sglang")
    with pytest.raises(ValueError, match=r"runtime 'tgi'.*\['sglang', 'vllm'\]"):
        export_eagle(_drafter("qwen2"), tc, tmp_path, runtime="tgi")
    assert not (tmp_path / "model.safetensors").exists()


def test_bad_checkpoint_names_the_tensor(tmp_path):
    """A wrong-shaped, missing or unexpected tensor, or another target's vocabulary, is a CheckpointError
    naming the tensor (or value) and what was expected."""
    target, drafter = _target("qwen2"), _drafter("qwen2")
    tc = target.config
    export_eagle(drafter, tc, tmp_path, runtime="sglang")
    good = load_file(tmp_path / "model.safetensors")

    def write(tensors):
        save_file(tensors, tmp_path / "model.safetensors")

    name = "layers.0.self_attn.k_proj.weight"
    write({**good, name: np.zeros((8, 32), np.float32)})
    with pytest.raises(CheckpointError, match=rf"tensor {name} has shape \(8, 32\), config.json expects \(16, 32\)"):
        import_eagle(tmp_path, tc)
    write({k: v for k, v in good.items() if k != "layers.0.mlp.up_proj.weight"})
    with pytest.raises(CheckpointError, match=r"lacks tensor layers\.0\.mlp\.up_proj\.weight \(shape \(64, 32\)"):
        import_eagle(tmp_path, tc)
    write({**good, "layers.0.input_layernorm.weight": np.ones(32, np.float32)})
    with pytest.raises(CheckpointError, match=r"input_layernorm\.weight.*drop layer 0's input norm"):
        import_eagle(tmp_path, tc)
    write(good)
    with pytest.raises(CheckpointError, match=r"vocab_size 61 != target vocab_size 99"):
        import_eagle(tmp_path, tc.replace(vocab_size=99))
    with pytest.raises(CheckpointError, match=r"hidden_size 32 != target hidden_size 48"):
        import_eagle(tmp_path, tc.replace(hidden_size=48))


def test_cli(tmp_path):
    """``python -m tltjax.drafter.export`` turns a saved drafter and policy into a draft model that imports back."""
    target, drafter = _target("qwen2"), _drafter("qwen2")
    save_drafter(drafter, tmp_path / "drafter")
    save_pretrained(target, tmp_path / "policy")
    main(["--drafter", str(tmp_path / "drafter"), "--target", str(tmp_path / "policy"), "--out",
          str(tmp_path / "eagle"), "--runtime", "vllm", "--with-embedding"])
    assert "embed_tokens.weight" in load_file(tmp_path / "eagle" / "model.safetensors")
    back = import_eagle(tmp_path / "eagle", target.config)
    np.testing.assert_array_equal(np.asarray(back.fc.weight[...]), np.asarray(drafter.fc.weight[...]))
