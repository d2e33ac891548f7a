"""The spot trainer: drafter updates on the devices of replicas that finished their rollout.

It runs in a thread of its own while the other replicas still decode. Before each
update it asks which devices are free (the replicas in DRAFT_TRAIN), lays them out
as a 1-D ``data`` mesh, moves the drafter state there (replicated) and shards the
batch's rows over it, so the training mesh grows as replicas go idle.

The update is one program per training-mesh *size* (`MeshPrograms`), compiled
once, off the critical path: from the first batch on, a compiler thread builds
the program of every mesh size the controller can hand over, then rebinds it to
every device set the controller named (milliseconds each, no compilation), so
that the trainer's loop only looks programs up. Until the program for the free
devices' size is ready the trainer uses the largest compiled size they hold, or
waits. `warmup` compiles them ahead of time instead.

It stops at an update boundary: `stop` waits for the update in flight (placing
its inputs, running it), never for a compilation.

With a `ContentionGuard` the trainer yields between updates as far as the guard
asks (phase ``yielding``; a stop ends the wait at once), so that where the
training devices share hardware with the decoding ones the tail slows down by at
most the guard's tolerance; it tells the guard when it is busy, and the
controller tells it how long the replicas' decode calls take.

Priorities. Only XLA's compilations run at a low scheduling priority (``nice``,
on a thread of their own: they do not hold the GIL). The trainer's thread and the
tracing before a compilation hold the GIL while they run Python; at a low
priority on a busy host they would be preempted holding it and stall every
other thread of the process, the rollout's schedulers and the step boundary
included. The update's device computation runs where the backend runs every
computation: on a CPU, in XLA's worker threads at normal priority, competing
with the rollout for the cores whatever the priority of the thread that
launched it.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from tltjax.controller.guard import ContentionGuard
from tltjax.controller.programs import MeshPrograms


@dataclasses.dataclass
class SpotStats:
    """What one RL step's spot training did: updates, their intervals and the devices each used."""

    steps: int = 0
    intervals: list = dataclasses.field(default_factory=list)  # (start, end, num_devices), clock seconds
    losses: list = dataclasses.field(default_factory=list)
    metrics: list = dataclasses.field(default_factory=list)
    mesh_sizes: list = dataclasses.field(default_factory=list)  # devices per update
    starved: int = 0  # times it had devices but no data yet
    compile_waits: int = 0  # times it had devices and data but no compiled program for them yet
    compiles: list = dataclasses.field(default_factory=list)  # (mesh size, seconds) finished since the last stop
    stop_requested: float = 0.0  # clock when `stop` was called
    stop_phase: str = ""  # what the trainer was doing then (see `SpotTrainer._enter`)
    phase_seconds: dict = dataclasses.field(default_factory=dict)  # seconds per phase of the trainer's loop
    stopped: float = 0.0  # clock when it returned
    guard: dict = dataclasses.field(default_factory=dict)  # `ContentionGuard.summary` at the stop
    error: str = ""

    def stop_wait(self) -> tuple[float, float]:
        """What `stop` waited for: (the rest of the update in flight, the thread's wind-down after it)."""
        last_end = max((b for _, b, _ in self.intervals), default=0.0)
        in_update = max(0.0, last_end - self.stop_requested)
        return in_update, max(0.0, self.stopped - max(last_end, self.stop_requested))

    @property
    def device_seconds(self) -> float:
        return float(sum((b - a) * n for a, b, n in self.intervals))

    def summary(self) -> dict[str, float]:
        out = {"steps": float(self.steps), "device_seconds": self.device_seconds,
               "max_mesh": float(max(self.mesh_sizes, default=0)), "compile_waits": float(self.compile_waits),
               "compile_seconds": float(sum(s for _, s in self.compiles)),
               "update_seconds": float(np.mean([b - a for a, b, _ in self.intervals])) if self.intervals else 0.0}
        out["stop_in_update"], out["stop_after_update"] = self.stop_wait()
        out.update({f"seconds_{k}": v for k, v in self.phase_seconds.items()})
        out.update({f"guard_{k}": v for k, v in self.guard.items()})
        if self.stop_phase:  # how long the stop waited, under what the trainer was doing when it came
            out[f"stop_while_{self.stop_phase}"] = self.stopped - self.stop_requested
        if self.losses:
            out["loss_first"], out["loss_last"] = float(self.losses[0]), float(self.losses[-1])
        for k in ("top1", "reg", "ce"):
            vals = [m[k] for m in self.metrics if k in m]
            if vals:
                out[k] = float(np.mean(vals))
        return out


def row_template(batch):
    """One row of ``batch`` (every leaf has a leading row axis): its leaves' shapes without that axis."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), batch)


def with_rows(template, rows: int):
    """The `jax.ShapeDtypeStruct`s of a batch of ``rows`` rows like ``template``'s (see `row_template`)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((rows, *s.shape), s.dtype), template)


