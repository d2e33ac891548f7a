"""One decoder-only transformer for Qwen2/2.5, Qwen3 and Llama 3.x, in Flax NNX.

Module and parameter names mirror Hugging Face's (``model.layers.3.self_attn.q_proj.weight``)
and weights keep Hugging Face's ``[out, in]`` layout, so checkpoint I/O is a
name-for-name copy and a tensor can be read straight into its shard.

Every parameter carries logical axis names (metadata ``axes``); `tltjax.sharding`
maps them to mesh axes.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from tltjax import sharding
from tltjax.kernels import attention
from tltjax.models.config import ModelConfig


@struct.dataclass
class ModelOutput:
    """What a forward pass returns.

    ``hidden_states[i]`` follows Hugging Face's indexing of the requested layer:
    0 is the embedding output, ``i`` the output of decoder layer ``i``, and
    ``num_hidden_layers`` the final (normed) hidden state that feeds the LM head.
    """

    logits: Float[Array, "batch seq vocab"]
    hidden_states: tuple[Float[Array, "batch seq hidden"], ...] | None = None
    cache: object | None = None


def _init(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x·Wᵀ (+ b) with W in Hugging Face's [out, in] layout."""

    def __init__(self, cfg: ModelConfig, d_in: int, d_out: int, axes: tuple[str, str], bias: bool, rngs):
        self.weight = nnx.Param(_init(rngs, (d_out, d_in), cfg.jnp_param_dtype), axes=axes)
        self.bias = nnx.Param(jnp.zeros((d_out,), cfg.jnp_param_dtype), axes=axes[:1]) if bias else None
        self.dtype = cfg.jnp_dtype

    def __call__(self, x):
        y = jnp.einsum("...i,oi->...o", x.astype(self.dtype), self.weight[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    """x / rms(x) · w, computed in float32 and cast back (as Hugging Face does)."""

    def __init__(self, cfg: ModelConfig, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), cfg.jnp_param_dtype), axes=("norm",))
        self.eps = eps

    def __call__(self, x):
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(dtype) * x32.astype(dtype)


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs):
        self.weight = nnx.Param(
            _init(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.jnp_param_dtype), axes=("vocab", "embed")
        )
        self.dtype = cfg.jnp_dtype

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0).astype(self.dtype)

    def attend(self, x):
        """Tied LM head: logits = x·Eᵀ."""
        return jnp.einsum("...h,vh->...v", x, self.weight[...].astype(self.dtype))


def rope_inv_freq(cfg: ModelConfig) -> jnp.ndarray:
    """Per-pair inverse frequencies, with Llama-3 long-context scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rs = cfg.rope_scaling
    if rs.kind == "llama3":
        low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
        wl = 2 * math.pi / inv
        smooth = (rs.original_max_position_embeddings / wl - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        scaled = jnp.where(wl > low_wl, inv / rs.factor, inv)
        mid = (wl <= low_wl) & (wl >= high_wl)
        inv = jnp.where(mid, (1 - smooth) * scaled / rs.factor + smooth * scaled, scaled)
    return inv


def apply_rope(x: Float[Array, "batch seq heads dim"], positions: Int[Array, "batch seq"], inv_freq):
    """Rotary embedding in the split-halves convention of Hugging Face checkpoints."""
    ang = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rot * sin).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs):
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = Linear(cfg, h, q, ("q_heads", "embed"), cfg.attention_bias, rngs)
        self.k_proj = Linear(cfg, h, kv, ("kv_heads", "embed"), cfg.attention_bias, rngs)
        self.v_proj = Linear(cfg, h, kv, ("kv_heads", "embed"), cfg.attention_bias, rngs)
        self.o_proj = Linear(cfg, q, h, ("embed", "q_heads"), cfg.o_bias, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg, cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def __call__(self, x, positions, inv_freq, mask, cache, layer: int):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        q = sharding.constrain(q, ("batch", "seq", "act_heads", None))
        if cache is None:
            out = attention(q, k, v, mask)
        else:
            out, cache = cache.attend(layer, q, k, v, mask)
        return self.o_proj(out.reshape(b, t, -1)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(cfg, h, i, ("mlp", "embed"), cfg.mlp_bias, rngs)
        self.up_proj = Linear(cfg, h, i, ("mlp", "embed"), cfg.mlp_bias, rngs)
        self.down_proj = Linear(cfg, i, h, ("embed", "mlp"), cfg.mlp_bias, rngs)

    def __call__(self, x):
        y = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        y = sharding.constrain(y, ("batch", "seq", "act_mlp"))
        return self.down_proj(y)


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks. ``input_norm=False`` drops the attention's input
    norm (attention reads the residual stream as is), as EAGLE-1's first draft layer does."""

    def __init__(self, cfg: ModelConfig, rngs, *, input_norm: bool = True):
        self.self_attn = Attention(cfg, rngs)
        self.mlp = MLP(cfg, rngs)
        self.input_layernorm = RMSNorm(cfg, cfg.hidden_size, cfg.rms_norm_eps) if input_norm else None
        self.post_attention_layernorm = RMSNorm(cfg, cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x, positions, inv_freq, mask, cache, layer: int):
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        a, cache = self.self_attn(h, positions, inv_freq, mask, cache, layer)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return sharding.constrain(x, ("batch", "seq", "act_embed")), cache


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs):
        self.embed_tokens = Embed(cfg, rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg, cfg.hidden_size, cfg.rms_norm_eps)


