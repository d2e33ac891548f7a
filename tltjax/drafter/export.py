"""A trained drafter as an EAGLE-1 draft checkpoint that SGLang and vLLM serve next to the policy.

What the serving engines compute. SGLang (``LlamaForCausalLMEagle``) and vLLM
(``EagleLlamaForCausalLM``) build the EAGLE-1 draft model as one Llama decoder
layer behind ``fc``, with the target's embedding and LM head::

    x   = fc(concat(embed(x_{t+1}), f_t))     f_t: the target's final normed hidden state
    h   = x + o_proj(attn(x))                 layer 0 has *no* input norm
    out = h + mlp(post_attention_layernorm(h))
    logits = target_lm_head(out)              no final norm; out is fed back as the next f

which is `Drafter` with ``feature_layers = (num_hidden_layers,)`` and
``input_norm=False`` (same concatenation order, same alignment, same feedback).

Three mismatches, and how the export treats them:

- **Input norm.** Both engines replace layer 0's ``input_layernorm`` by the identity
  (and their loaders do not expect the tensor). `DecoderLayer`'s input RMSNorm
  divides by the RMS of ``x``, which no weight undoes, so a drafter trained with
  it cannot be served exactly by them: `export_eagle` refuses it and asks for a
  drafter trained with ``DrafterConfig(input_norm=False)``.
- **fc bias.** SGLang always builds ``fc`` with a bias; vLLM builds it without one.
  The bias ``b`` is folded where both engines have one: the residual stream
  carries ``b`` (o_proj's bias gets ``b``) and attention sees it through q/k/v
  (their biases get ``W_q b``, ``W_k b``, ``W_v b``); ``attention_bias`` is set, so
  every engine builds q/k/v/o biases. ``fc.bias`` is then zero: written as zeros
  for SGLang (which would otherwise keep its random init), left out for vLLM.
  The result is the same function up to float rounding of ``W b``.
- **Multi-layer features (EAGLE-3).** EAGLE-3 checkpoints (``midlayer.*``) have
  attention read ``concat(norm(embed), norm(fc(features)))`` of width
  ``2·hidden``: a different layer from this drafter's, so no exact export
  exists; only single-feature (EAGLE-1) drafters are exported. Per-head q/k
  norms (``qk_norm``, Qwen3-style) are refused too: the engines' Llama layer has
  none.

The embedding and LM head are not written: both engines hand the target's to the
draft model (vLLM loads ``embed_tokens.weight`` only under pipeline
parallelism). ``embedding_from`` writes the target's embedding for that case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from tltjax.drafter.model import Drafter, DrafterConfig, load_drafter
from tltjax.models.config import ModelConfig, UnsupportedModelError
from tltjax.models.hf import CheckpointError, SafetensorsFile, from_pretrained, param_paths, save_safetensors
from tltjax.models.transformer import CausalLM

FORMAT = "tltjax-eagle1"
_QKV = ("q_proj", "k_proj", "v_proj")
_ATTN = "layers.0.self_attn"
_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


@dataclasses.dataclass(frozen=True)
class Runtime:
    """How one serving engine reads an EAGLE-1 draft checkpoint.

    ``architecture``: what ``config.json`` must name for the engine to pick its
    EAGLE-1 draft class. ``fc_bias``: whether the engine's ``fc`` has a bias
    (then ``fc.bias`` is written, as zeros, since the bias is folded).
    """

    architecture: str
    fc_bias: bool


RUNTIMES: dict[str, Runtime] = {
    # SGLang resolves the class by name; its `LlamaForCausalLMEagle` always has an fc bias.
    "sglang": Runtime(architecture="LlamaForCausalLMEagle", fc_bias=True),
    # vLLM prefixes "Eagle" (LlamaForCausalLM -> EagleLlamaForCausalLM); its fc has no bias.
    "vllm": Runtime(architecture="LlamaForCausalLM", fc_bias=False),
}


def check_exportable(config: DrafterConfig, target_config: ModelConfig) -> None:
    """Raises ``ValueError`` (saying what to change) unless ``config`` has an exact EAGLE-1 export."""
    config.check_target(target_config)
    final = (target_config.num_hidden_layers,)
    if config.feature_layers != final:
        raise ValueError(
            f"drafter reads target layers {config.feature_layers}; the EAGLE-1 layout feeds the target's final "
            f"normed hidden state only, feature_layers={final}. EAGLE-3 checkpoints (several layers) use a "
            "different decoder layer (attention over concat(norm(embed), norm(fc(features)))), so no exact "
            "export exists for this drafter"
        )
    if config.input_norm:
        raise ValueError(
            "drafter has an input RMSNorm in its decoder layer; SGLang and vLLM drop layer 0's input norm "
            "for EAGLE-1 drafts and no weight makes an RMSNorm the identity, so the served drafter would be "
            "a different function. Train it with DrafterConfig(input_norm=False) to export it"
        )
    if config.qk_norm:
        raise ValueError(
            "drafter has per-head q/k norms (qk_norm=True, Qwen3-style); the engines' EAGLE-1 draft layer "
            "is a Llama layer without them. Train it with DrafterConfig(qk_norm=False) to export it"
        )


def eagle_config(config: DrafterConfig, target_config: ModelConfig) -> ModelConfig:
    """The draft model's config as the engines read it: one Llama layer with q/k/v/o biases.

    Vocabulary, context length and special tokens are the target's (the engines
    size the shared embedding and head from them).
    """
    return ModelConfig(
        model_type="llama",
        vocab_size=target_config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=target_config.tie_word_embeddings,
        attention_bias=True,
        o_bias=True,
        max_position_embeddings=target_config.max_position_embeddings,
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id,
        param_dtype=config.param_dtype,
        dtype=config.dtype,
    )


def eagle_tensors(drafter: Drafter, *, fc_bias: bool) -> dict[str, np.ndarray]:
    """The drafter's parameters under EAGLE-1 names, fc's bias folded into q/k/v/o (float32 host arrays).

    Names other than the biases are the drafter's own (``fc.weight`` [hidden,
    2·hidden] with inputs (embedding, feature), ``layers.0.…``); see the module
    docstring for the fold.
    """
    src = {name: np.asarray(jax.device_get(var[...]), np.float32) for name, var in param_paths(drafter).items()}
    b = src.pop("fc.bias")
    out = dict(src)
    for proj in _QKV:
        w = src[f"{_ATTN}.{proj}.weight"]
        own = src.get(f"{_ATTN}.{proj}.bias", np.zeros(w.shape[0], np.float32))
        out[f"{_ATTN}.{proj}.bias"] = own + _matvec(w, b)
    out[f"{_ATTN}.o_proj.bias"] = src.get(f"{_ATTN}.o_proj.bias", np.zeros_like(b)) + b
    if fc_bias:
        out["fc.bias"] = np.zeros_like(b)
    return out


def export_eagle(
    drafter: Drafter,
    target_config: ModelConfig,
    out_dir: str | pathlib.Path,
    *,
    runtime: str,
    dtype: str | None = None,
    embedding_from: CausalLM | None = None,
) -> pathlib.Path:
    """Writes ``drafter`` as an EAGLE-1 draft model (``config.json``, ``model.safetensors``) for ``runtime``.

    ``runtime`` is a `RUNTIMES` key (``sglang`` or ``vllm``). ``dtype`` (default:
    the drafter's parameter dtype) is the dtype written. ``embedding_from``: a
    target whose embedding is written as ``embed_tokens.weight``. Exact: the
    engine's draft model computes `Drafter`'s function (up to float rounding of
    the folded bias); drafters without an exact export are refused with
    ``ValueError`` (see `check_exportable`). Returns ``out_dir``.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r} is not known; choose one of {sorted(RUNTIMES)}")
    rt = RUNTIMES[runtime]
    cfg = drafter.config
    check_exportable(cfg, target_config)
    dtype = dtype or cfg.param_dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    tensors = eagle_tensors(drafter, fc_bias=rt.fc_bias)
    if embedding_from is not None:
        if embedding_from.config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"embedding_from has vocab_size {embedding_from.config.vocab_size}, "
                f"target_config {target_config.vocab_size}; pass the target the drafter serves"
            )
        tensors["embed_tokens.weight"] = np.asarray(jax.device_get(embedding_from.model.embed_tokens.weight[...]))
    tensors = {name: a.astype(_DTYPES[dtype]) for name, a in tensors.items()}

    hf = eagle_config(cfg, target_config).to_hf_dict()
    hf["architectures"] = [rt.architecture]
    hf["torch_dtype"] = dtype
    hf["tltjax"] = {"format": FORMAT, "runtime": runtime, "feature_layers": list(cfg.feature_layers)}
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / "model.safetensors", {"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out


# ----------------------------------------------------------------------------- import
def import_eagle(path: str | pathlib.Path, target_config: ModelConfig, **overrides) -> Drafter:
    """Reads an EAGLE-1 draft checkpoint (this module's or another single-layer Llama/Qwen2 one) as a `Drafter`.

    The returned drafter computes what the engines compute from the checkpoint:
    no input norm, ``fc``'s bias and o_proj's bias combined into ``fc``'s (o_proj's
    unfolded back through q/k/v). It has q/k/v biases when the target has, or when
    the checkpoint needs them. ``overrides`` set `DrafterConfig` fields (e.g.
    ``dtype``). A missing, unexpected or wrongly shaped tensor is a
    `CheckpointError` naming it.
    """
    path = pathlib.Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {path}; pass a directory written by export_eagle")
    raw = json.loads((path / "config.json").read_text())
    try:
        ec = ModelConfig.from_hf_dict(raw)
    except (UnsupportedModelError, KeyError) as e:
        raise CheckpointError(f"EAGLE config {path / 'config.json'} cannot be read: {e}") from None
    if ec.num_hidden_layers != 1 or ec.qk_norm or ec.mlp_bias:
        raise CheckpointError(
            f"EAGLE config {path / 'config.json'} describes num_hidden_layers={ec.num_hidden_layers}, "
            f"qk_norm={ec.qk_norm}, mlp_bias={ec.mlp_bias}; an EAGLE-1 drafter is one Llama/Qwen2 layer "
            "(1, False, False)"
        )
    if ec.vocab_size != target_config.vocab_size:
        raise CheckpointError(
            f"EAGLE config vocab_size {ec.vocab_size} != target vocab_size {target_config.vocab_size}; "
            "the draft was made for another target"
        )
    base = dict(
        hidden_size=ec.hidden_size,
        intermediate_size=ec.intermediate_size,
        num_attention_heads=ec.num_attention_heads,
        num_key_value_heads=ec.num_key_value_heads,
        head_dim=ec.head_dim,
        feature_layers=(target_config.num_hidden_layers,),
        rms_norm_eps=ec.rms_norm_eps,
        rope_theta=ec.rope_theta,
        rope_scaling=ec.rope_scaling,
        qk_norm=False,
        input_norm=False,
        param_dtype=target_config.param_dtype,
        dtype=target_config.dtype,
    )
    try:
        DrafterConfig(**base, attention_bias=False).check_target(target_config)
    except ValueError as e:
        raise CheckpointError(f"EAGLE draft at {path} does not fit the target: {e}") from None

    st = SafetensorsFile(path / "model.safetensors")
    t = _read_checked(st, path, ec, base)
    d = t.pop(f"{_ATTN}.o_proj.bias", None)
    fc_b = t.pop("fc.bias", np.zeros(ec.hidden_size, np.float32))
    qkv_b = {p: t.pop(f"{_ATTN}.{p}.bias", None) for p in _QKV}
    if d is not None:  # o_proj's bias rides the residual stream: move it into fc, take it back out of q/k/v
        fc_b = fc_b + d
        for p in _QKV:
            w = t[f"{_ATTN}.{p}.weight"]
            own = qkv_b[p] if qkv_b[p] is not None else np.zeros(w.shape[0], np.float32)
            qkv_b[p] = own - _matvec(w, d)
    t["fc.bias"] = fc_b
    needed = target_config.attention_bias or any(b is not None and np.any(b) for b in qkv_b.values())
    if needed:
        for p, b in qkv_b.items():
            t[f"{_ATTN}.{p}.bias"] = b if b is not None else np.zeros(t[f"{_ATTN}.{p}.weight"].shape[0], np.float32)
    config = DrafterConfig(**{**base, "attention_bias": bool(needed), **overrides})
    drafter = nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0)))
    for name, var in param_paths(drafter).items():
        var.set_value(jnp.asarray(t[name].astype(var.dtype)))
    return drafter


