"""GRPO-family policy optimisation: advantages, the clipped policy loss, and a pure jitted update.

One update serves GRPO, Dr.GRPO and DAPO; they differ only in a `LossConfig`
(see `ALGORITHMS`), whose pieces are looked up by name:

- `ADVANTAGE_ESTIMATORS`: group rewards ``[groups, n]`` → per-sequence advantages;
- `POLICY_LOSSES`: per-token surrogate loss from log-probs and advantages;
- `LOSS_AGGREGATIONS`: per-token values → (sum, count), how tokens and sequences are weighted;
- `KL_PENALTIES`: per-token penalty to a reference policy (only when ``kl_coef > 0``).

Alignment. Every per-token array in a `GRPOBatch` is indexed by the position of
the token it scores: ``loss_mask[:, t] == 1`` says token ``t`` is a response
token, and ``old_logp[:, t]`` is ``log π_old(tokens[t] | tokens[:t])``.
Position 0 has no prediction and never counts.

Exactness. Aggregations return (sum, count). `grpo_update` differentiates the
summed loss of each micro-batch, adds the gradients and divides by the total
count once, so any ``micro_batches`` gives the full-batch gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from tltjax.models.transformer import CausalLM
from tltjax.sft import TrainState

# exp() of a log-ratio beyond this bound overflows float32 gradients (inf · 0 = nan); clamp before it.
_MAX_LOG_RATIO = 20.0

Rewards = Float[Array, "groups n"] | Float[np.ndarray, "groups n"]


def _lookup(registry: Mapping[str, Any], kind: str, name: str) -> Any:
    try:
        return registry[name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; registered: {sorted(registry)}") from None


# ----------------------------------------------------------------------------- advantages
def _as_groups(rewards: Rewards) -> Float[Array, "groups n"]:
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [groups, samples per group], got shape {r.shape}; reshape before calling")
    return r


def zero_variance_groups(rewards: Rewards) -> Bool[Array, " groups"]:
    """True for groups whose rewards are all equal (including groups of one sample): they carry no signal."""
    r = _as_groups(rewards)
    return jnp.all(r == r[:, :1], axis=1)


def dynamic_sampling_mask(rewards: Rewards, enabled: bool = True) -> Bool[Array, " groups"]:
    """Which groups to train on: with DAPO's dynamic sampling (``enabled``) those whose rewards differ, else all.

    The host keeps sampling until it has enough kept groups; this only says which ones to keep.
    """
    keep = ~zero_variance_groups(rewards)
    return keep if enabled else jnp.ones_like(keep)


def grpo_advantages(rewards: Rewards, eps: float = 1e-6) -> Float[Array, "groups n"]:
    """(r - group mean) / (group std + eps), std with ddof=1 as TRL and verl use; 0 for zero-variance groups."""
    r = _as_groups(rewards)
    centred = r - r.mean(axis=1, keepdims=True)
    std = jnp.std(r, axis=1, keepdims=True, ddof=min(1, r.shape[1] - 1))  # ddof 0 for groups of one: std 0, not nan
    return jnp.where(zero_variance_groups(r)[:, None], 0.0, centred / (std + eps))


def drgrpo_advantages(rewards: Rewards) -> Float[Array, "groups n"]:
    """r - group mean; 0 for zero-variance groups.

    Dr.GRPO drops the std: dividing by it up-weights groups that are nearly all right or all wrong.
    """
    r = _as_groups(rewards)
    return jnp.where(zero_variance_groups(r)[:, None], 0.0, r - r.mean(axis=1, keepdims=True))


ADVANTAGE_ESTIMATORS: dict[str, Callable[[Rewards], Float[Array, "groups n"]]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
}


def get_advantage_estimator(name: str) -> Callable[[Rewards], Float[Array, "groups n"]]:
    """The advantage estimator registered as ``name`` in `ADVANTAGE_ESTIMATORS`."""
    return _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


# ----------------------------------------------------------------------------- aggregations
def token_mean(
    values: Float[Array, "batch seq"], mask: Float[Array, "batch seq"], *, max_len: int
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(sum over masked tokens, number of masked tokens): every token weighs the same (DAPO)."""
    del max_len
    return jnp.sum(values * mask), jnp.sum(mask)


