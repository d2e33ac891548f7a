"""Training the EAGLE drafter: the loss, a pure jitted update step, and a simple offline loop.

What the drafter learns. At every valid drafter position ``t`` (see
`tltjax.drafter.model` for the alignment) it is trained on two targets taken
from the target model run on the same sequence:

- regression: its hidden output onto the target's final normed hidden state
  ``h_{t+1}`` (smooth L1, averaged over the hidden axis), as EAGLE;
- distillation: cross-entropy of its logits against the target's distribution
  of ``x_{t+2}``, ``softmax(z_{t+1})`` with ``z`` the target's logits. Soft
  labels from the policy itself, not the sampled token: the drafter learns to
  agree with the policy, which is what speculative acceptance rewards.

Two kinds of batch feed the one update step:

- `DrafterBatch`: whole sequences with what a target forward pass computed at
  each position (`make_batch` runs that pass; offline training).
- `tltjax.drafter.packing.PackedDrafterBatch`: windows of the features the
  rollout itself harvested (`tltjax.drafter.buffer.DrafterBuffer`), packed
  several to a row; no target forward at all. ``h_{t+1}`` is stored (or is a
  slot of the features) and the target's logits are its live LM head applied to
  ``h_{t+1}`` inside the jitted step. Attention and RoPE positions stay inside
  each window (``segment_ids``, ``positions``).

Losses are sums over valid positions with their count, so micro-batches add up
exactly. The loss per position is ``feat_weight`` × smooth L1 + ``ce_weight`` ×
cross-entropy. With ``unroll_steps = k > 1`` (EAGLE-3's "training-time test")
the drafter is run k times, each time on its own previous predictions as
features, and the k losses add up (see `drafter_loss`).

Data parallel. `drafter_update` is an ordinary jitted function: give it a batch
sharded over the rows on any mesh and replicated state (`shard_for_update`), and
XLA splits the work and all-reduces the gradients; the result equals the
single-device step up to float rounding.

Live target. `drafter_update` takes the target's parameters as an argument, not
as a captured constant: the drafter reads the target's embedding and LM head,
so an online trainer calls the one compiled step with the current policy's
parameters after every RL update. Only the drafter's parameters get gradients.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from tltjax import sft
from tltjax.data import segment_mask
from tltjax.drafter.model import Drafter, DrafterConfig, feature_from_hidden, pair_inputs
from tltjax.drafter.packing import PackedDrafterBatch
from tltjax.models.transformer import CausalLM

METRICS = ("reg", "ce", "top1")  # per-position metric sums that `drafter_loss` returns


@struct.dataclass
class DrafterBatch:
    """Target sequences and the target's outputs at every position ``t``.

    ``mask[:, t]``: token ``t`` is real (not padding). ``features[:, t]`` is the
    feature ``f_t`` (hidden layers `DrafterConfig.feature_layers`, concatenated),
    ``hidden[:, t]`` the final normed hidden state ``h_t`` and ``logits[:, t]``
    the target's logits ``z_t`` (its distribution of token ``t + 1``).
    """

    ids: Int[Array, "batch seq"]
    mask: Bool[Array, "batch seq"]
    features: Float[Array, "batch seq feature"]
    hidden: Float[Array, "batch seq hidden"]
    logits: Float[Array, "batch seq vocab"]

    def aligned(
        self,
    ) -> tuple[
        Int[Array, "batch seq1"],
        Float[Array, "batch seq1 feature"],
        Float[Array, "batch seq1 hidden"],
        Float[Array, "batch seq1 vocab"],
        Bool[Array, "batch seq1"],
    ]:
        """`drafter_loss`'s inputs: (``x_{t+1}``, ``f_t``, ``h_{t+1}``, ``z_{t+1}``, valid) for t = 0..seq-2.

        Position ``t`` is valid when tokens ``t`` and ``t + 1`` are both real.
        """
        tokens, features = pair_inputs(self.ids, self.features)
        valid = self.mask[:, 1:] & self.mask[:, :-1]
        return tokens, features, self.hidden[:, 1:], self.logits[:, 1:], valid


def drafter_loss(
    drafter: Drafter,
    target: CausalLM,
    tokens: Int[Array, "batch seq"],
    features: Float[Array, "batch seq feature"],
    target_hidden: Float[Array, "batch seq hidden"],
    target_logits: Float[Array, "batch seq vocab"] | None,
    mask: Bool[Array, "batch seq"],
    *,
    ce_weight: float = 0.1,
    feat_weight: float = 1.0,
    positions: Int[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    unroll_steps: int = 1,
) -> tuple[Float[Array, ""], Float[Array, ""], dict[str, Float[Array, ""]]]:
    """(loss sum, valid-position count, metric sums) of the drafter on aligned inputs.

    Inputs at drafter position ``t``, as `DrafterBatch.aligned` or
    `PackedDrafterBatch.aligned` return them: token ``x_{t+1}``, feature ``f_t``,
    the target's ``h_{t+1}`` and logits ``z_{t+1}`` (None: the target's LM head
    on ``h_{t+1}``), and whether ``t`` counts. Loss per position:
    ``feat_weight`` × smooth L1 of the drafter's hidden output against ``h_{t+1}``
    (mean over the hidden axis) plus ``ce_weight`` × cross-entropy of its logits
    against ``softmax(z_{t+1})``. Metric sums: ``reg`` and ``ce`` (the unweighted
    terms) and ``top1`` (positions where the drafter's argmax equals the
    target's: the acceptance proxy). Everything is summed over valid positions,
    so sums over micro-batches equal the sum over their union; divide by the
    count for means. The target's outputs get no gradient.

    Packed rows: ``segment_ids`` (0 = padding) restrict attention to causal *and*
    same segment (`tltjax.data.segment_mask`, as packed SFT), and ``positions``
    are the RoPE positions (default 0..seq-1).

    ``unroll_steps = k > 1``: after step 0 (the plain loss), step ``j`` feeds
    the drafter, at position ``t``, its own step ``j - 1`` prediction from
    ``t - 1`` (a prediction of ``h_t``, as `feature_from_hidden`) in place of
    ``f_t``, with the same tokens and targets; where ``t - 1`` lies in another
    segment (or ``t = 0``) the true ``f_t`` stays. Position ``t`` counts at step
    ``j`` if it counts at step 0 and ``t - 1`` counted at step ``j - 1``. The k
    sums and counts add up; gradients flow through the fed-back predictions.
    """
    if unroll_steps < 1:
        raise ValueError(f"unroll_steps={unroll_steps} must be >= 1")
    b, t = tokens.shape
    attention = None if segment_ids is None else segment_mask(segment_ids)
    target_hidden = jax.lax.stop_gradient(target_hidden)
    if target_logits is None:
        target_logits = target.logits_from_hidden(target_hidden.astype(target.config.jnp_dtype))
    target_logits = jax.lax.stop_gradient(target_logits).astype(jnp.float32)
    target_hidden = target_hidden.astype(jnp.float32)
    target_probs = jax.nn.softmax(target_logits, axis=-1)
    target_top1 = jnp.argmax(target_logits, -1)
    if segment_ids is None:
        has_prev = jnp.broadcast_to(jnp.arange(t) >= 1, (b, t))
    else:
        same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
        has_prev = jnp.concatenate([jnp.zeros((b, 1), bool), same], axis=1)

    loss = count = jnp.zeros((), jnp.float32)
    sums = {k: jnp.zeros((), jnp.float32) for k in METRICS}
    step_features, step_valid = features, mask
    for step in range(unroll_steps):
        out = drafter(target, tokens, step_features, positions=positions, mask=attention)
        m = step_valid.astype(jnp.float32)
        reg = optax.losses.huber_loss(out.hidden.astype(jnp.float32), target_hidden, delta=1.0).mean(-1)  # smooth L1
        ce = optax.losses.softmax_cross_entropy(out.logits, target_probs)
        top1 = (jnp.argmax(out.logits, -1) == target_top1).astype(jnp.float32)
        loss = loss + jnp.sum(m * (feat_weight * reg + ce_weight * ce))
        count = count + jnp.sum(m)
        for k, v in (("reg", reg), ("ce", ce), ("top1", top1)):
            sums[k] = sums[k] + jnp.sum(m * v)
        if step + 1 < unroll_steps:
            fed = feature_from_hidden(out.hidden, features.shape[-1]).astype(features.dtype)
            fed = jnp.concatenate([jnp.zeros_like(fed[:, :1]), fed[:, :-1]], axis=1)  # prediction from t-1 at t
            step_features = jnp.where(has_prev[..., None], fed, features)
            step_valid = mask & jnp.concatenate([jnp.zeros((b, 1), bool), step_valid[:, :-1]], axis=1)
    return loss, count, sums


@struct.dataclass
class DrafterTrainState:
    """Everything `drafter_update` reads and writes.

    ``params`` and ``opt_state`` are the drafter's; the graph definitions of the
    drafter and of its target, the optimiser ``tx`` and the loss settings
    (``ce_weight``, ``feat_weight``, ``unroll_steps``; see `drafter_loss`) are
    static. The target's parameters are not part of the state: each update takes them.
    """

    graphdef: Any = struct.field(pytree_node=False)
    target_graphdef: Any = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    ce_weight: float = struct.field(pytree_node=False)
    feat_weight: float = struct.field(pytree_node=False)
    unroll_steps: int = struct.field(pytree_node=False)
    params: nnx.State
    opt_state: optax.OptState
    step: Int[Array, ""]

    @classmethod
    def create(
        cls,
        drafter: Drafter,
        target: CausalLM,
        tx: optax.GradientTransformation,
        *,
        ce_weight: float = 0.1,
        feat_weight: float = 1.0,
        unroll_steps: int = 1,
    ) -> "DrafterTrainState":
        """A fresh state for training ``drafter`` against ``target``.

        The parameters are copied: `drafter_update` donates the state, and
        ``drafter`` stays usable.
        """
        drafter.config.check_target(target.config)
        problems = [
            msg
            for bad, msg in (
                (not ce_weight >= 0, f"ce_weight must be >= 0, got {ce_weight}"),
                (not feat_weight >= 0, f"feat_weight must be >= 0, got {feat_weight}"),
                (int(unroll_steps) != unroll_steps or unroll_steps < 1,
                 f"unroll_steps must be an integer >= 1 (1 = off), got {unroll_steps}"),
            )
            if bad
        ]
        if problems:
            raise ValueError("DrafterTrainState: " + "; ".join(problems))
        graphdef, params = nnx.split(drafter, nnx.Param)
        params = jax.tree.map(jnp.copy, params)
        return cls(
            graphdef=graphdef,
            target_graphdef=nnx.graphdef(target),
            tx=tx,
            ce_weight=float(ce_weight),
            feat_weight=float(feat_weight),
            unroll_steps=int(unroll_steps),
            params=params,
            opt_state=tx.init(params),
            step=jnp.zeros((), jnp.int32),
        )

    def drafter(self) -> Drafter:
        """A `Drafter` holding this state's parameters."""
        return nnx.merge(self.graphdef, self.params)


@functools.partial(jax.jit, donate_argnums=(0,))
def drafter_update(
    state: DrafterTrainState, target_params: nnx.State, batch: DrafterBatch | PackedDrafterBatch
) -> tuple[DrafterTrainState, dict[str, Float[Array, ""]]]:
    """One optimiser step of the drafter on the mean loss over ``batch``'s valid positions.

    ``batch`` is a `DrafterBatch` (target outputs computed by `make_batch`) or a
    `PackedDrafterBatch` of harvested features (target logits from the live LM
    head on ``h``; attention within windows). ``target_params`` is
    ``nnx.state(target)`` of the current policy: an input of the compiled step,
    so a new policy reuses it (one compilation per batch type and shape), and
    never differentiated, so the target is not updated. ``state`` is donated.
    Sharded inputs (`shard_for_update`) make it a data-parallel step. Metrics are
    means over valid positions (summed over unrolled steps), plus ``positions``
    and ``grad_norm``.
    """
    target = nnx.merge(state.target_graphdef, jax.lax.stop_gradient(target_params))
    if isinstance(batch, PackedDrafterBatch):
        config = nnx.merge(state.graphdef, state.params).config
        inputs, layout = batch.aligned(config, target.config.num_hidden_layers), batch.layout()
    else:
        inputs, layout = batch.aligned(), {}
    settings = dict(ce_weight=state.ce_weight, feat_weight=state.feat_weight, unroll_steps=state.unroll_steps)

    def loss_fn(params):
        total, count, sums = drafter_loss(nnx.merge(state.graphdef, params), target, *inputs, **settings, **layout)
        return total / jnp.maximum(count, 1.0), (count, sums)

    (loss, (count, sums)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    n = jnp.maximum(count, 1.0)
    metrics = {"loss": loss, "positions": count, "grad_norm": optax.tree.norm(grads)}
    metrics.update({k: v / n for k, v in sums.items()})
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


def shard_for_update(
    mesh: Mesh, state: DrafterTrainState, target_params: nnx.State, batch: DrafterBatch | PackedDrafterBatch
) -> tuple[DrafterTrainState, nnx.State, DrafterBatch | PackedDrafterBatch]:
    """(state, target params, batch) placed for a data-parallel `drafter_update` on ``mesh``.

    The batch's rows are split over all of the mesh's devices (every axis, e.g. a
    1-D ``("data",)`` mesh of the idle devices); the drafter state and the
    target's parameters are replicated. Raises ``ValueError`` unless the row
    count is a multiple of the device count.
    """
    rows = batch.ids.shape[0]
    if rows % mesh.size:
        raise ValueError(
            f"a batch of {rows} rows cannot be split over the {mesh.size} devices of the mesh; "
            f"use a multiple of {mesh.size} rows"
        )
    rows_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    replicated = NamedSharding(mesh, P())
    return (
        jax.device_put(state, replicated),
        jax.device_put(target_params, replicated),
        jax.tree.map(lambda x: jax.device_put(x, rows_sharding), batch),
    )


@functools.partial(nnx.jit, static_argnames=("feature_layers",))
def _target_features(target: CausalLM, ids, feature_layers: tuple[int, ...]):
    n = target.config.num_hidden_layers
    layers = tuple(sorted(set(feature_layers) | {n}))
    out = target(ids, hidden_layers=layers)
    by_layer = dict(zip(layers, out.hidden_states))
    return jnp.concatenate([by_layer[i] for i in feature_layers], axis=-1), by_layer[n], out.logits


def target_features(
    target: CausalLM, ids: Int[Array, "batch seq"], feature_layers: Sequence[int]
) -> tuple[Float[Array, "batch seq feature"], Float[Array, "batch seq hidden"], Float[Array, "batch seq vocab"]]:
    """(features, final normed hidden states, logits) of one jitted target forward on ``ids``.

    ``features`` concatenates the hidden layers ``feature_layers`` (indexed as
    `CausalLM` does) in that order. Right padding does not change the outputs at
    real positions (causal attention).
    """
    layers = tuple(int(i) for i in feature_layers)
    n = target.config.num_hidden_layers
    if not layers or any(not 0 <= i <= n for i in layers):
        raise ValueError(f"feature_layers {layers} must be non-empty and lie in [0, {n}] for this target")
    return _target_features(target, jnp.asarray(ids, jnp.int32), layers)


def make_batch(
    target: CausalLM,
    sequences: Sequence[Sequence[int]],
    seq_len: int,
    feature_layers: Sequence[int],
    *,
    pad_id: int = 0,
) -> DrafterBatch:
    """A `DrafterBatch` of ``sequences``, each cut to its first ``seq_len`` tokens and right-padded.

    One row per sequence (an empty sequence gives an all-padding row, which
    counts for nothing); the target's outputs come from `target_features`.
    """
    ids = np.full((len(sequences), seq_len), pad_id, np.int32)
    mask = np.zeros((len(sequences), seq_len), bool)
    for i, s in enumerate(sequences):
        s = np.asarray(s, np.int32)[:seq_len]
        ids[i, : len(s)] = s
        mask[i, : len(s)] = True
    vocab = target.config.vocab_size
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab}); got ids in [{ids.min()}, {ids.max()}]")
    features, hidden, logits = target_features(target, ids, feature_layers)
    return DrafterBatch(ids=jnp.asarray(ids), mask=jnp.asarray(mask), features=features, hidden=hidden, logits=logits)


