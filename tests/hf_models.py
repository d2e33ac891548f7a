"""Random tiny Hugging Face models of each supported family, for parity tests."""

import torch
import transformers

_COMMON = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)

FAMILIES = {
    # Qwen2.5: q/k/v bias, untied head.
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    # Qwen3: q/k norm, explicit head_dim larger than hidden/heads, tied embeddings.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
    # Llama 3.x: llama3 RoPE scaling, GQA 4:1.
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            num_key_value_heads=1,
            rope_theta=500000.0,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=64),
        ),
    ),
}


def make_hf_model(family: str, path, seed: int = 0):
    """Builds a tiny random model of ``family``, perturbs every tensor (biases and norms too), saves it."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    kw = dict(_COMMON)
    kw.update(extra)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(path)
    return model
