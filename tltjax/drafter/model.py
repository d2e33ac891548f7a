"""The EAGLE-style drafter: one decoder layer over (next token, target feature).

Alignment. Target position ``t`` sees tokens ``x_0..x_t`` and yields the feature
``f_t`` (its hidden state(s)), whose LM head gives the distribution of ``x_{t+1}``.
Drafter position ``t`` pairs ``f_t`` with the token that was actually chosen
there, ``x_{t+1}``, and predicts the target's next final hidden state
``h_{t+1}``, whose LM head gives the distribution of ``x_{t+2}``::

    drafter position t     0        1        2      ...   T-1
    feature input          f_0      f_1      f_2    ...   f_{T-1}
    token input            x_1      x_2      x_3    ...   x_T
                            │        │        │             │
    hidden output          ĥ_1      ĥ_2      ĥ_3    ...   ĥ_T       ≈ h_{t+1} (training target)
    logits output          p(x_2)   p(x_3)   p(x_4) ...   p(x_{T+1})

so the output at ``t`` depends only on tokens ``x_1..x_{t+1}`` and features
``f_0..f_t`` (causal attention). `pair_inputs` builds these inputs from a target
sequence. (TLT's online drafter pairs ``f_t`` with ``x_t``: the token its
feature has already seen, not the one the drafter must condition on.)

No final norm. The hidden output is regressed onto ``h_{t+1}`` = target hidden
layer ``num_hidden_layers``, the *normed* state that feeds the LM head, whatever
``feature_layers`` are; so logits are the target's head applied to it as is.
With the default ``feature_layers = (num_hidden_layers,)`` (EAGLE-1) the
prediction also lives in the input feature space, so a drafted step's ``ĥ``
is fed back as the next step's feature. With several feature layers (EAGLE-3
style, ``F = hidden · len(feature_layers)``) the inputs are target features only;
what a multi-step drafting loop feeds back is the drafting strategy's choice.

Live weights. The drafter owns no embedding and no LM head: every call reads
``target.model.embed_tokens`` and ``target.logits_from_hidden``, so after a
policy update the drafter uses the new policy's vocabulary weights.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from tltjax.models.config import ModelConfig, RopeScaling
from tltjax.models.hf import CheckpointError, SafetensorsFile, param_paths, save_safetensors
from tltjax.models.transformer import CausalLM, DecoderLayer, Linear, causal_mask, rope_inv_freq

FORMAT = "tltjax-eagle-drafter"


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Hyper-parameters of the one-layer drafter; ``hidden_size`` equals the target's.

    ``feature_layers`` index the target's hidden states as `CausalLM` does
    (``num_hidden_layers`` = the final normed state); their concatenation is the
    input feature of width ``hidden_size * len(feature_layers)``.

    ``input_norm=False`` drops the layer's input RMSNorm, so attention reads
    ``fc``'s output as is: EAGLE-1's draft layer, the one SGLang and vLLM build
    when they load an EAGLE checkpoint (`tltjax.drafter.export` needs it).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    feature_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    attention_bias: bool = False
    qk_norm: bool = False
    input_norm: bool = True
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self):
        layers = tuple(int(i) for i in self.feature_layers)
        object.__setattr__(self, "feature_layers", layers)
        if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
            raise ValueError(f"feature_layers={layers} must be distinct non-negative layer indices, at least one")
        _ = self.layer_config  # validates heads and dtypes with ModelConfig's own checks

    @property
    def feature_size(self) -> int:
        """Width ``F`` of the input feature: one hidden state per feature layer."""
        return self.hidden_size * len(self.feature_layers)

    @property
    def layer_config(self) -> ModelConfig:
        """The `ModelConfig` of the drafter's single decoder layer (and of its KV cache).

        ``vocab_size`` is 0: the drafter borrows the target's vocabulary weights.
        """
        return ModelConfig(
            model_type="llama",  # family flags are set explicitly below
            vocab_size=0,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            rms_norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias,
            qk_norm=self.qk_norm,
            param_dtype=self.param_dtype,
            dtype=self.dtype,
        )

    @classmethod
    def for_target(
        cls, target: ModelConfig, feature_layers: Sequence[int] | None = None, **overrides
    ) -> "DrafterConfig":
        """A drafter shaped like one of ``target``'s layers, reading ``feature_layers``.

        Default ``feature_layers``: ``(num_hidden_layers,)``, the final normed state (EAGLE-1).
        """
        layers = (target.num_hidden_layers,) if feature_layers is None else tuple(feature_layers)
        kw: dict[str, Any] = dict(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            feature_layers=layers,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            attention_bias=target.attention_bias,
            qk_norm=target.qk_norm,
            param_dtype=target.param_dtype,
            dtype=target.dtype,
        )
        kw.update(overrides)
        cfg = cls(**kw)
        cfg.check_target(target)
        return cfg

    def check_target(self, target: ModelConfig) -> None:
        """Raises ``ValueError`` unless this drafter can run on ``target``."""
        if self.hidden_size != target.hidden_size:
            raise ValueError(
                f"drafter hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}; "
                "a drafter reads the target's features and embeddings, so the sizes must match"
            )
        n = target.num_hidden_layers
        bad = [i for i in self.feature_layers if i > n]
        if bad:
            raise ValueError(
                f"drafter feature_layers {self.feature_layers} include {bad}, but the target has "
                f"hidden layers 0..{n} only"
            )

    # ------------------------------------------------------------------ json
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return {"format": FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], **overrides) -> "DrafterConfig":
        d = dict(d)
        fmt = d.pop("format", None)
        if fmt != FORMAT:
            raise ValueError(f"config format {fmt!r} is not a drafter config (expected {FORMAT!r})")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"drafter config has unknown keys {unknown}; known: {sorted(fields)}")
        if "rope_scaling" in d:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d.update(overrides)
        return cls(**d)


@struct.dataclass
class DrafterOutput:
    """``hidden[:, t]`` predicts the target's final hidden state at t+1; ``logits[:, t]`` the token at t+2."""

    hidden: Float[Array, "batch seq hidden"]
    logits: Float[Array, "batch seq vocab"] | None
    cache: object | None = None


