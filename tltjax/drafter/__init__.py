"""The EAGLE-style drafter.

- `model`: the one-layer `Drafter` over the target's live embedding and LM head,
  its `DrafterConfig`, input alignment (`pair_inputs`) and save/load.
- `train`: `drafter_loss` (hidden-state regression plus cross-entropy against
  the target's own distribution, optionally unrolled over the drafter's own
  predictions), the pure jitted `drafter_update` that takes the current
  target's parameters each call (dense or packed batches, data parallel via
  `shard_for_update`), `target_features`, and the
  offline loop `train_drafter` with `evaluate` (top-1 agreement with the target).
- `buffer`: `DrafterBuffer`, a bounded ring of the target features that rollouts
  harvest (tagged by RL step), sampled as windows for online training.
- `packing`: `pack_windows` packs windows several to a row
  (`PackedDrafterBatch`: segment ids, per-window positions) for `drafter_update`.
- `export`: `export_eagle` / `import_eagle`, the EAGLE-1 checkpoint layout that SGLang and vLLM
  load (``python -m tltjax.drafter.export``; not imported here).
- `offline`: the ``train_drafter`` job: sample the tiny policy on its task,
  train a drafter on the samples, measure agreement before and after, cache it.
"""

from tltjax.drafter.buffer import DrafterBuffer
from tltjax.drafter.model import (
    Drafter,
    DrafterConfig,
    DrafterOutput,
    drafter_forward,
    feature_from_hidden,
    load_drafter,
    pair_inputs,
    save_drafter,
)
from tltjax.drafter.packing import PackedDrafterBatch, Window, pack_windows
from tltjax.drafter.train import (
    DrafterBatch,
    DrafterTrainState,
    drafter_loss,
    drafter_update,
    evaluate,
    make_batch,
    shard_for_update,
    target_features,
    train_drafter,
)

__all__ = [
    "Drafter",
    "DrafterBatch",
    "DrafterBuffer",
    "DrafterConfig",
    "DrafterOutput",
    "DrafterTrainState",
    "PackedDrafterBatch",
    "Window",
    "drafter_forward",
    "drafter_loss",
    "drafter_update",
    "evaluate",
    "feature_from_hidden",
    "load_drafter",
    "make_batch",
    "pack_windows",
    "pair_inputs",
    "save_drafter",
    "shard_for_update",
    "target_features",
    "train_drafter",
]