def _read_checked(st: SafetensorsFile, path: pathlib.Path, ec: ModelConfig, base: dict) -> dict[str, np.ndarray]:
    """Every tensor of an EAGLE-1 checkpoint as float32, after checking names and shapes against ``ec``."""
    layer = nnx.eval_shape(lambda: Drafter(DrafterConfig(**base, attention_bias=ec.attention_bias), rngs=nnx.Rngs(0)))
    want = {name: tuple(var.shape) for name, var in param_paths(layer).items()}
    optional = {"fc.bias": want.pop("fc.bias"), "embed_tokens.weight": (ec.vocab_size, ec.hidden_size)}
    if ec.o_bias:
        want[f"{_ATTN}.o_proj.bias"] = (ec.hidden_size,)
    have = set(st.keys())
    missing = sorted(set(want) - have)
    if missing:
        name = missing[0]
        raise CheckpointError(
            f"EAGLE checkpoint {path} lacks tensor {name} (shape {want[name]} expected by its config.json); "
            f"missing: {missing}"
        )
    unexpected = sorted(have - set(want) - set(optional))
    if unexpected:
        why = ""
        if "layers.0.input_layernorm.weight" in unexpected:
            why = " (EAGLE-1 engines drop layer 0's input norm, so they would not run this weight)"
        raise CheckpointError(f"EAGLE checkpoint {path} has tensors an EAGLE-1 draft does not use: {unexpected}{why}")
    out = {}
    for name in sorted(have):
        expected = want.get(name, optional.get(name))
        if st.shape(name) != expected:
            raise CheckpointError(f"EAGLE tensor {name} has shape {st.shape(name)}, config.json expects {expected}")
        if name != "embed_tokens.weight":  # the engines use the target's; only its shape is checked
            out[name] = np.asarray(st.get(name), np.float32)
    return out


