"""`tltjax.checkpoint`: roundtrip, pruning, sharded restore, clear errors, and SIGKILL at any
moment leaves a directory whose latest step restores to exactly what that step saved."""

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tltjax import sharding as shd
from tltjax.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parents[1]


def _train_state():
    """Policy params, adam state after one real update, typed and raw PRNG keys, an int step."""
    params = {
        "policy": {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)},
        "drafter": {"e": jnp.full((2, 3), 0.5)},
    }
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return {
        "params": params,
        "opt_state": opt_state,
        "rng": jax.random.key(7),
        "rng_data": jax.random.key_data(jax.random.key(8)),
        "step": 12,
    }


def _host_state():
    return {
        "step": 12,
        "data_position": 345,
        "numpy_rng": np.random.default_rng(3).bit_generator.state,
        "controller": {"arms": [1, 2, 4], "counts": [3.0, 1.0, 0.0]},
    }


def _assert_trees_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if isinstance(w, jax.Array) and jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            assert g.dtype == w.dtype
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_roundtrip_restores_state_types_and_host(tmp_path):
    """restore(target=state) gives back every leaf bit-exactly with the target's containers
    (optax namedtuples, typed keys) and the host dict unchanged; the default step is the latest."""
    state, host = _train_state(), _host_state()
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(11, {"other": jnp.zeros(2)}, {"old": True})
        ck.save(12, state, host)
        assert ck.latest_step() == 12 and ck.all_steps() == [11, 12]
        got, got_host = ck.restore(target=state)
        _assert_trees_equal(got, state)
        assert isinstance(got["opt_state"][0], optax.ScaleByAdamState)
        assert got_host == host
        # Without a target: same leaves in the saved order, containers as dicts/lists.
        raw, _ = ck.restore(12)
        for g, w in zip(jax.tree.leaves(raw), jax.tree.leaves(state)):
            if jax.dtypes.issubdtype(getattr(w, "dtype", np.float32), jax.dtypes.prng_key):
                g, w = jax.random.key_data(g), jax.random.key_data(w)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert ck.restore(11)[1] == {"old": True}


def test_keep_prunes_to_newest(tmp_path):
    """keep=2 leaves exactly the two newest steps on disk, and no trash behind."""
    with Checkpointer(tmp_path, keep=2) as ck:
        for step in range(1, 6):
            ck.save(step, {"x": jnp.full(3, step)}, {"step": step})
        assert ck.all_steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]


def test_async_save_commits_on_wait(tmp_path):
    """async_save=True: after wait() the step is listed and restores like a synchronous save."""
    with Checkpointer(tmp_path, async_save=True) as ck:
        ck.save(3, {"x": jnp.arange(5)}, {"pos": 9})
        ck.wait()
        assert ck.latest_step() == 3
        got, host = ck.restore(target={"x": jnp.zeros(5, jnp.int32)})
    np.testing.assert_array_equal(got["x"], np.arange(5))
    assert host == {"pos": 9}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py provides 8 virtual CPU ones)")
def test_sharded_restore_onto_target_shardings(tmp_path):
    """On a 2x4 mesh, arrays restore onto the shardings of a ShapeDtypeStruct target, the saved
    one or a different one, with the same values."""
    mesh = shd.make_mesh({"fsdp": 2, "tensor": 4})
    saved = {
        "w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp", "tensor"))),
        "v": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("tensor"))),
        "r": jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P())),
    }
    with Checkpointer(tmp_path) as ck:
        ck.save(1, saved, {})
        as_saved = {"w": P("fsdp", "tensor"), "v": P("tensor"), "r": P()}
        resharded = {"w": P("tensor", "fsdp"), "v": P(), "r": P("fsdp")}
        for specs in (as_saved, resharded):
            target = {
                k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, specs[k])) for k, a in saved.items()
            }
            got, _ = ck.restore(target=target)
            for k, a in got.items():
                assert a.sharding == target[k].sharding, (k, a.sharding)
                np.testing.assert_array_equal(np.asarray(a), np.asarray(saved[k]))


