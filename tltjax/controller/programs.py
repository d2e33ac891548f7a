"""One compiled program per mesh size, run on whichever devices of that size are free.

XLA compiles a program for a fixed device assignment, so `jax.jit` compiles again
for every new set of devices, even one of a size it has seen. The spot trainer's
mesh is whichever replicas are idle, a different set almost every RL step, and a
compilation takes seconds. `MeshPrograms` compiles once per mesh size and
*rebinds* that executable to each new device set of the size: the executable is
serialized once and deserialized with the new device assignment, as JAX's
persistent compilation cache does on GPU. Rebinding takes milliseconds and never
compiles. On backends where JAX does not load executables that way (TPU) every
device set is compiled instead.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import serialize_executable
from jax.sharding import Mesh, NamedSharding, PartitionSpec

REBIND_PLATFORMS = ("cpu", "gpu", "cuda", "rocm")


def abstract(tree, sharding: NamedSharding):
    """``tree``'s leaves as `jax.ShapeDtypeStruct`s placed with ``sharding`` (what `jax.jit(...).lower` takes)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding,
                                                       weak_type=getattr(x, "weak_type", False)), tree)


class _Rebinder(serialize_executable._JaxPjrtUnpickler):
    """Loads a serialized `jax.stages.Compiled` onto other devices: device ``src_ids[i]`` becomes ``devices[i]``."""

    def __init__(self, blob: bytes, src_ids: Sequence[int], devices: Sequence):
        from jax._src import compiler

        backend = devices[0].client
        super().__init__(io.BytesIO(blob), backend, devices)
        self.devices_by_id = dict(zip(src_ids, devices))
        # the executable's device assignment: one replica, one partition per device (as `jit` compiles it)
        self.options = compiler.get_compile_options(1, len(devices), np.asarray(devices, object)[None, :],
                                                    backend=backend)

    def persistent_load(self, pid):
        if pid[0] == "exec":
            return self.backend.deserialize_executable(pid[1], self.execution_devices, self.options)
        return super().persistent_load(pid)


def rebind(blob: tuple, src_ids: Sequence[int], devices: Sequence) -> jax.stages.Compiled:
    """The program serialized in ``blob`` (`serialize_executable.serialize`'s triple), compiled for the
    devices ``src_ids``, loaded to run on ``devices`` (as many, same kind) instead. Never compiles."""
    data, in_tree, out_tree = blob
    if len(src_ids) != len(devices):
        raise ValueError(f"a program for {len(src_ids)} devices cannot run on {len(devices)}")
    unloaded, args_info, no_kwargs = _Rebinder(data, src_ids, devices).load()
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info), out_tree, no_kwargs=no_kwargs)


class MeshPrograms:
    """``fn`` compiled once per mesh size over a 1-D mesh (axis ``axis``), runnable on any devices of that size.

    ``in_specs`` gives each positional argument's `PartitionSpec` (a prefix for the
    whole argument, e.g. ``P()`` replicated, ``P("data")`` rows split). `compile`
    compiles for one device set; `get` returns the program for any set whose size
    was compiled (rebound, no compilation) or None. Thread safe: one thread may
    compile while another runs programs.
    """

    def __init__(self, fn: Callable, in_specs: Sequence[PartitionSpec], axis: str = "data"):
        self.fn = fn if hasattr(fn, "lower") else jax.jit(fn)
        self.in_specs, self.axis = tuple(in_specs), axis
        self._lock = threading.Lock()
        self._meshes: dict[tuple, Mesh] = {}
        self._by_size: dict[int, tuple] = {}  # size -> (blob or None, device ids compiled for)
        self._bound: dict[tuple, jax.stages.Compiled] = {}  # device ids -> program
        self.compile_seconds: dict[tuple, float] = {}  # device ids -> seconds it took
        self.rebinds = 0

    def mesh(self, devices: Sequence) -> Mesh:
        key = tuple(d.id for d in devices)
        with self._lock:
            if key not in self._meshes:
                self._meshes[key] = Mesh(np.asarray(devices, object), (self.axis,))
            return self._meshes[key]

    def shardings(self, devices: Sequence) -> tuple[NamedSharding, ...]:
        mesh = self.mesh(devices)
        return tuple(NamedSharding(mesh, spec) for spec in self.in_specs)

    @property
    def sizes(self) -> set[int]:
        """The mesh sizes with a compiled program."""
        with self._lock:
            return set(self._by_size)

    def compile(self, devices: Sequence, *args, run: Callable[[Callable], object] | None = None) -> jax.stages.Compiled:
        """Compiles ``fn`` for ``devices`` with arguments shaped like ``args`` (arrays or `ShapeDtypeStruct`s,
        wherever they are); afterwards every device set of this size has a program (see `get`).

        ``run(f)`` calls ``f``, XLA's compilation (tracing and lowering happen here, holding
        the GIL); e.g. on a thread of lower priority. Default: here.
        """
        devices = tuple(devices)
        key = tuple(d.id for d in devices)
        t0 = time.perf_counter()
        specs = [abstract(a, s) for a, s in zip(args, self.shardings(devices), strict=True)]
        lowered = self.fn.lower(*specs)
        compiled = run(lowered.compile) if run is not None else lowered.compile()
        blob = None
        if devices[0].platform in REBIND_PLATFORMS:
            try:
                blob = serialize_executable.serialize(compiled)
            except (ValueError, NotImplementedError):  # e.g. host callbacks: each device set compiles
                blob = None
        with self._lock:
            self._bound[key] = compiled
            self._by_size.setdefault(len(devices), (blob, key))
            self.compile_seconds[key] = time.perf_counter() - t0
        return compiled

    def get(self, devices: Sequence) -> jax.stages.Compiled | None:
        """The program for exactly ``devices``: compiled for them, rebound from their size's program, or
        None when neither can be had without compiling."""
        key = tuple(d.id for d in devices)
        with self._lock:
            if key in self._bound:
                return self._bound[key]
            blob, src = self._by_size.get(len(key), (None, None))
        if blob is None:
            return None
        program = rebind(blob, src, tuple(devices))
        with self._lock:
            self.rebinds += 1
            return self._bound.setdefault(key, program)