def seq_mean_token_mean(
    values: Float[Array, "batch seq"], mask: Float[Array, "batch seq"], *, max_len: int
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(sum of per-sequence token means, number of sequences with tokens): every sequence weighs the same (GRPO).

    Rows without masked tokens (padding rows) add nothing to either.
    """
    del max_len
    n = jnp.sum(mask, axis=1)
    return jnp.sum(jnp.sum(values * mask, axis=1) / jnp.maximum(n, 1.0)), jnp.sum(n > 0).astype(jnp.float32)


def seq_mean_token_sum_norm(
    values: Float[Array, "batch seq"], mask: Float[Array, "batch seq"], *, max_len: int
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(sum of per-sequence token sums / ``max_len``, number of sequences with tokens) (Dr.GRPO).

    A constant divisor keeps long responses from being down-weighted per token.
    """
    n = jnp.sum(mask, axis=1)
    return jnp.sum(values * mask) / max_len, jnp.sum(n > 0).astype(jnp.float32)


LOSS_AGGREGATIONS: dict[str, Callable[..., tuple[Float[Array, ""], Float[Array, ""]]]] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


# ----------------------------------------------------------------------------- KL penalties
def kl_k1(logp: Float[Array, "batch seq"], ref_logp: Float[Array, "batch seq"]) -> Float[Array, "batch seq"]:
    """logp - ref_logp: the unbiased (high-variance) per-token estimate of KL(π ‖ π_ref)."""
    return logp - ref_logp


def kl_k3(logp: Float[Array, "batch seq"], ref_logp: Float[Array, "batch seq"]) -> Float[Array, "batch seq"]:
    """exp(ref - logp) - (ref - logp) - 1 clamped to [-10, 10]: the low-variance, non-negative k3 estimate."""
    d = jnp.clip(ref_logp - logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


def kl_mse(logp: Float[Array, "batch seq"], ref_logp: Float[Array, "batch seq"]) -> Float[Array, "batch seq"]:
    """0.5 · (logp - ref_logp)²: the k2 estimate."""
    return 0.5 * jnp.square(logp - ref_logp)


KL_PENALTIES: dict[str, Callable[[Array, Array], Array]] = {"kl": kl_k1, "low_var_kl": kl_k3, "mse": kl_mse}


# ----------------------------------------------------------------------------- policy losses
def ppo_clip_loss(
    logp: Float[Array, "batch seq"],
    old_logp: Float[Array, "batch seq"],
    advantages: Float[Array, "batch seq"],
    cfg: LossConfig,
) -> tuple[Float[Array, "batch seq"], Bool[Array, "batch seq"]]:
    """(-min(ρA, clip(ρ, 1 - clip_low, 1 + clip_high)·A), clipped branch active) per token.

    ρ = exp(logp - old_logp) is the token-level importance ratio. Where the clipped
    branch is active the loss is constant in ``logp``: zero gradient.
    """
    ratio = jnp.exp(jnp.clip(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return jnp.maximum(unclipped, clipped), clipped > unclipped


POLICY_LOSSES: dict[str, Callable[..., tuple[Array, Array]]] = {"ppo_clip": ppo_clip_loss}


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Everything that picks the loss; hashable, a static argument of `grpo_update`.

    ``clip_low`` / ``clip_high`` bound the ratio to [1 - clip_low, 1 + clip_high]
    (DAPO's clip-higher: clip_high > clip_low). ``kl_coef`` 0 turns the reference
    penalty off (no ``ref_logp`` needed). ``max_len`` is the divisor of
    seq-mean-token-sum-norm; None means the batch's sequence length.
    ``temperature`` divides the logits, as the rollout's sampling did, so that
    log-probs are those of the distribution the rollout sampled from.
    """

    advantage: str = "grpo"
    aggregation: str = "seq-mean-token-mean"
    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    dynamic_sampling: bool = False
    max_len: int | None = None
    temperature: float = 1.0

    def __post_init__(self):
        _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", self.advantage)
        _lookup(LOSS_AGGREGATIONS, "loss aggregation", self.aggregation)
        _lookup(POLICY_LOSSES, "policy loss", self.policy_loss)
        _lookup(KL_PENALTIES, "KL penalty", self.kl_kind)
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0 (0 turns the penalty off), got {self.kl_coef}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (the rollout's sampling temperature), got {self.temperature}")
        if self.max_len is not None and self.max_len < 1:
            raise ValueError(f"max_len must be >= 1 or None (the batch's sequence length), got {self.max_len}")


ALGORITHMS: dict[str, LossConfig] = {
    "grpo": LossConfig(advantage="grpo", aggregation="seq-mean-token-mean", clip_low=0.2, clip_high=0.2),
    "drgrpo": LossConfig(advantage="drgrpo", aggregation="seq-mean-token-sum-norm", clip_low=0.2, clip_high=0.2),
    "dapo": LossConfig(
        advantage="grpo", aggregation="token-mean", clip_low=0.2, clip_high=0.28, dynamic_sampling=True
    ),
}


def loss_config(algorithm: str, **overrides: Any) -> LossConfig:
    """The `ALGORITHMS` preset ``algorithm`` with ``overrides`` (LossConfig field names) applied."""
    preset = _lookup(ALGORITHMS, "algorithm", algorithm)
    fields = {f.name for f in dataclasses.fields(LossConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown LossConfig field(s) {unknown} for {algorithm!r}; fields: {sorted(fields)}")
    return dataclasses.replace(preset, **overrides)


# ----------------------------------------------------------------------------- batch and update
@struct.dataclass
class GRPOBatch:
    """Rollouts to learn from, right-padded; per-token fields are aligned to token positions (see module doc).

    ``positions`` None means 0..seq-1 per row; ``ref_logp`` is needed only when ``kl_coef > 0``.
    """

    tokens: Int[Array, "batch seq"]
    loss_mask: Float[Array, "batch seq"]
    old_logp: Float[Array, "batch seq"]
    advantages: Float[Array, " batch"]
    positions: Int[Array, "batch seq"] | None = None
    ref_logp: Float[Array, "batch seq"] | None = None


def token_logprobs(
    model: CausalLM,
    tokens: Int[Array, "batch seq"],
    positions: Int[Array, "batch seq"] | None = None,
    temperature: float = 1.0,
) -> tuple[Float[Array, "batch seq"], Float[Array, "batch seq"]]:
    """(log π(tokens[t] | tokens[:t]), entropy of π(· | tokens[:t])) at every position t; 0 at t = 0.

    π is the softmax of the logits divided by ``temperature``.
    """
    pos = None if positions is None else positions[:, :-1]
    logits = model(tokens[:, :-1], positions=pos).logits.astype(jnp.float32)
    logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    pad = ((0, 0), (1, 0))
    return jnp.pad(logp, pad), jnp.pad(entropy, pad)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("temperature",))
def compute_logprobs(
    graphdef: Any,
    params: Any,
    tokens: Int[Array, "batch seq"],
    positions: Int[Array, "batch seq"] | None = None,
    temperature: float = 1.0,
) -> Float[Array, "batch seq"]:
    """Per-token log-probs of the policy ``nnx.merge(graphdef, params)``: a batch's ``old_logp`` or ``ref_logp``."""
    return token_logprobs(nnx.merge(graphdef, params), tokens, positions, temperature)[0]


def grpo_loss(
    model: CausalLM, batch: GRPOBatch, cfg: LossConfig
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """(loss sum, sums) on ``batch``; the mean loss is ``loss sum / sums["count"]``.

    ``sums`` holds the aggregation's ``count`` and ``pg`` sum, and token sums
    (``tokens``, ``clipped``, ``entropy``, ``kl``) plus ``mismatch``, the max
    |logp - old_logp| over response tokens. All sums add over disjoint batches;
    ``mismatch`` combines by max.
    """
    logp, entropy = token_logprobs(model, batch.tokens, batch.positions, cfg.temperature)
    seq = batch.tokens.shape[1]
    mask = batch.loss_mask.astype(jnp.float32) * (jnp.arange(seq) > 0)
    adv = jnp.broadcast_to(batch.advantages[:, None].astype(jnp.float32), logp.shape)
    pg_tok, clipped = POLICY_LOSSES[cfg.policy_loss](logp, batch.old_logp, adv, cfg)
    loss_tok = pg_tok
    if cfg.kl_coef > 0:
        if batch.ref_logp is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} needs batch.ref_logp (reference log-probs); or set kl_coef=0")
        loss_tok = loss_tok + cfg.kl_coef * KL_PENALTIES[cfg.kl_kind](logp, batch.ref_logp)
        kl_tok = kl_k3(logp, batch.ref_logp)
    else:
        kl_tok = batch.old_logp - logp  # k1 estimate of KL(π_old ‖ π) on the rollout's own tokens
    aggregate = functools.partial(LOSS_AGGREGATIONS[cfg.aggregation], max_len=cfg.max_len or seq)
    loss_sum, count = aggregate(loss_tok, mask)
    pg_sum, _ = aggregate(pg_tok, mask)
    sg = jax.lax.stop_gradient
    sums = {
        "count": count,
        "pg": sg(pg_sum),
        "tokens": jnp.sum(mask),
        "clipped": jnp.sum(clipped * mask),
        "entropy": jnp.sum(sg(entropy) * mask),
        "kl": jnp.sum(sg(kl_tok) * mask),
        "mismatch": jnp.max(jnp.abs(sg(logp) - batch.old_logp) * mask),
    }
    return loss_sum, sums


def _micro_split(x: Array, m: int) -> Array:
    # Strided rows (i, i + m, ...) per micro-batch: a batch sharded over devices by rows
    # keeps every micro-batch spread over all of them.
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


_SUM_KEYS = ("count", "pg", "tokens", "clipped", "entropy", "kl", "mismatch", "loss")


def _grad_sums(state: TrainState, batch: GRPOBatch, loss_cfg: LossConfig):
    """(gradient of the loss sum, sums incl. ``loss``) of one micro-batch at ``state.params``."""

    def loss_fn(params):
        return grpo_loss(nnx.merge(state.graphdef, params), batch, loss_cfg)

    (loss_sum, s), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return g, {**s, "loss": jax.lax.stop_gradient(loss_sum)}


def _add_sums(a: dict, b: dict) -> dict:
    return {k: jnp.maximum(a[k], b[k]) if k == "mismatch" else a[k] + b[k] for k in _SUM_KEYS}


def _apply(state: TrainState, grads, sums) -> tuple[TrainState, dict[str, Float[Array, ""]]]:
    """The optimiser step on accumulated loss-sum gradients: divided by the total count once."""
    n_agg, n_tok = jnp.maximum(sums["count"], 1.0), jnp.maximum(sums["tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / n_agg, grads)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": sums["loss"] / n_agg,
        "pg_loss": sums["pg"] / n_agg,
        "kl": sums["kl"] / n_tok,
        "clip_fraction": sums["clipped"] / n_tok,
        "entropy": sums["entropy"] / n_tok,
        "grad_norm": optax.tree.norm(grads),
        "logp_mismatch_max": sums["mismatch"],
        "tokens": sums["tokens"],
    }
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


@functools.partial(jax.jit, static_argnames=("loss_cfg", "micro_batches"), donate_argnums=(0,))
def grpo_update(
    state: TrainState, batch: GRPOBatch, loss_cfg: LossConfig, micro_batches: int = 1
) -> tuple[TrainState, dict[str, Float[Array, ""]]]:
    """One optimiser step on the mean `grpo_loss` of ``batch``; ``state`` is donated.

    The batch is cut into ``micro_batches`` equal parts (it must divide the batch)
    run one after another under `lax.scan`; gradients of the loss *sums* add up
    and are divided by the total count once, so the step equals the full-batch
    step for any ``micro_batches``. All log-probs come from the parameters before
    the update: ``logp_mismatch_max`` ≈ 0 checks that on-policy ``old_logp`` matches.
    Micro-batches of different widths: `grpo_accumulate` and `grpo_apply`.
    """
    b = batch.tokens.shape[0]
    if micro_batches < 1 or b % micro_batches:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1 and divide the batch size {b}")
    micro = jax.tree.map(lambda x: _micro_split(x, micro_batches), batch)

    def body(carry, mb):
        grads, sums = carry
        g, s = _grad_sums(state, mb, loss_cfg)
        return (jax.tree.map(jnp.add, grads, g), _add_sums(sums, s)), None

    zero = jnp.zeros((), jnp.float32)
    init = (jax.tree.map(jnp.zeros_like, state.params), dict.fromkeys(_SUM_KEYS, zero))
    (grads, sums), _ = jax.lax.scan(body, init, micro)
    return _apply(state, grads, sums)


GradSums = tuple[Any, dict[str, Float[Array, ""]]]
"""Accumulated (gradient of the loss sums, sums) of the micro-batches seen so far (`grpo_accumulate`)."""


@functools.partial(jax.jit, static_argnames=("loss_cfg",), donate_argnums=(0,))
def grpo_accumulate(acc: GradSums | None, state: TrainState, batch: GRPOBatch, loss_cfg: LossConfig) -> GradSums:
    """``acc`` plus the loss-sum gradient and sums of one micro-batch (``acc`` None: the first; donated).

    With `grpo_apply` this splits `grpo_update` so that micro-batches may have different widths: a
    trainer sorts its rows by length and pads each micro-batch only to its own longest row. The
    step is the same full-batch step (up to float summation order), whatever the widths.
    """
    g, s = _grad_sums(state, batch, loss_cfg)
    if acc is None:
        return g, s
    grads, sums = acc
    return jax.tree.map(jnp.add, grads, g), _add_sums(sums, s)


@functools.partial(jax.jit, donate_argnums=(0,))
def grpo_apply(state: TrainState, acc: GradSums) -> tuple[TrainState, dict[str, Float[Array, ""]]]:
    """The optimiser step on what `grpo_accumulate` gathered; ``state`` is donated.

    Metrics as `grpo_update`'s.
    """
    return _apply(state, *acc)
