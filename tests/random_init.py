"""Deterministic random weights for tiny test models, filled from numpy.

Building shape-only (`nnx.eval_shape`) and filling from numpy avoids compiling
an init kernel per parameter shape. Norm weights are drawn near 1; every other
parameter with std ``scale``, which sets how decisive the logits are.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx


def fill(module, seed: int, scale: float):
    """Overwrites every parameter of ``module`` (in place) and returns it."""
    rng = np.random.RandomState(seed)
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        noise = rng.normal(size=var.shape).astype(np.float32)
        var.set_value(jnp.asarray(1.0 + 0.1 * noise if "norm" in ".".join(map(str, path)) else scale * noise))
    return module


def random_module(cls, config, seed: int, scale: float):
    """``cls(config)`` with `fill`ed weights, built without running its initialisers."""
    return fill(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))), seed, scale)
