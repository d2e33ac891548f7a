"""The EAGLE-style drafter: model, loss and pure update step (`train`), offline training job (`offline`)."""

from tltjax.drafter.model import (
    Drafter,
    DrafterConfig,
    DrafterOutput,
    drafter_forward,
    load_drafter,
    pair_inputs,
    save_drafter,
)
from tltjax.drafter.train import DrafterBatch, DrafterTrainState, drafter_loss, make_update, train_drafter

__all__ = [
    "DrafterBatch",
    "DrafterTrainState",
    "drafter_loss",
    "make_update",
    "train_drafter",
    "Drafter",
    "DrafterConfig",
    "DrafterOutput",
    "drafter_forward",
    "load_drafter",
    "pair_inputs",
    "save_drafter",
]
