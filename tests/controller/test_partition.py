"""`tltjax.controller.partition` and `tltjax.controller.replica`: replicas and their state machine."""

import types

import jax
import pytest

from tltjax.controller import Phase, ReplicaLog, partition_devices


def test_replicas_are_tensor_parallel_sub_meshes_of_consecutive_devices():
    """8 devices, replica_size 2: four replicas of neighbours, each a mesh with its devices on `tensor`."""
    reps = partition_devices(jax.devices(), 2)
    assert [r.index for r in reps] == [0, 1, 2, 3]
    assert [tuple(d.id for d in r.devices) for r in reps] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(r.mesh.shape["tensor"] == 2 and r.size == 2 for r in reps)
    assert [r.size for r in partition_devices(jax.devices(), 1)] == [1] * 8


def test_replicas_never_span_hosts():
    """Devices of two hosts are cut host by host; a size that does not divide a host's count is an error."""
    fake = [types.SimpleNamespace(id=i, process_index=i // 3) for i in range(6)]
    with pytest.raises(ValueError, match="host 0 has 3 devices, not a multiple of replica_size=2"):
        partition_devices(fake, 2)
    with pytest.raises(ValueError, match="replica_size=0"):
        partition_devices(jax.devices(), 0)


def test_state_machine_allows_the_cycle_and_rejects_the_rest():
    """ROLLOUT → IDLE → DRAFT_TRAIN → ROLLOUT and IDLE → ROLLOUT are logged; skipping a phase raises."""
    log = ReplicaLog(2)
    log.move(0, 0, Phase.IDLE, "done")
    log.move(0, 0, Phase.DRAFT_TRAIN)
    assert log.in_phase(Phase.DRAFT_TRAIN) == [0] and log.in_phase(Phase.ROLLOUT) == [1]
    log.move(0, 0, Phase.ROLLOUT)
    log.move(0, 1, Phase.IDLE)
    log.move(0, 1, Phase.ROLLOUT)
    assert [(t.replica, t.src, t.dst) for t in log.for_step(0)] == [
        (0, Phase.ROLLOUT, Phase.IDLE), (0, Phase.IDLE, Phase.DRAFT_TRAIN), (0, Phase.DRAFT_TRAIN, Phase.ROLLOUT),
        (1, Phase.ROLLOUT, Phase.IDLE), (1, Phase.IDLE, Phase.ROLLOUT)]
    with pytest.raises(ValueError, match="replica 0: rollout -> draft_train is not a valid transition"):
        log.move(1, 0, Phase.DRAFT_TRAIN)
    times = [t.time for t in log.transitions]
    assert times == sorted(times) and log.transitions[0].to_dict()["dst"] == "idle"