def _lower_priority(nice: int | None) -> None:
    if nice is not None and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass  # a priority is a courtesy, not a requirement


class SpotTrainer:
    """Runs ``update_fn(state, target_params, batch) -> (state, metrics)`` on whatever devices are free.

    ``update_fn`` is a `jax.jit` function (or is jitted here). ``sample_batch(rng, rows)``
    returns a host batch (a pytree of numpy arrays with ``rows`` rows) or None while
    there is no data. ``rows_per_device`` rows per training device: the global batch
    grows with the mesh, each device's share, and so an update's duration, does not.
    ``max_steps`` caps updates per RL step (None: as many as the tail allows). ``nice``: the
    scheduling priority of the background compilations (None: unchanged). ``guard``: a
    `ContentionGuard` that rations the updates (None: as many as the devices allow).
    """

    ACTIVE = frozenset({"sampling", "binding", "placing", "updating"})  # phases the guard counts as busy

    def __init__(
        self,
        update_fn: Callable,
        sample_batch: Callable[[np.random.Generator, int], object | None],
        *,
        rows_per_device: int,
        seed: int = 0,
        nice: int | None = 19,
        max_steps: int | None = None,
        guard: ContentionGuard | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if rows_per_device < 1:
            raise ValueError(f"rows_per_device={rows_per_device} must be >= 1")
        self.sample_batch = sample_batch
        self.rows_per_device, self.seed, self.nice, self.max_steps = rows_per_device, seed, nice, max_steps
        self.clock, self.guard = clock, guard
        self.programs = MeshPrograms(update_fn, (P(), P(), P("data")))
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._targets: dict[tuple, object] = {}
        self._template = None  # one batch row's shapes, known from the first batch
        self._device_sets: tuple = ()
        self._asked = False  # whether `_device_sets` went to the compiler thread
        self._requested: set = set()  # mesh sizes and device-id tuples handed to the compiler thread
        self._jobs: queue.Queue = queue.Queue()
        self._compiler: threading.Thread | None = None
        self._compile_error = ""
        self._compiled: list = []  # (mesh size, seconds) of background compilations not yet reported
        self._phase, self._since = "stopped", 0.0
        self.stats = SpotStats()

    # ------------------------------------------------------------------ compiling
    def warmup(self, state, target_params, batch, device_sets: Sequence[Sequence]) -> None:
        """Readies the update for every set in ``device_sets`` now (one compilation per size, rebindings for
        the rest), for batches shaped like ``batch`` (any number of rows) and the given state and target
        (arrays or `ShapeDtypeStruct`s)."""
        self._template = row_template(batch)
        for devices in device_sets:
            if self.programs.get(devices) is None:
                self.programs.compile(devices, state, target_params,
                                      with_rows(self._template, self.rows_per_device * len(devices)))
            self._requested |= {len(devices), tuple(d.id for d in devices)}

    def _request(self, free: tuple) -> None:
        """Hands what is still missing to the compiler thread: a compilation per mesh size (of ``free`` first),
        then a program for ``free`` and every device set the controller named (a rebinding where the size's
        program allows it, else a compilation), so that the loop finds them ready."""
        sets = (free,) if self._asked else (free, *self._device_sets)
        self._asked = True
        spec = lambda tree: jax.tree.map(  # noqa: E731 - shapes only: the arrays may be donated meanwhile
            lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=getattr(x, "weak_type", False)), tree)
        for key_of in (len, lambda d: tuple(x.id for x in d)):  # sizes first, then device sets
            for devices in sets:
                key = key_of(devices)
                if key in self._requested:
                    continue
                self._requested.add(key)
                self._jobs.put((tuple(devices), spec(self.state), spec(self._target_params),
                                with_rows(self._template, self.rows_per_device * len(devices))))
        if self._compiler is None and not self._jobs.empty():
            self._compiler = threading.Thread(target=self._compile_loop, name="spot-compiler", daemon=True)
            self._compiler.start()

    def _compile_loop(self) -> None:
        xla = ThreadPoolExecutor(1, "spot-xla-compile", initializer=_lower_priority, initargs=(self.nice,))
        while True:
            devices, *args = self._jobs.get()
            try:
                if self.programs.get(devices) is None:  # (a rebinding when its size is compiled)
                    self.programs.compile(devices, *args, run=lambda compile_fn: xla.submit(compile_fn).result())
                    self._compiled.append((len(devices), self.programs.compile_seconds[tuple(d.id for d in devices)]))
            except Exception as e:  # noqa: BLE001 - surfaced by the next stop()
                self._compile_error = f"compiling the update for {len(devices)} devices: {type(e).__name__}: {e}"
            self._wake.set()

    def _program(self, free: tuple):
        """(devices, program) for the largest compiled mesh size that ``free`` holds (its first devices), or None."""
        for size in sorted((s for s in self.programs.sizes if s <= len(free)), reverse=True):
            program = self.programs.get(free[:size])
            if program is not None:
                return free[:size], program
        return None

    # ------------------------------------------------------------------ thread control
    def start(self, state, target_params, devices_fn: Callable[[], Sequence], step: int = 0,
              device_sets: Sequence[Sequence] = ()) -> None:
        """Starts training ``state`` in the background; ``devices_fn()`` names the free devices (maybe none).

        ``device_sets``: the training meshes the controller may hand over (one per size is enough);
        their programs are compiled in the background once the first batch shows its shapes.
        """
        if self._thread is not None:
            raise RuntimeError("the spot trainer is already running; call stop() first")
        self._stop.clear()
        self._wake.clear()
        self._targets = {}
        self.state, self.stats = state, SpotStats()
        self._phase, self._since = "starting", self.clock()
        self._target_params, self._devices_fn = target_params, devices_fn
        if tuple(tuple(s) for s in device_sets) != self._device_sets:
            self._device_sets, self._asked = tuple(tuple(s) for s in device_sets), False
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
        self.stats.stop_requested, self.stats.stop_phase = self.clock(), self._phase
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._thread = None
        self.stats.stopped = self.clock()
        self._enter("stopped")
        if self.guard is not None:
            self.stats.guard = self.guard.summary()
        while self._compiled:  # (the compiler thread may append meanwhile: pop is atomic)
            self.stats.compiles.append(self._compiled.pop(0))
        error = self.stats.error or self._compile_error
        self._compile_error = ""
        if error:
            raise RuntimeError(f"spot training failed: {error}")
        return self.state, self.stats

    # ------------------------------------------------------------------ the loop
    def _enter(self, phase: str) -> None:
        """Notes that the trainer's loop now does ``phase`` (waiting, yielding, sampling, binding, placing,
        updating, finished)."""
        now = self.clock()
        if self._phase != "stopped":
            self.stats.phase_seconds[self._phase] = self.stats.phase_seconds.get(self._phase, 0.0) + now - self._since
        if self.guard is not None and (phase in self.ACTIVE) != (self._phase in self.ACTIVE):
            if phase in self.ACTIVE:
                self.guard.busy_start(now)
            else:
                self.guard.busy_end(now)
        self._phase, self._since = phase, now

    def _yield(self) -> bool:
        """Yields as long as the guard asks (until a stop); False when it asks nothing."""
        wait = self.guard.wait_before_update() if self.guard is not None else 0.0
        if wait <= 0.0:
            return False
        self._enter("yielding")
        t0 = self.clock()
        self._stop.wait(wait)
        self.guard.earned(self.clock() - t0)
        return True

    def _idle(self) -> None:
        self._enter("waiting")
        self._wake.wait(0.05)
        self._wake.clear()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self.max_steps is not None and self.stats.steps >= self.max_steps:
                    break
                free = tuple(self._devices_fn())
                if not free:
                    self._idle()
                    continue
                if self._template is None:  # the first batch ever: its shapes are what the programs take
                    self._enter("sampling")
                    batch = self.sample_batch(self._rng, self.rows_per_device)
                    if batch is None:
                        self.stats.starved += 1
                        self._idle()
                        continue
                    self._template = row_template(batch)
                self._enter("binding")
                self._request(free)
                got = self._program(free)
                if got is None:
                    self.stats.compile_waits += 1
                    self._idle()
                    continue
                devices, program = got
                if self._yield():
                    continue
                began = self.clock()
                self._enter("sampling")
                batch = self.sample_batch(self._rng, self.rows_per_device * len(devices))
                if batch is None:
                    self.stats.starved += 1
                    self._idle()
                    continue
                if self._update(devices, program, batch) and self.guard is not None:
                    self.guard.spent(self.clock() - began)
        except Exception as e:  # surfaced by stop(); the rollout threads are not disturbed
            self.stats.error = f"{type(e).__name__}: {e}"
        finally:
            self._enter("finished")

    def _update(self, devices: tuple, program, batch) -> bool:
        """One update on ``devices``; False when a stop came before it ran."""
        key = tuple(d.id for d in devices)
        self._enter("placing")
        t0 = self.clock()
        replicated, target_sharding, rows = self.programs.shardings(devices)
        if key not in self._targets:
            self._targets[key] = jax.device_put(self._target_params, target_sharding)
        state = jax.device_put(self.state, replicated)
        batch = jax.device_put(batch, rows)
        if self._stop.is_set():  # the rollout ended while the inputs were placed: not worth an update
            return False
        self._enter("updating")
        state, metrics = program(state, self._targets[key], batch)
        metrics = jax.device_get(metrics)  # waits for the update: the interval is its real span
        t1 = self.clock()
        self.state = state
        self.stats.steps += 1
        self.stats.intervals.append((t0, t1, len(devices)))
        self.stats.mesh_sizes.append(len(devices))
        self.stats.metrics.append({k: float(v) for k, v in metrics.items()})
        self.stats.losses.append(float(metrics["loss"]))
        return True
