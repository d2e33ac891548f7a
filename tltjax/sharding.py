"""Logical axis names → mesh axes: the one table, and the helpers that apply it.

Parameters carry logical axis names in their ``axes`` metadata (see
`tltjax.models.transformer`); activations are constrained by name with
`constrain`. `RULES` maps each logical name to mesh axes of a mesh with axes
``("data", "fsdp", "tensor")``. Outside `use_mesh`, `constrain` is a no-op, so
the same model code runs on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (or tuple of axes, or None = replicated)
RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    # activations
    "batch": ("data", "fsdp"),
    "seq": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_mlp": "tensor",
}

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Mapping] | None] = contextvars.ContextVar("tltjax_mesh", default=None)


def make_mesh(shape: Mapping[str, int] | Sequence[int], devices=None) -> Mesh:
    """A mesh over ``devices`` (default: all) with axes ``data``, ``fsdp``, ``tensor``.

    ``shape`` gives the size per axis (a dict, or a 3-tuple in that order); one
    size may be -1 to take the remaining devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [shape.get(a, 1) for a in MESH_AXES] if isinstance(shape, Mapping) else list(shape)
    if len(sizes) != 3:
        raise ValueError(f"mesh shape needs 3 sizes for {MESH_AXES}, got {sizes}")
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, {len(devices)} given"
        )
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def spec(axes: Sequence[str | None], rules: Mapping = RULES, mesh: Mesh | None = None) -> P:
    """The PartitionSpec for logical ``axes``; a mesh axis is used at most once."""
    used: set[str] = set()
    out = []
    for name in axes:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        target = rules[name]
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        if mesh is not None:
            targets = tuple(a for a in targets if mesh.shape.get(a, 1) > 1)
        targets = tuple(a for a in targets if a not in used)
        used.update(targets)
        out.append(None if not targets else targets[0] if len(targets) == 1 else targets)
    return P(*out)


def _divisible(shape, pspec: P, mesh: Mesh) -> P:
    """Drops mesh axes that do not divide a dimension (keeps the layout valid for any size)."""
    fixed = []
    for dim, entry in zip(shape, tuple(pspec) + (None,) * (len(shape) - len(pspec))):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        fixed.append(entry if dim % size == 0 else None)
    return P(*fixed)


def named_sharding(shape, axes: Sequence[str | None], mesh: Mesh, rules: Mapping = RULES) -> NamedSharding:
    """NamedSharding of an array with ``shape`` and logical ``axes`` on ``mesh``."""
    return NamedSharding(mesh, _divisible(shape, spec(axes, rules, mesh), mesh))


def state_shardings(state: nnx.State, mesh: Mesh, rules: Mapping = RULES):
    """A pytree of NamedShardings matching an NNX state, from each variable's ``axes``."""

    def one(var):
        axes = var.get_metadata().get("axes") if hasattr(var, "get_metadata") else None
        shape = var.shape if hasattr(var, "shape") else var[...].shape
        if axes is None:
            return NamedSharding(mesh, P())
        return named_sharding(shape, axes, mesh, rules)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Mapping = RULES) -> nnx.Module:
    """Moves every parameter of ``model`` onto ``mesh`` by its logical axes (in place)."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, rules)
    # Variables are pytree nodes: stop at them and move their values, keeping metadata.
    state = jax.tree.map(
        lambda v, s: v.replace(jax.device_put(v[...], s)),
        state,
        shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    nnx.update(model, state)
    return model


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Mapping = RULES):
    """Within this context, `constrain` lays activations out on ``mesh``.

    The mesh is also set as JAX's context mesh (`jax.set_mesh`), which is part of
    the `jit` cache key: a function traced outside the context (constraints off)
    is retraced inside it rather than silently reused, and vice versa.
    """
    token = _ACTIVE.set((mesh, rules))
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside `use_mesh`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, named_sharding(x.shape, axes, mesh, rules))
