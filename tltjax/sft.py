"""Supervised fine-tuning: a pure jitted train step and the loop that feeds it.

`sft_step(state, batch)` is a pure function of pytrees (parameters, optimiser
state, step) that donates its state; `train` only moves batches and logs.
The loss returns (sum, count) so micro-batches and accumulation stay exact.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jaxtyping import Array, Float, Int

from tltjax.data import segment_mask
from tltjax.models.transformer import CausalLM


@struct.dataclass
class TrainState:
    """Everything a train step reads and writes; ``graphdef`` and ``tx`` are static."""

    graphdef: Any = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    params: Any
    opt_state: Any
    step: jax.Array

    @classmethod
    def create(cls, model: nnx.Module, tx: optax.GradientTransformation) -> "TrainState":
        graphdef, params = nnx.split(model, nnx.Param)
        return cls(graphdef=graphdef, tx=tx, params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32))

    def model(self) -> CausalLM:
        return nnx.merge(self.graphdef, self.params)


def next_token_loss(
    model: CausalLM,
    tokens: Int[Array, "batch seq"],
    loss_mask: Float[Array, "batch seq"],
    segment_ids: Int[Array, "batch seq"] | None = None,
    positions: Int[Array, "batch seq"] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Cross-entropy of predicting ``tokens[t]`` from ``tokens[:t]`` where ``loss_mask[t] == 1``.

    With ``segment_ids`` (packed rows), attention and positions stay inside each
    segment. Returns (sum of token losses, number of target tokens).
    """
    mask = None if segment_ids is None else segment_mask(segment_ids[:, :-1])
    pos = None if positions is None else positions[:, :-1]
    logits = model(tokens[:, :-1], mask=mask, positions=pos).logits
    logp = jax.nn.log_softmax(logits, axis=-1)
    tok_lp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mask = loss_mask[:, 1:]
    return -jnp.sum(tok_lp * mask), jnp.sum(mask)


def make_optimizer(
    lr: float, steps: int, warmup_steps: int = 0, weight_decay: float = 0.0, grad_clip: float = 1.0
) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay to 10% of ``lr``, after global-norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(warmup_steps, 1), max(steps, warmup_steps + 1), end_value=0.1 * lr
    )
    return optax.chain(optax.clip_by_global_norm(grad_clip), optax.adamw(schedule, b2=0.98, weight_decay=weight_decay))


@functools.partial(jax.jit, donate_argnums=(0,))
def sft_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimiser step on the mean token loss of ``batch`` (``tokens``, ``loss_mask``)."""

    def loss_fn(params):
        total, count = next_token_loss(
            nnx.merge(state.graphdef, params),
            batch["tokens"],
            batch["loss_mask"],
            batch.get("segment_ids"),
            batch.get("positions"),
        )
        return total / jnp.maximum(count, 1.0), count

    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "tokens": count, "grad_norm": optax.tree.norm(grads)}
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


@dataclasses.dataclass
class TrainLog:
    step: int
    loss: float
    grad_norm: float
    tokens_per_s: float


def train(
    state: TrainState,
    batches: Iterable[dict[str, np.ndarray]],
    steps: int,
    *,
    log_every: int = 50,
    on_log: Callable[[TrainLog], None] | None = None,
    progress: bool = True,
) -> TrainState:
    """Runs ``steps`` SFT steps; logs averaged metrics every ``log_every`` steps."""
    from tqdm.auto import tqdm

    it = iter(batches)
    bar = tqdm(total=steps, desc="sft", disable=not progress, dynamic_ncols=True)
    pending: list[dict[str, jax.Array]] = []
    t0 = time.perf_counter()
    for i in range(steps):
        try:
            batch = next(it)
        except StopIteration:
            raise ValueError(f"the batch iterator ran out after {i} of {steps} steps; use more data or epochs") from None
        state, m = sft_step(state, {k: jnp.asarray(v) for k, v in batch.items()})
        pending.append(m)
        if (i + 1) % log_every == 0 or i + 1 == steps:
            got = jax.device_get(pending)
            dt = time.perf_counter() - t0
            log = TrainLog(
                step=i + 1,
                loss=float(np.mean([g["loss"] for g in got])),
                grad_norm=float(np.mean([g["grad_norm"] for g in got])),
                tokens_per_s=float(sum(g["tokens"] for g in got)) / max(dt, 1e-9),
            )
            pending, t0 = [], time.perf_counter()
            bar.set_postfix(loss=f"{log.loss:.3f}")
            if on_log:
                on_log(log)
        bar.update(1)
    bar.close()
    return state
