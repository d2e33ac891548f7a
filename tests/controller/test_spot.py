"""`tltjax.controller.spot` and `tltjax.controller.programs`: one update program per training-mesh size,
compiled once and off the step boundary; the boundary waits for at most the update in flight.

The device sets the trainer gets are simulated (no engines): a list that the test grows
as "replicas" finish, with a backend-compile listener as the evidence of where and when
XLA compiles.
"""

import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import monitoring

from tltjax.controller.programs import MeshPrograms
from tltjax.controller.spot import SpotTrainer

_COMPILES: list[tuple[str, float]] = []  # (thread name, clock) of every backend compilation in this process


def _listen(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES.append((threading.current_thread().name, time.perf_counter()))


monitoring.register_event_duration_secs_listener(_listen)


@functools.partial(jax.jit, donate_argnums=(0,))  # donates its state, as drafter_update does
def _toy_update(state, target_params, batch):
    # stands in for drafter_update: a data-parallel reduction over the rows, the state replicated
    g = jnp.mean(batch["x"], axis=0) @ target_params["m"]
    return {"w": state["w"] + g, "n": state["n"] + 1}, {"loss": jnp.mean(batch["x"] ** 2)}


TARGET = {"m": jnp.eye(8) * 0.5}


def _state():
    return {"w": jnp.zeros(8), "n": jnp.zeros((), jnp.int32)}


def _sample(rng, rows):
    return {"x": rng.normal(size=(rows, 8)).astype(np.float32)}


def _place(programs, devices, state, batch):
    s, t, b = programs.shardings(devices)
    return jax.device_put(state, s), jax.device_put(TARGET, t), jax.device_put(batch, b)


def test_one_compilation_per_mesh_size_serves_every_device_set():
    """A program compiled for devices (0, 1) runs on (3, 2) and (5, 6) without compiling, its outputs live
    on those devices and equal, bit for bit, what `jax.jit` compiles for them; it donates as the jit does."""
    devs = jax.devices()
    programs = MeshPrograms(_toy_update, (jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(),
                                          jax.sharding.PartitionSpec("data")))
    batch = _sample(np.random.default_rng(0), 4)
    programs.compile(devs[:2], _state(), TARGET, batch)
    assert programs.sizes == {2} and programs.get(devs[:1]) is None
    for devices in ((devs[3], devs[2]), (devs[5], devs[6])):
        n = len(_COMPILES)
        program = programs.get(devices)
        args = _place(programs, devices, _state(), batch)
        state, metrics = program(*args)
        assert len(_COMPILES) == n, "rebinding compiled"
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(args[0])), "the state was not donated"
        assert {d.id for d in state["w"].devices()} == {d.id for d in devices}
        ref_state, ref_metrics = _toy_update(*_place(programs, devices, _state(), batch))
        np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(ref_state["w"]))
        assert float(metrics["loss"]) == float(ref_metrics["loss"])
    assert programs.rebinds == 2 and programs.get((devs[3], devs[2])) is programs.get((devs[3], devs[2]))


@pytest.mark.slow
def test_rebound_drafter_update_equals_a_fresh_compilation():
    """The real update: `drafter_update` compiled on one device pair and rebound to another gives the same
    state and metrics as `drafter_update` compiled for that pair."""
    from tltjax.drafter import Drafter, DrafterConfig
    from tltjax.drafter.packing import PackedDrafterBatch
    from tltjax.drafter.train import DrafterTrainState, drafter_update
    from tltjax.models import CausalLM, ModelConfig

    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    target = CausalLM(cfg, rngs=nnx.Rngs(0))
    drafter, tx = Drafter(DrafterConfig.for_target(cfg), rngs=nnx.Rngs(1)), optax.adam(1e-3)
    make_state = lambda: DrafterTrainState.create(drafter, target, tx)  # noqa: E731
    rng = np.random.default_rng(0)
    rows, length = 4, 16
    batch = PackedDrafterBatch(
        ids=rng.integers(0, 64, (rows, length)).astype(np.int32), segment_ids=np.ones((rows, length), np.int32),
        positions=np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
        features=rng.normal(size=(rows, length, 32)).astype(np.float32))
    devs = jax.devices()
    P = jax.sharding.PartitionSpec
    programs = MeshPrograms(drafter_update, (P(), P(), P("data")))
    programs.compile(devs[:2], make_state(), nnx.state(target), batch)
    pair = (devs[7], devs[4])

    def place(state):
        s, t, b = programs.shardings(pair)
        return jax.device_put(state, s), jax.device_put(nnx.state(target), t), jax.device_put(batch, b)

    state, metrics = programs.get(pair)(*place(make_state()))
    ref_state, ref_metrics = drafter_update(*place(make_state()))
    assert jax.tree.map(float, metrics) == jax.tree.map(float, ref_metrics)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _SlowLower:
    """A jitted function whose compilations take at least ``delay`` seconds more (a big program's would)."""

    def __init__(self, fn, delay: float):
        self.fn, self.delay = fn, delay

    def lower(self, *args):
        time.sleep(self.delay)
        return self.fn.lower(*args)