def pair_inputs(
    ids: Int[Array, "batch seq"], features: Float[Array, "batch seq feature"]
) -> tuple[Int[Array, "batch seq1"], Float[Array, "batch seq1 feature"]]:
    """Drafter inputs for a target sequence: (tokens ``x_1..x_{S-1}``, features ``f_0..f_{S-2}``).

    ``features[:, t]`` is the target's feature at position ``t`` of ``ids``. The
    drafter output at ``t`` is then trained against the target's final hidden
    state at ``t + 1`` (``hidden[:, 1:]``).
    """
    return ids[:, 1:], features[:, :-1]


def feature_from_hidden(h: Float[Array, "... hidden"], feature_size: int) -> Float[Array, "... feature"]:
    """The feature a drafted position gets from a predicted final hidden state ``h``.

    EAGLE-1 (``feature_size == hidden``): ``h`` itself. With several feature layers
    (``feature_size = hidden · k``) ``h`` fills every layer's slot, as the EAGLE
    drafting loop does; unrolled training (``unroll_steps > 1``) feeds back the same.
    """
    hidden = h.shape[-1]
    if feature_size % hidden:
        raise ValueError(f"feature_size {feature_size} is not a multiple of the hidden size {hidden}")
    reps = feature_size // hidden
    return h if reps == 1 else jnp.concatenate([h] * reps, axis=-1)