@functools.partial(nnx.jit, static_argnames=("ce_weight",))
def _loss_on_batch(drafter: Drafter, target: CausalLM, batch: DrafterBatch, ce_weight: float):
    return drafter_loss(drafter, target, *batch.aligned(), ce_weight=ce_weight)


def evaluate(
    drafter: Drafter,
    target: CausalLM,
    sequences: Sequence[Sequence[int]],
    *,
    seq_len: int,
    batch_size: int = 16,
    ce_weight: float = 0.1,
) -> dict[str, float]:
    """Means over every valid position of ``sequences`` (cut to ``seq_len``): top-1 agreement and losses.

    Returns ``top1`` (fraction of positions where the drafter's argmax equals the
    target's), ``loss``, ``reg``, ``ce`` and ``positions`` (how many counted).
    Batches have a fixed shape (the last is padded with empty rows), so this
    compiles once per ``(batch_size, seq_len)``.
    """
    if batch_size < 1 or seq_len < 2:
        raise ValueError(f"evaluate needs batch_size >= 1 and seq_len >= 2; got {batch_size}, {seq_len}")
    totals = dict.fromkeys(("loss", "count", *METRICS), 0.0)
    for i in range(0, len(sequences), batch_size):
        chunk = list(sequences[i : i + batch_size])
        chunk += [[]] * (batch_size - len(chunk))
        batch = make_batch(target, chunk, seq_len, drafter.config.feature_layers)
        loss, count, sums = jax.device_get(_loss_on_batch(drafter, target, batch, float(ce_weight)))
        totals["loss"] += float(loss)
        totals["count"] += float(count)
        for k in METRICS:
            totals[k] += float(sums[k])
    n = max(totals["count"], 1.0)
    return {"top1": totals["top1"] / n, "loss": totals["loss"] / n, "reg": totals["reg"] / n,
            "ce": totals["ce"] / n, "positions": int(totals["count"])}