def _wait_for(cond, timeout: float = 60.0) -> None:
    t = time.perf_counter()
    while not cond():
        assert time.perf_counter() - t < timeout, "timed out"
        time.sleep(0.01)


def test_the_step_boundary_never_waits_for_a_compilation():
    """Without warmup, the first batch starts the compilations on the compiler thread; a stop that comes
    while they run returns at once (nothing trained, the wait counted), and the programs are ready for the
    next step: then every device set trains (the 6-device set by rebinding), none of it compiles, and every
    compilation ran on the background compiler's XLA thread."""
    devs = jax.devices()
    sets = [tuple(devs[: 2 * k]) for k in (1, 2, 3)]  # "replicas" of 2 devices, the last one still decoding
    free: list = list(devs[2:4])
    # (nice=None: compilations at normal priority, so that a busy test machine does not stretch them)
    spot = SpotTrainer(_SlowLower(_toy_update, 1.0), _sample, rows_per_device=2, max_steps=2000, nice=None)
    start = len(_COMPILES)
    spot.start(_state(), TARGET, lambda: tuple(free), step=0, device_sets=sets)
    _wait_for(lambda: spot.stats.compile_waits > 0)
    t = time.perf_counter()
    state, st = spot.stop()
    assert time.perf_counter() - t < 0.5 and st.steps == 0 and int(state["n"]) == 0
    _wait_for(lambda: spot.programs.sizes == {2, 4, 6})

    n = len(_COMPILES)
    free[:] = devs[6:8]
    spot.start(state, TARGET, lambda: tuple(free), step=1, device_sets=sets)
    for extra in (devs[0:2], devs[4:6]):  # two more replicas finish: the mesh grows to 4, then 6 devices
        _wait_for(lambda: spot.stats.steps >= 3)
        free.extend(extra)
        spot.wake()
        _wait_for(lambda: spot.stats.mesh_sizes[-1] == len(free))
    state, st = spot.stop()
    assert len(_COMPILES) == n, "a compilation after the programs were ready"
    assert set(st.mesh_sizes) == {2, 4, 6} and st.mesh_sizes == sorted(st.mesh_sizes)
    assert int(state["n"]) == st.steps and spot.programs.rebinds >= 2
    assert _COMPILES[start:] and all(name.startswith("spot-xla-compile") for name, _ in _COMPILES[start:])


def test_stop_waits_for_the_update_in_flight_and_no_more():
    """After `warmup` (one compilation per mesh size, up front) a stop requested mid-update returns when that
    update ends: no update starts after the request, and nothing compiles."""
    devs = jax.devices()

    @jax.jit
    def slow_update(state, target_params, batch):  # a few hundred ms of matmuls per update
        def body(_, h):
            return jnp.tanh(h @ jnp.full((256, 256), 1e-3) + 1.0)
        h = jax.lax.fori_loop(0, 200, body, jnp.ones((batch["x"].shape[0], 256)))
        return {"w": state["w"] + jnp.mean(h), "n": state["n"] + 1}, {"loss": jnp.mean(h)}

    spot = SpotTrainer(slow_update, _sample, rows_per_device=64)
    sets = [tuple(devs[:k]) for k in (1, 2, 3)]
    spot.warmup(_state(), TARGET, _sample(np.random.default_rng(0), 1), sets)
    assert spot.programs.sizes == {1, 2, 3}
    n = len(_COMPILES)
    free = (devs[5], devs[1])
    spot.start(_state(), TARGET, lambda: free, step=0, device_sets=sets)
    _wait_for(lambda: spot.stats.steps >= 2)
    time.sleep(0.05)
    t_stop = spot.clock()
    state, st = spot.stop()
    t_back = spot.clock()
    assert len(_COMPILES) == n
    assert sum(a > t_stop for a, _, _ in st.intervals) == 0, "an update started after the stop"
    last_end = max(b for _, b, _ in st.intervals)
    assert t_back - max(last_end, t_stop) < 0.25
    assert st.stop_wait()[1] < 0.25
    assert int(state["n"]) == st.steps and set(st.mesh_sizes) == {2}


def test_the_controller_names_every_training_mesh():
    """Four replicas of two devices: the trainer can be handed any proper subset of them (14 sets, smallest
    first, devices in replica order, never all four); with more replicas than ``max_replicas`` only the
    first k replicas' devices for each k."""
    from tltjax.controller import partition_devices
    from tltjax.controller.controller import Controller

    replicas = partition_devices(jax.devices(), 2)
    sets = Controller(replicas, [None] * 4).training_meshes()
    assert len(sets) == 14 == len(set(sets)) and [len(s) for s in sets] == sorted(len(s) for s in sets)
    assert sets[0] == replicas[0].devices and max(len(s) for s in sets) == 6
    assert all([d.id for d in s] == sorted(d.id for d in s) for s in sets)
    assert Controller(replicas, [None] * 4).training_meshes(max_replicas=3) == [
        tuple(d for r in replicas[:k] for d in r.devices) for k in (1, 2, 3)]
