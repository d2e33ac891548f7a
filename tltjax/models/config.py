"""Model configuration: one dataclass for every supported decoder family.

A `ModelConfig` is built from a Hugging Face ``config.json`` (both the classic
``rope_theta`` / ``rope_scaling`` keys and the newer ``rope_parameters`` form are
read) and written back in the same format, so a checkpoint saved by tltjax loads
in ``transformers`` and vice versa.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax.numpy as jnp

# family -> what differs between the supported decoders.
#   qkv_bias: q/k/v projections carry a bias (Qwen2/2.5).
#   qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
FAMILIES: dict[str, dict[str, bool]] = {
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
    "llama": {"qkv_bias": False, "qk_norm": False},
}

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class UnsupportedModelError(ValueError):
    """A config.json describes a model tltjax cannot build."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is ``default`` (none) or ``llama3``."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer (Qwen2/2.5, Qwen3, Llama 3.x)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (and o for Llama's attention_bias)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Not part of the checkpoint: how to run it.
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype
    remat: bool = False

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; supported: {sorted(FAMILIES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {sorted(_DTYPES)}")
        if self.rope_scaling.kind not in ("default", "llama3"):
            raise UnsupportedModelError(
                f"rope scaling {self.rope_scaling.kind!r} is not supported; supported: ['default', 'llama3']"
            )

    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides) -> "ModelConfig":
        """Reads a Hugging Face config dict; ``overrides`` set run-time fields (dtype, remat)."""
        model_type = d.get("model_type")
        if model_type not in FAMILIES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}"
            )
        if d.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"{model_type} with use_sliding_window=true is not supported; set it to false"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
        rope = dict(d.get("rope_parameters") or {})
        legacy = d.get("rope_scaling") or {}
        rope.update({k: v for k, v in legacy.items() if k not in rope})
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default")) or "default"
        scaling = RopeScaling(
            kind=kind,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
        )
        fam = FAMILIES[model_type]
        n_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        if model_type == "llama":
            attn_bias = bool(d.get("attention_bias", False))
            o_bias = attn_bias
        else:
            attn_bias = fam["qkv_bias"] or bool(d.get("attention_bias", False))
            o_bias = False
        kw = dict(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attn_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=fam["qk_norm"],
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | pathlib.Path, **overrides) -> "ModelConfig":
        path = pathlib.Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}; a model directory needs one")
        return cls.from_hf_dict(json.loads(path.read_text()), **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` contents for this model."""
        archs = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": self.rope_scaling.kind}
        if self.rope_scaling.kind == "llama3":
            rope.update(
                factor=self.rope_scaling.factor,
                low_freq_factor=self.rope_scaling.low_freq_factor,
                high_freq_factor=self.rope_scaling.high_freq_factor,
                original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings,
            )
        d: dict[str, Any] = {
            "architectures": [archs[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.param_dtype,
        }
        if self.rope_scaling.kind != "default":
            d["rope_scaling"] = dict(rope)
        if self.model_type == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = self.mlp_bias
        elif self.model_type == "qwen3":
            d["attention_bias"] = self.attention_bias
        if self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
        return d

    def to_json(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        layer = attn + mlp + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h
