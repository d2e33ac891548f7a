"""Decoder models (Qwen2/2.5, Qwen3, Llama 3.x), their caches and Hugging Face interop."""

from tltjax.models.config import ModelConfig, UnsupportedModelError
from tltjax.models.hf import CheckpointError, from_pretrained, save_pretrained
from tltjax.models.kv_cache import ContiguousKVCache
from tltjax.models.transformer import CausalLM, ModelOutput, forward

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ContiguousKVCache",
    "ModelConfig",
    "ModelOutput",
    "UnsupportedModelError",
    "forward",
    "from_pretrained",
    "save_pretrained",
]
