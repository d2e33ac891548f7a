"""Hugging Face checkpoint I/O (`tltjax.models.hf`): exact round trips, HF compatibility, lazy reads, errors."""

import json
import re
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import torch
import transformers

from tltjax import sharding as shd
from tltjax.models import CheckpointError, ModelConfig, UnsupportedModelError, from_pretrained, save_pretrained
from tltjax.models import hf


def _tensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory (single file or sharded), read into host memory."""
    ckpt = hf.Checkpoint(path)
    return {name: np.array(ckpt.get(name)) for name in ckpt.keys()}


def _assert_same_tensors(a: dict[str, np.ndarray], b: dict[str, np.ndarray]):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


def _torch_logits(model, seed=0):
    ids = torch.tensor(np.random.RandomState(seed).randint(0, 97, (2, 13)))
    with torch.no_grad():
        return model(ids).logits.numpy()


def _hf_load(path):
    """`transformers` loads ``path`` with no missing, unexpected or mismatched tensors."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def saved(hf_model, tmp_path_factory):
    """(family, torch model, HF dir, our f32 save of it, our bf16 save of it)."""
    family, ref, path = hf_model
    root = tmp_path_factory.mktemp(f"ours_{family}")
    save_pretrained(from_pretrained(path, dtype="float32"), root / "f32")
    save_pretrained(from_pretrained(path, dtype="bfloat16"), root / "bf16")
    return family, ref, path, root / "f32", root / "bf16"


# ----------------------------------------------------------------------------- exact round trips
def test_load_equals_torch_state_dict_exactly(saved):
    """Every parameter we load from a transformers-saved directory equals the torch tensor bit for bit."""
    _, ref, path, _, _ = saved
    model = from_pretrained(path, dtype="float32")
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}
    params = hf.param_paths(model)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(params) == set(sd) - tied
    for name, var in params.items():
        np.testing.assert_array_equal(np.asarray(var[...]), sd[name], err_msg=name)


def test_f32_save_load_save_is_byte_identical(saved, tmp_path):
    """f32: our save reproduces transformers' tensors, and load → save again changes no byte."""
    _, _, path, f32, _ = saved
    first = _tensors(f32)
    _assert_same_tensors(first, _tensors(path))
    save_pretrained(from_pretrained(f32), tmp_path / "again")
    _assert_same_tensors(first, _tensors(tmp_path / "again"))
    assert (f32 / "model.safetensors").read_bytes() == (tmp_path / "again" / "model.safetensors").read_bytes()


def test_bf16_save_load_save_is_byte_identical(saved, tmp_path):
    """bf16: we round f32 → bf16 exactly as torch does, and a bf16 checkpoint reloads in bf16 and re-saves unchanged."""
    _, ref, _, _, bf16 = saved
    first = _tensors(bf16)
    sd = {k: v.to(torch.bfloat16).view(torch.int16).numpy() for k, v in ref.state_dict().items()}
    for name, a in first.items():
        assert a.dtype == np.dtype(ml_dtypes.bfloat16), name
        np.testing.assert_array_equal(a.view(np.int16), sd[name], err_msg=name)
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reloaded = from_pretrained(bf16)  # dtype taken from config.json
    assert reloaded.config.param_dtype == reloaded.config.dtype == "bfloat16"
    save_pretrained(reloaded, tmp_path / "again")
    _assert_same_tensors(first, _tensors(tmp_path / "again"))
    assert (bf16 / "model.safetensors").read_bytes() == (tmp_path / "again" / "model.safetensors").read_bytes()


# ----------------------------------------------------------------------------- HF compatibility
def test_transformers_loads_our_save_with_identical_logits(saved):
    """Our config.json + safetensors are genuine HF format: transformers rebuilds the model, logits match to 1e-5."""
    _, ref, _, f32, _ = saved
    theirs = _hf_load(f32)
    assert type(theirs) is type(ref)
    np.testing.assert_allclose(_torch_logits(theirs), _torch_logits(ref), atol=1e-5, rtol=0)