def batch_order(num_sequences: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """``[steps, batch_size]`` sequence indices: epochs of fresh permutations, read in order."""
    rng = np.random.default_rng(seed)
    need = steps * batch_size
    epochs = -(-need // num_sequences)
    return np.concatenate([rng.permutation(num_sequences) for _ in range(epochs)])[:need].reshape(steps, batch_size)


def train_drafter(
    target: CausalLM,
    drafter_config: DrafterConfig,
    sequences: Sequence[Sequence[int]],
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    seed: int = 0,
    warmup_steps: int = 20,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    ce_weight: float = 0.1,
    log_every: int = 10,
    progress: bool = True,
) -> tuple[Drafter, list[dict[str, float]]]:
    """A new drafter trained on ``target``'s outputs over ``sequences``; also the logged metrics.

    ``sequences`` are token ids (e.g. prompt + sampled response), of any length:
    each is cut to ``seq_len`` and padded. Every step takes ``batch_size`` of them
    (epochs of shuffled order), runs the frozen target once (`make_batch`) and
    applies `drafter_update` (AdamW, warm-up then cosine decay, as
    `tltjax.sft.make_optimizer`). Deterministic from ``seed`` (initial weights and
    batch order). ``history`` has one entry per ``log_every`` steps with the
    metrics averaged over those steps.
    """
    problems = [
        msg
        for bad, msg in (
            (steps < 1, f"steps={steps} must be >= 1"),
            (batch_size < 1, f"batch_size={batch_size} must be >= 1"),
            (seq_len < 2, f"seq_len={seq_len} must be >= 2 (a drafter position needs two tokens)"),
            (not lr > 0, f"lr={lr} must be > 0"),
            (log_every < 1, f"log_every={log_every} must be >= 1"),
            (not any(len(s) >= 2 for s in sequences), f"none of the {len(sequences)} sequences has 2 or more tokens"),
        )
        if bad
    ]
    if problems:
        raise ValueError("train_drafter: " + "; ".join(problems))
    from tqdm.auto import tqdm

    drafter = Drafter(drafter_config, rngs=nnx.Rngs(seed))
    tx = sft.make_optimizer(lr, steps, warmup_steps, weight_decay, grad_clip)
    state = DrafterTrainState.create(drafter, target, tx, ce_weight=ce_weight)
    target_params = nnx.state(target)
    order = batch_order(len(sequences), batch_size, steps, seed)
    history: list[dict[str, float]] = []
    pending: list[dict[str, jax.Array]] = []
    bar = tqdm(total=steps, desc="drafter", disable=not progress, dynamic_ncols=True)
    for step in range(steps):
        batch = make_batch(target, [sequences[i] for i in order[step]], seq_len, drafter_config.feature_layers)
        state, metrics = drafter_update(state, target_params, batch)
        pending.append(metrics)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            got = jax.device_get(pending)
            entry = {k: float(np.mean([g[k] for g in got])) for k in got[0]}
            entry["step"] = step + 1
            history.append(entry)
            pending = []
            bar.set_postfix(loss=f"{entry['loss']:.3f}", top1=f"{entry['top1']:.2f}")
        bar.update(1)
    bar.close()
    return state.drafter(), history
