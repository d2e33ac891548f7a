"""The EAGLE-style drafter trained online: model (this package's core), loss and update step later."""

from tltjax.drafter.model import (
    Drafter,
    DrafterConfig,
    DrafterOutput,
    drafter_forward,
    load_drafter,
    pair_inputs,
    save_drafter,
)

__all__ = [
    "Drafter",
    "DrafterConfig",
    "DrafterOutput",
    "drafter_forward",
    "load_drafter",
    "pair_inputs",
    "save_drafter",
]
