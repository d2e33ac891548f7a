"""Training the EAGLE drafter: loss, a pure jitted update step, and a simple offline loop.

Batch layout (`DrafterBatch`): sequences ``ids [B, T]`` with the target's
features ``features[:, t] = f_t`` and final normed hidden states
``hidden[:, t] = h_t`` at every position; ``mask[:, t]`` marks positions whose
next token exists (``t + 1 < length``). The drafter pairs ``f_t`` with
``x_{t+1}`` and is trained at every valid ``t`` to predict ``h_{t+1}``
(regression) and the target's distribution of ``x_{t+2}`` (cross-entropy
against ``softmax(head(h_{t+1}))``: soft labels from the policy itself, so the
drafter learns to agree with the policy, which is what acceptance rewards).

The update takes the target's parameters as an input, not a constant: the
drafter reads the target's live embedding and LM head, and an online trainer
calls the same compiled step with each new policy. The target gets no gradient.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from tltjax.drafter.model import Drafter


@struct.dataclass
class DrafterBatch:
    """Sequences and the target's per-position features / final hidden states (see module docstring)."""

    ids: Int[Array, "batch seq"]
    features: Float[Array, "batch seq feature"]
    hidden: Float[Array, "batch seq hidden"]
    mask: Bool[Array, "batch seq"]


@struct.dataclass
class DrafterTrainState:
    """Drafter parameters, optimizer state and step count: a pytree the update donates and returns."""

    params: nnx.State
    opt_state: optax.OptState
    step: Int[Array, ""]


def drafter_loss(drafter: Drafter, target, batch: DrafterBatch, *, ce_weight: float = 0.1):
    """(loss sum, count, metric sums) over the valid positions of ``batch``.

    Loss per position: smooth-L1 between the drafter's hidden output and
    ``h_{t+1}`` (mean over features) + ``ce_weight`` × cross-entropy of the
    drafter's logits against the target's distribution at ``t + 1``. Sums, so
    micro-batches add up exactly; divide by the count for the mean.
    """
    out = drafter(target, batch.ids[:, 1:], batch.features[:, :-1])
    tgt_h = jax.lax.stop_gradient(batch.hidden[:, 1:]).astype(jnp.float32)
    m = batch.mask[:, :-1].astype(jnp.float32)
    diff = out.hidden.astype(jnp.float32) - tgt_h
    ad = jnp.abs(diff)
    reg = jnp.where(ad < 1.0, 0.5 * diff * diff, ad - 0.5).mean(-1)
    tgt_logits = jax.lax.stop_gradient(target.logits_from_hidden(tgt_h.astype(target.config.jnp_dtype)))
    p_tgt = jax.nn.softmax(tgt_logits, axis=-1)
    logq = jax.nn.log_softmax(out.logits, axis=-1)
    ce = -(p_tgt * logq).sum(-1)
    agree = (jnp.argmax(out.logits, -1) == jnp.argmax(tgt_logits, -1)).astype(jnp.float32)
    loss = (m * (reg + ce_weight * ce)).sum()
    metrics = dict(reg=(m * reg).sum(), ce=(m * ce).sum(), top1=(m * agree).sum())
    return loss, m.sum(), metrics


def make_optimizer(lr: float, warmup: int, steps: int, weight_decay: float = 0.0, clip: float = 1.0):
    """AdamW with linear warm-up and cosine decay, after global-norm clipping."""
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1), lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(sched, weight_decay=weight_decay))


def init_state(drafter: Drafter, optimizer) -> DrafterTrainState:
    params = nnx.state(drafter)
    return DrafterTrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))