def causal_mask(batch: int, t: int) -> Bool[Array, "batch t t"]:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


class CausalLM(nnx.Module):
    """Decoder-only LM. ``model(ids)`` → `ModelOutput` with ``.logits [batch, seq, vocab]``.

    With a cache, the new tokens are written after each row's committed tokens
    and attend to them plus the new tokens allowed by ``mask`` (default causal).
    The returned cache has ``advance`` tokens committed (default: all new ones;
    pass 0 to commit later with ``cache.keep``, as tree verification does).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Decoder(config, rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config, config.hidden_size, config.vocab_size, ("vocab", "embed"), False, rngs)

    def logits_from_hidden(self, h: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        """LM head on final (normed) hidden states, in float32."""
        if self.lm_head is None:
            out = self.model.embed_tokens.attend(h)
        else:
            out = self.lm_head(h)
        return out.astype(jnp.float32)

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        *,
        positions: Int[Array, "batch seq"] | None = None,
        mask: Bool[Array, "batch seq seq"] | None = None,
        cache=None,
        advance: Int[Array, " batch"] | int | None = None,
        hidden_layers: Sequence[int] = (),
        return_logits: bool = True,
    ) -> ModelOutput:
        cfg = self.config
        b, t = input_ids.shape
        if positions is None:
            start = jnp.zeros((b,), jnp.int32) if cache is None else cache.lengths
            positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if mask is None:
            mask = causal_mask(b, t)
        inv_freq = rope_inv_freq(cfg)
        x = self.model.embed_tokens(input_ids)
        x = sharding.constrain(x, ("batch", "seq", "act_embed"))
        n = cfg.num_hidden_layers
        for i in hidden_layers:
            if not 0 <= i <= n:
                raise ValueError(f"hidden layer {i} out of range [0, {n}]")
        hidden = {0: x} if 0 in hidden_layers else {}

        def run_layer(layer_mod, x, cache, i):
            return layer_mod(x, positions, inv_freq, mask, cache, i)

        for i, layer in enumerate(self.model.layers):
            if cfg.remat and cache is None:
                x, _ = nnx.remat(lambda m, x: run_layer(m, x, None, i))(layer, x)
            else:
                x, cache = run_layer(layer, x, cache, i)
            if i + 1 in hidden_layers and i + 1 < n:
                hidden[i + 1] = x
        x = self.model.norm(x)
        if n in hidden_layers:
            hidden[n] = x
        logits = self.logits_from_hidden(x) if return_logits else None
        if cache is not None:
            cache = cache.advance(t if advance is None else advance)
        hs = tuple(hidden[i] for i in hidden_layers) if hidden_layers else None
        return ModelOutput(logits=logits, hidden_states=hs, cache=cache)


@functools.partial(nnx.jit, static_argnames=("hidden_layers", "return_logits"))
def forward(
    model: CausalLM,
    input_ids: Int[Array, "batch seq"],
    *,
    positions=None,
    mask=None,
    cache=None,
    advance=None,
    hidden_layers: tuple[int, ...] = (),
    return_logits: bool = True,
) -> ModelOutput:
    """`CausalLM.__call__` under `jit` (compiled once per shape and option set)."""
    return model(
        input_ids,
        positions=positions,
        mask=mask,
        cache=cache,
        advance=advance,
        hidden_layers=hidden_layers,
        return_logits=return_logits,
    )