class Drafter(nnx.Module):
    """``layers[0](fc(concat(embed(x_{t+1}), f_t)))``: one decoder layer predicting ``h_{t+1}``.

    Parameters: ``fc`` ([hidden, hidden + F] with bias, as EAGLE) and ``layers.0``
    (a `DecoderLayer`, the same implementation as the target's). Its own KV
    cache is any cache built for `DrafterConfig.layer_config`, e.g.
    ``ContiguousKVCache.init(cfg.layer_config, batch, slots)``.
    """

    def __init__(self, config: DrafterConfig, *, rngs: nnx.Rngs):
        self.config = config
        lc = config.layer_config
        self.fc = Linear(lc, config.hidden_size + config.feature_size, config.hidden_size, ("embed", None), True, rngs)
        self.layers = nnx.List([DecoderLayer(lc, rngs, input_norm=config.input_norm)])

    def __call__(
        self,
        target: CausalLM,
        tokens_next: Int[Array, "batch seq"],
        features: Float[Array, "batch seq feature"],
        *,
        positions: Int[Array, "batch seq"] | None = None,
        mask: Bool[Array, "batch seq seq"] | None = None,
        cache=None,
        advance: Int[Array, " batch"] | int | None = None,
        return_logits: bool = True,
    ) -> DrafterOutput:
        """Drafts from ``features[:, t]`` (target position t) and ``tokens_next[:, t]`` (token t+1).

        Positions default to the sequence's: ``cache.lengths + arange(T)`` (0-based
        without a cache). ``mask`` (default causal) and ``advance`` behave as in
        `CausalLM`, so a tree of drafts extends the cache without committing it.
        """
        cfg = self.config
        lc = cfg.layer_config
        cfg.check_target(target.config)
        b, t = tokens_next.shape
        if features.shape != (b, t, cfg.feature_size):
            raise ValueError(
                f"features have shape {features.shape}, expected {(b, t, cfg.feature_size)} = (batch, seq, "
                f"hidden {cfg.hidden_size} x {len(cfg.feature_layers)} feature layers {cfg.feature_layers})"
            )
        if positions is None:
            start = jnp.zeros((b,), jnp.int32) if cache is None else cache.lengths
            positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if mask is None:
            mask = causal_mask(b, t)
        emb = target.model.embed_tokens(tokens_next).astype(lc.jnp_dtype)
        x = self.fc(jnp.concatenate([emb, features.astype(lc.jnp_dtype)], axis=-1))
        x, cache = self.layers[0](x, positions, rope_inv_freq(lc), mask, cache, 0)
        logits = target.logits_from_hidden(x.astype(target.config.jnp_dtype)) if return_logits else None
        if cache is not None:
            cache = cache.advance(t if advance is None else advance)
        return DrafterOutput(hidden=x, logits=logits, cache=cache)


@functools.partial(nnx.jit, static_argnames=("return_logits",))
def drafter_forward(
    drafter: Drafter,
    target: CausalLM,
    tokens_next: Int[Array, "batch seq"],
    features: Float[Array, "batch seq feature"],
    *,
    positions=None,
    mask=None,
    cache=None,
    advance=None,
    return_logits: bool = True,
) -> DrafterOutput:
    """`Drafter.__call__` under `jit` (compiled once per shape and option set)."""
    return drafter(
        target, tokens_next, features, positions=positions, mask=mask, cache=cache, advance=advance,
        return_logits=return_logits,
    )


# ----------------------------------------------------------------------------- save / load
def save_drafter(drafter: Drafter, path: str | pathlib.Path) -> None:
    """Writes ``config.json`` (the `DrafterConfig`) and ``model.safetensors`` (``fc.weight``, ``layers.0....``)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.asarray(jax.device_get(var[...])) for name, var in param_paths(drafter).items()}
    save_safetensors(tensors, path / "model.safetensors", {"format": FORMAT})
    (path / "config.json").write_text(json.dumps(drafter.config.to_dict(), indent=2, sort_keys=True) + "\n")


def load_drafter(path: str | pathlib.Path, target_config: ModelConfig, **overrides) -> Drafter:
    """Reads a drafter written by `save_drafter` and checks that it fits ``target_config``.

    ``overrides`` set `DrafterConfig` fields (e.g. ``dtype``). Every tensor must
    match a parameter by name and shape; otherwise `CheckpointError` names it.
    """
    path = pathlib.Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {path}; pass a directory written by save_drafter")
    config = DrafterConfig.from_dict(json.loads((path / "config.json").read_text()), **overrides)
    try:
        config.check_target(target_config)
    except ValueError as e:
        raise CheckpointError(f"drafter at {path} does not fit the target: {e}") from None
    drafter = nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0)))
    st = SafetensorsFile(path / "model.safetensors")
    params = param_paths(drafter)
    missing = sorted(set(params) - set(st.keys()))
    unexpected = sorted(set(st.keys()) - set(params))
    if missing or unexpected:
        raise CheckpointError(
            f"drafter checkpoint {path} does not match its config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, var in params.items():
        if st.shape(name) != tuple(var.shape):
            raise CheckpointError(
                f"drafter tensor {name} has shape {st.shape(name)}, config expects {tuple(var.shape)}"
            )
        var.set_value(jnp.asarray(np.asarray(st.get(name)).astype(var.dtype)))
    return drafter