def _matvec(w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``w @ b`` rounded to float32 once: export adds it and import subtracts the same value, so a
    bias that was zero comes back exactly zero."""
    return (w.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)


# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> None:
    """``python -m tltjax.drafter.export --drafter DIR --target DIR --out DIR --runtime sglang|vllm``."""
    p = argparse.ArgumentParser(prog="python -m tltjax.drafter.export", description=__doc__.split("\n")[0])
    p.add_argument("--drafter", required=True, help="directory written by save_drafter")
    p.add_argument("--target", required=True, help="the policy's Hugging Face directory (config.json, weights)")
    p.add_argument("--out", required=True, help="directory to write the EAGLE draft model to")
    p.add_argument("--runtime", required=True, choices=sorted(RUNTIMES))
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="dtype written (default: the drafter's)")
    p.add_argument("--with-embedding", action="store_true", help="also write the target's embed_tokens.weight")
    args = p.parse_args(argv)
    target_config = ModelConfig.from_json(args.target)
    drafter = load_drafter(args.drafter, target_config)
    embedding_from = None
    if args.with_embedding:
        embedding_from = from_pretrained(args.target, dtype="float32")
    out = export_eagle(
        drafter, target_config, args.out, runtime=args.runtime, dtype=args.dtype, embedding_from=embedding_from
    )
    print(f"wrote an EAGLE-1 draft model for {args.runtime} to {out}")


if __name__ == "__main__":
    main()
