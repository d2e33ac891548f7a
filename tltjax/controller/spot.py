"""The spot trainer: drafter updates on the devices of replicas that finished their rollout.

It runs in a thread of its own while the other replicas still decode. Before each
update it asks which devices are free (the replicas in DRAFT_TRAIN), lays them out
as a 1-D ``data`` mesh, moves the drafter state there (replicated) and shards the
batch's rows over it, so the training mesh grows as replicas go idle. The update is
one jitted program per training mesh (XLA caches it; the persistent compilation
cache makes that one per mesh *size* on GPU, where it ignores which devices).

It stops at an update boundary: `stop` waits for the update in flight, never
more. On a CPU, where "devices" share the same cores, the thread runs at the
lowest scheduling priority (``nice``) so that it takes only the cycles the
rollout leaves idle, as idle accelerators would.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass
class SpotStats:
    """What one RL step's spot training did: updates, their intervals and the devices each used."""

    steps: int = 0
    intervals: list = dataclasses.field(default_factory=list)  # (start, end, num_devices), clock seconds
    losses: list = dataclasses.field(default_factory=list)
    metrics: list = dataclasses.field(default_factory=list)
    mesh_sizes: list = dataclasses.field(default_factory=list)  # devices per update
    starved: int = 0  # times it had devices but no data yet
    error: str = ""

    @property
    def device_seconds(self) -> float:
        return float(sum((b - a) * n for a, b, n in self.intervals))

    def summary(self) -> dict[str, float]:
        out = {"steps": float(self.steps), "device_seconds": self.device_seconds,
               "max_mesh": float(max(self.mesh_sizes, default=0))}
        if self.losses:
            out["loss_first"], out["loss_last"] = float(self.losses[0]), float(self.losses[-1])
        for k in ("top1", "reg", "ce"):
            vals = [m[k] for m in self.metrics if k in m]
            if vals:
                out[k] = float(np.mean(vals))
        return out


class SpotTrainer:
    """Runs ``update_fn(state, target_params, batch) -> (state, metrics)`` on whatever devices are free.

    ``sample_batch(rng, rows)`` returns a host batch (a pytree of numpy arrays with
    ``rows`` rows) or None while there is no data. ``rows_per_device`` rows per
    training device: the global batch grows with the mesh, each device's share does
    not. ``max_steps`` caps updates per RL step (None: as many as the tail allows).
    """

    def __init__(
        self,
        update_fn: Callable,
        sample_batch: Callable[[np.random.Generator, int], object | None],
        *,
        rows_per_device: int,
        seed: int = 0,
        nice: int | None = 19,
        max_steps: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if rows_per_device < 1:
            raise ValueError(f"rows_per_device={rows_per_device} must be >= 1")
        self.update_fn, self.sample_batch = update_fn, sample_batch
        self.rows_per_device, self.seed, self.nice, self.max_steps = rows_per_device, seed, nice, max_steps
        self.clock = clock
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._meshes: dict[tuple, Mesh] = {}
        self._targets: dict[tuple, object] = {}

    # ------------------------------------------------------------------ thread control
    def start(self, state, target_params, devices_fn: Callable[[], Sequence], step: int = 0) -> None:
        """Starts training ``state`` in the background; ``devices_fn()`` names the free devices (maybe none)."""
        if self._thread is not None:
            raise RuntimeError("the spot trainer is already running; call stop() first")
        self._stop.clear()
        self._wake.clear()
        self._targets = {}
        self.state, self.stats = state, SpotStats()
        self._target_params, self._devices_fn = target_params, devices_fn
        self._rng = np.random.default_rng([self.seed, step])
        self._thread = threading.Thread(target=self._loop, name="spot-trainer", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Tells the trainer that the free devices changed."""
        self._wake.set()

    def stop(self):
        """Stops at the next update boundary; returns (state, `SpotStats`). Errors inside are re-raised."""
        if self._thread is None:
            raise RuntimeError("the spot trainer is not running")
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._thread = None
        if self.stats.error:
            raise RuntimeError(f"spot training failed: {self.stats.error}")
        return self.state, self.stats

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        if self.nice is not None and hasattr(os, "setpriority"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError:
                pass  # a priority is a courtesy, not a requirement
        try:
            while not self._stop.is_set():
                if self.max_steps is not None and self.stats.steps >= self.max_steps:
                    return
                devices = tuple(self._devices_fn())
                if not devices:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                batch = self.sample_batch(self._rng, self.rows_per_device * len(devices))
                if batch is None:
                    self.stats.starved += 1
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._update(devices, batch)
        except Exception as e:  # surfaced by stop(); the rollout threads are not disturbed
            self.stats.error = f"{type(e).__name__}: {e}"

    def _update(self, devices: tuple, batch) -> None:
        key = tuple(d.id for d in devices)
        mesh = self._meshes.get(key)
        if mesh is None:
            mesh = self._meshes[key] = Mesh(np.asarray(devices), ("data",))
        replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        if key not in self._targets:
            self._targets[key] = jax.device_put(self._target_params, replicated)
        t0 = self.clock()
        state = jax.device_put(self.state, replicated)
        batch = jax.device_put(batch, rows)
        state, metrics = self.update_fn(state, self._targets[key], batch)
        metrics = jax.device_get(metrics)  # waits for the update: the interval is its real span
        t1 = self.clock()
        self.state = state
        self.stats.steps += 1
        self.stats.intervals.append((t0, t1, len(devices)))
        self.stats.mesh_sizes.append(len(devices))
        self.stats.metrics.append({k: float(v) for k, v in metrics.items()})
        self.stats.losses.append(float(metrics["loss"]))
