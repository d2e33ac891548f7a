"""The EAGLE-style drafter.

- `model`: the one-layer `Drafter` over the target's live embedding and LM head,
  its `DrafterConfig`, input alignment (`pair_inputs`) and save/load.
- `train`: `drafter_loss` (hidden-state regression plus cross-entropy against
  the target's own distribution), the pure jitted `drafter_update` that takes
  the current target's parameters each call, `target_features`, and the
  offline loop `train_drafter` with `evaluate` (top-1 agreement with the target).
- `offline`: the ``train_drafter`` job: sample the tiny policy on its task,
  train a drafter on the samples, measure agreement before and after, cache it.
"""

from tltjax.drafter.model import (
    Drafter,
    DrafterConfig,
    DrafterOutput,
    drafter_forward,
    load_drafter,
    pair_inputs,
    save_drafter,
)
from tltjax.drafter.train import (
    DrafterBatch,
    DrafterTrainState,
    drafter_loss,
    drafter_update,
    evaluate,
    make_batch,
    target_features,
    train_drafter,
)

__all__ = [
    "Drafter",
    "DrafterBatch",
    "DrafterConfig",
    "DrafterOutput",
    "DrafterTrainState",
    "drafter_forward",
    "drafter_loss",
    "drafter_update",
    "evaluate",
    "load_drafter",
    "make_batch",
    "pair_inputs",
    "save_drafter",
    "target_features",
    "train_drafter",
]