def _update(drafter_graph, target_graph, optimizer, ce_weight, state: DrafterTrainState, target_params, batch):
    target = nnx.merge(target_graph, target_params)

    def loss_fn(params):
        drafter = nnx.merge(drafter_graph, params)
        loss, count, metrics = drafter_loss(drafter, target, batch, ce_weight=ce_weight)
        return loss / jnp.maximum(count, 1.0), (count, metrics)

    (loss, (count, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    n = jnp.maximum(count, 1.0)
    out = dict(loss=loss, count=count, grad_norm=optax.tree.norm(grads), **{k: v / n for k, v in metrics.items()})
    return DrafterTrainState(params=params, opt_state=opt_state, step=state.step + 1), out


def make_update(drafter: Drafter, target, optimizer, *, ce_weight: float = 0.1):
    """The pure jitted ``drafter_update(state, target_params, batch) -> (state, metrics)`` for these modules.

    Compiled once per batch shape; ``state`` is donated. ``target_params`` is
    ``nnx.state(target)`` of the current policy.
    """
    dgraph = nnx.graphdef(drafter)
    tgraph = nnx.graphdef(target)
    fn = functools.partial(_update, dgraph, tgraph, optimizer, ce_weight)
    return jax.jit(fn, donate_argnums=(0,))


def merge_params(drafter: Drafter, state: DrafterTrainState) -> None:
    """Writes the trained parameters back into ``drafter`` (in place)."""
    nnx.update(drafter, state.params)


@functools.partial(nnx.jit, static_argnames=("feature_layers",))
def target_features(target, ids: Int[Array, "batch seq"], feature_layers: tuple[int, ...]):
    """(features ``[B, T, F]``, final normed hidden ``[B, T, H]``) of the target on ``ids``."""
    n = target.config.num_hidden_layers
    layers = tuple(sorted(set(feature_layers) | {n}))
    out = target(ids, hidden_layers=layers, return_logits=False)
    by_layer = dict(zip(layers, out.hidden_states))
    return jnp.concatenate([by_layer[i] for i in feature_layers], axis=-1), by_layer[n]


def make_batch(target, sequences: Sequence[Sequence[int]], seq_len: int, feature_layers, pad_id: int = 0):
    """A `DrafterBatch` of ``sequences`` (cut to ``seq_len``, right-padded) with the target's features."""
    ids = np.full((len(sequences), seq_len), pad_id, np.int32)
    mask = np.zeros((len(sequences), seq_len), bool)
    for i, s in enumerate(sequences):
        s = list(s)[:seq_len]
        ids[i, : len(s)] = s
        mask[i, : max(len(s) - 1, 0)] = True
    feats, hidden = target_features(target, jnp.asarray(ids), tuple(feature_layers))
    return DrafterBatch(ids=jnp.asarray(ids), features=feats, hidden=hidden, mask=jnp.asarray(mask))


@functools.partial(nnx.jit, static_argnames=("ce_weight",))
def _eval(drafter, target, batch, ce_weight):
    return drafter_loss(drafter, target, batch, ce_weight=ce_weight)


def evaluate(drafter: Drafter, target, sequences, *, seq_len: int, batch_size: int = 32, ce_weight: float = 0.1):
    """Mean loss and top-1 agreement with the target's argmax over ``sequences`` (all valid positions)."""
    tot = dict(loss=0.0, count=0.0, top1=0.0, reg=0.0, ce=0.0)
    for i in range(0, len(sequences), batch_size):
        chunk = list(sequences[i : i + batch_size])
        chunk += [[0]] * (batch_size - len(chunk))  # fixed shape: pad with empty rows
        b = make_batch(target, chunk, seq_len, drafter.config.feature_layers)
        loss, count, m = _eval(drafter, target, b, ce_weight)
        tot["loss"] += float(loss)
        tot["count"] += float(count)
        for k in ("top1", "reg", "ce"):
            tot[k] += float(m[k])
    n = max(tot["count"], 1.0)
    return dict(loss=tot["loss"] / n, top1=tot["top1"] / n, reg=tot["reg"] / n, ce=tot["ce"] / n,
                positions=int(tot["count"]))


def train_drafter(
    drafter: Drafter,
    target,
    sequences: Sequence[Sequence[int]],
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    warmup: int = 20,
    ce_weight: float = 0.1,
    seed: int = 0,
    progress: bool = True,
    log_every: int = 50,
    log=print,
) -> list[dict]:
    """Trains ``drafter`` in place on the target's own sequences; returns the logged metrics.

    Deterministic from ``seed`` (batch order). Each step draws ``batch_size``
    sequences, computes the frozen target's features, and applies `make_update`'s step.
    """
    if steps < 1 or batch_size < 1 or seq_len < 2 or not sequences:
        raise ValueError(
            f"train_drafter needs steps >= 1, batch_size >= 1, seq_len >= 2 and sequences; got steps={steps}, "
            f"batch_size={batch_size}, seq_len={seq_len}, {len(sequences)} sequences"
        )
    from tqdm.auto import tqdm

    opt = make_optimizer(lr, warmup, steps)
    update = make_update(drafter, target, opt, ce_weight=ce_weight)
    state = init_state(drafter, opt)
    tparams = nnx.state(target)
    rng = np.random.default_rng(seed)
    history = []
    bar = tqdm(range(steps), desc="drafter", disable=not progress)
    for step in bar:
        pick = rng.choice(len(sequences), size=batch_size, replace=len(sequences) < batch_size)
        batch = make_batch(target, [sequences[i] for i in pick], seq_len, drafter.config.feature_layers)
        state, metrics = update(state, tparams, batch)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            m = {k: float(v) for k, v in metrics.items()}
            m["step"] = step + 1
            history.append(m)
            bar.set_postfix(loss=f"{m['loss']:.3f}", top1=f"{m['top1']:.2f}")
    merge_params(drafter, state)
    return history