def test_errors_name_the_problem(tmp_path):
    """Empty dir, unknown step, mismatched target (path and both shapes), duplicate step and
    non-JSON host state each raise an error that says what to do."""
    ck = Checkpointer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in"):
        ck.restore()
    assert ck.latest_step() is None
    state = {"params": {"w": jnp.zeros((4, 8)), "b": jnp.zeros(8)}}
    ck.save(2, state, {})
    with pytest.raises(FileNotFoundError, match=r"step 5 .* complete steps: \[2\]"):
        ck.restore(5)
    bad = {"params": {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32), "c": jnp.zeros(8)}}
    with pytest.raises(ValueError) as e:
        ck.restore(target=bad)
    msg = str(e.value)
    assert "params.w: checkpoint has shape (4, 8), target expects (4, 4)" in msg
    assert "params.c: in the target but not in the checkpoint" in msg
    assert "params.b: in the checkpoint but not in the target" in msg
    with pytest.raises(FileExistsError, match="force=True"):
        ck.save(2, state, {})
    ck.save(2, {"params": {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}}, {"v": 2}, force=True)
    assert ck.restore()[1] == {"v": 2}
    with pytest.raises(TypeError, match="JSON-serialisable"):
        ck.save(3, state, {"rng": np.zeros(3)})
    ck.close()


def test_start_cleans_leftovers_of_a_killed_save(tmp_path):
    """A new Checkpointer removes orbax temp dirs, trash and uncommitted step dirs, and lists
    only committed steps."""
    with Checkpointer(tmp_path) as ck:
        ck.save(4, {"x": jnp.ones(2)}, {"s": 4})
    (tmp_path / "5.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    (tmp_path / "6" / "state").mkdir(parents=True)  # no commit marker
    (tmp_path / ".trash" / "1").mkdir(parents=True)
    with Checkpointer(tmp_path) as ck:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["4"]
        assert ck.latest_step() == 4 and ck.restore()[1] == {"s": 4}


# -- SIGKILL at random moments ------------------------------------------------------------

_KILL_LEAVES, _KILL_LEAF_SIZE = 4, 3_200_000  # 4 x 12.8 MB float32: a save takes a while


def kill_state(step: int) -> dict:
    """The pytree the kill-test child saves at `step`: every value a function of the step."""
    big = [jnp.full((_KILL_LEAF_SIZE,), step * 10 + i, jnp.float32) for i in range(_KILL_LEAVES)]
    return {"big": big, "rng": jax.random.key(step), "step": step}


_CHILD = """
import sys
from tltjax.checkpoint import Checkpointer
from tests.test_checkpoint import kill_state
ck = Checkpointer(sys.argv[1], keep=2)
step = (ck.latest_step() or 0) + 1
print("ready", flush=True)
while True:
    ck.save(step, kill_state(step), {"step": step, "data_position": 7 * step})
    print("saved", step, flush=True)
    step += 1
"""


def _reader(stream, q):
    for line in stream:
        q.put(line.split())


def _next_line(q, proc, timeout=60.0):
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"kill-test child printed nothing for {timeout}s") from None


@pytest.mark.slow
def test_sigkill_at_random_moments_leaves_a_restorable_latest_step(tmp_path):
    """Kill a saving process with SIGKILL at random moments, some while a temp dir is being
    written: each time, latest_step() is at least the last step the child reported saved,
    every listed step restores to exactly what it saved, and the next start removes the temp dirs."""
    rng = random.Random(0)
    directory = tmp_path / "ck"
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, kill_state(0)
    )
    killed_mid_save = 0
    for round_ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(directory)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        assert _next_line(lines, proc)[0] == "ready"
        t0 = time.monotonic()
        last_saved = int(_next_line(lines, proc)[1])
        save_s = time.monotonic() - t0
        if round_ % 2 == 0:  # wait until the next save has a temp dir, then kill inside it
            deadline = time.monotonic() + 60
            while not any(".orbax-checkpoint-tmp" in p.name for p in directory.iterdir()):
                assert time.monotonic() < deadline and proc.poll() is None, "child never started a save"
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.3 * save_s))
        else:  # any moment: mid-save, pruning, or between saves
            time.sleep(rng.uniform(0, 1.5 * save_s))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        while not lines.empty():
            line = lines.get()
            if line and line[0] == "saved":
                last_saved = int(line[1])
        killed_mid_save += any(".orbax-checkpoint-tmp" in p.name for p in directory.iterdir())

        with Checkpointer(directory, keep=2) as ck:
            assert not any(".orbax-checkpoint-tmp" in p.name for p in directory.iterdir())
            latest = ck.latest_step()
            assert latest is not None and latest >= last_saved, (latest, last_saved)
            for step in ck.all_steps():
                got, host = ck.restore(step, target=target)
                assert host == {"step": step, "data_position": 7 * step}
                _assert_trees_equal(got, kill_state(step))
    assert killed_mid_save >= 1, "no kill landed inside a save; the test did not test atomicity"