def test_safetensors_library_reads_our_files(saved):
    """The reference `safetensors` reader parses our f32 and bf16 files and sees the same values."""
    _, _, _, f32, bf16 = saved
    for d in (f32, bf16):
        ours = _tensors(d)
        with safetensors.safe_open(str(d / "model.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == sorted(ours)
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                t = f.get_tensor(name)
                assert tuple(t.shape) == ours[name].shape
                np.testing.assert_array_equal(t.float().numpy(), ours[name].astype(np.float32), err_msg=name)


def test_sharded_checkpoint_layout_and_round_trip(saved, tmp_path):
    """Above max_shard_bytes the weights split into HF-named shards plus an index; both we and transformers load them."""
    _, ref, _, f32, _ = saved
    model = from_pretrained(f32)
    total = sum(a.nbytes for a in _tensors(f32).values())
    limit = total // 4
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"stale")  # a previous single-file save is removed
    save_pretrained(model, out, max_shard_bytes=limit)

    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n >= 4
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    for fname in files:
        part = hf.SafetensorsFile(out / fname)
        assert sorted(part.keys()) == sorted(k for k, v in index["weight_map"].items() if v == fname)
        sizes = [np.array(part.get(k)).nbytes for k in part.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1

    _assert_same_tensors(_tensors(out), _tensors(f32))
    reloaded = from_pretrained(out)
    for name, var in hf.param_paths(reloaded).items():
        np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(hf.param_paths(model)[name][...]), err_msg=name)
    np.testing.assert_allclose(_torch_logits(_hf_load(out)), _torch_logits(ref), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- lazy loading
class _Recorder:
    """Stands in for a memory-mapped tensor and records what is read: index slices, or the whole array."""

    def __init__(self, name, array, log):
        self.name, self._a, self._log = name, array, log
        self.shape, self.dtype, self.ndim = array.shape, array.dtype, array.ndim

    def __getitem__(self, idx):
        self._log.append((self.name, self._a[idx].shape))
        return self._a[idx]

    def __array__(self, dtype=None, copy=None):
        self._log.append((self.name, "whole"))
        return np.asarray(self._a, dtype)


@pytest.fixture
def read_log(monkeypatch):
    log = []
    get = hf.SafetensorsFile.get
    monkeypatch.setattr(hf.SafetensorsFile, "get", lambda self, name: _Recorder(name, get(self, name), log))
    return log


def test_loading_onto_mesh_reads_only_device_slices(hf_model, read_log):
    """With a mesh, every host read is one device's shard of a tensor (never the whole tensor), and values are exact."""
    _, ref, path = hf_model
    mesh = shd.make_mesh({"fsdp": 2, "tensor": 4})
    model = from_pretrained(path, dtype="float32", mesh=mesh)
    assert read_log and all(shape != "whole" for _, shape in read_log)
    params = hf.param_paths(model)
    sd = ref.state_dict()
    for name, var in params.items():
        arr = var[...]
        want = arr.sharding.shard_shape(arr.shape)
        reads = [s for n, s in read_log if n == name]
        assert reads and all(s == want for s in reads), (name, reads, want)
        np.testing.assert_array_equal(np.asarray(arr), sd[name].numpy(), err_msg=name)
    # The big matrices are read an eighth at a time.
    q = params["model.layers.0.self_attn.q_proj.weight"][...]
    assert q.sharding.shard_shape(q.shape) == (q.shape[0] // 4, q.shape[1] // 2)


def test_recorder_sees_whole_tensor_reads_without_mesh(hf_model, read_log):
    """Control for the test above: loading without a mesh does read whole tensors, and the recorder sees it."""
    _, _, path = hf_model
    from_pretrained(path, dtype="float32")
    assert read_log and all(shape == "whole" for _, shape in read_log)


# ----------------------------------------------------------------------------- errors
def _copy_without_weights(src, dst):
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_missing_tensor_is_named(hf_model, tmp_path):
    """A checkpoint lacking a parameter raises CheckpointError naming it."""
    _, _, path = hf_model
    tensors = _tensors(path)
    gone = "model.layers.1.post_attention_layernorm.weight"
    del tensors[gone]
    d = _copy_without_weights(path, tmp_path / "m")
    hf.save_safetensors(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape(gone)):
        from_pretrained(d)


def test_unexpected_tensor_is_named(hf_model, tmp_path):
    """A checkpoint tensor the config has no place for raises CheckpointError naming it."""
    _, _, path = hf_model
    tensors = _tensors(path)
    extra = "model.layers.2.mlp.up_proj.weight"  # the config has 2 layers
    tensors[extra] = tensors["model.layers.1.mlp.up_proj.weight"]
    d = _copy_without_weights(path, tmp_path / "m")
    hf.save_safetensors(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape(extra)):
        from_pretrained(d)


def test_shape_mismatch_names_tensor_and_both_shapes(hf_model, tmp_path):
    """config.json disagreeing with a tensor's shape names the tensor, its shape and the expected one."""
    _, _, path = hf_model
    d = tmp_path / "m"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["intermediate_size"] == 96 and cfg["hidden_size"] == 64
    cfg["intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        from_pretrained(d)
    msg = str(e.value)
    m = re.search(r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight", msg)
    assert m, msg
    shapes = ("(64, 96)", "(64, 128)") if m.group(1) == "down" else ("(96, 64)", "(128, 64)")
    assert all(s in msg for s in shapes), msg


def test_unsupported_model_type_lists_supported(hf_model, tmp_path):
    """model_type gpt2 raises UnsupportedModelError naming it and listing the supported types."""
    _, _, path = hf_model
    d = tmp_path / "m"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        from_pretrained(d)
    assert "gpt2" in str(e.value)
    assert all(t in str(e.value) for t in ("llama", "qwen2", "qwen3"))


def test_missing_config_or_weights_name_the_path(hf_model, tmp_path):
    """A directory without config.json, or without weights, raises FileNotFoundError naming the directory."""
    _, _, path = hf_model
    no_cfg = tmp_path / "no_config"
    shutil.copytree(path, no_cfg)
    (no_cfg / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(no_cfg))):
        from_pretrained(no_cfg)
    no_weights = _copy_without_weights(path, tmp_path / "no_weights")
    with pytest.raises(FileNotFoundError, match=re.escape(str(no_weights))):
        from_pretrained(no_weights)


@pytest.mark.parametrize(
    "content",
    [
        b"\x03\x00",  # shorter than the 8-byte length prefix
        struct.pack("<Q", 9) + b"{not json",  # header is not JSON
        struct.pack("<Q", 7) + b"[1,2,3]",  # header is JSON but not an object
        struct.pack("<Q", 1 << 40) + b"{}",  # length prefix beyond the file (must not allocate it)
    ],
    ids=["short", "not-json", "not-object", "huge-length"],
)
def test_corrupt_header_raises_checkpoint_error(hf_model, tmp_path, content):
    """A corrupt safetensors header raises CheckpointError naming the file."""
    _, _, path = hf_model
    d = _copy_without_weights(path, tmp_path / "m")
    (d / "model.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match=re.escape(str(d / "model.safetensors"))):
        from_pretrained(d)


# ----------------------------------------------------------------------------- config.json
_LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 131072,
    "max_window_layers": 28, "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
}

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", **_LLAMA3_SCALING},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}


def test_classic_and_rope_parameters_forms_parse_identically():
    """rope_theta + rope_scaling (classic) and rope_parameters (transformers 5) give the same ModelConfig."""
    classic = dict(LLAMA31_8B)
    new = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **_LLAMA3_SCALING}
    assert ModelConfig.from_hf_dict(classic) == ModelConfig.from_hf_dict(new)
    plain_classic = dict(QWEN25_7B)
    plain_new = {k: v for k, v in QWEN25_7B.items() if k != "rope_theta"}
    plain_new["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    assert ModelConfig.from_hf_dict(plain_classic) == ModelConfig.from_hf_dict(plain_new)


def test_qwen25_7b_config_fields_and_param_count():
    """The published Qwen2.5-7B config parses to the right fields and ~7.62B parameters (within 1%)."""
    c = ModelConfig.from_hf_dict(QWEN25_7B)
    assert (c.model_type, c.hidden_size, c.num_hidden_layers) == ("qwen2", 3584, 28)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (28, 4, 128)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta) == (18944, 152064, 1e6)
    assert c.rope_scaling.kind == "default"
    assert c.attention_bias and not c.o_bias and not c.qk_norm and not c.tie_word_embeddings
    assert abs(c.num_params() / 7.62e9 - 1) < 0.01
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_llama31_8b_config_fields_and_param_count():
    """The published Llama-3.1-8B config parses (llama3 RoPE scaling included) to ~8.03B parameters (within 1%)."""
    c = ModelConfig.from_hf_dict(LLAMA31_8B)
    assert (c.model_type, c.hidden_size, c.num_hidden_layers) == ("llama", 4096, 32)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 128)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.rms_norm_eps) == (14336, 128256, 500000.0, 1e-5)
    rs = c.rope_scaling
    assert (rs.kind, rs.factor, rs.low_freq_factor, rs.high_freq_factor) == ("llama3", 8.0, 1.0, 4.0)
    assert rs.original_max_position_embeddings == 8192
    assert not c.attention_bias and not c.qk_norm and not c.tie_word_embeddings
    assert abs(c.num_params() / 8.03e9 - 1) < 0.01
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
