"""The host-side controller: which devices decode and which train the drafter, step by step.

- `partition`: rollout replicas as sub-meshes of one host's devices (`Replica`, `partition_devices`).
- `replica`: the per-replica state machine ROLLOUT → IDLE → DRAFT_TRAIN → ROLLOUT and its log.
- `spot`: the spot trainer: drafter updates, data parallel over whichever replicas are idle,
  one compiled program per training-mesh size, compiled off the critical path.
- `guard`: rations spot training where the training devices share hardware with the decoding
  ones, so that the tail slows down by at most a tolerance (measured from its decode calls).
- `programs`: a program compiled once per mesh size and rebound to any devices of that size.
- `controller`: one RL step's rollout over the replicas, handing finished replicas' devices
  to the spot trainer until the last replica finishes.
"""

from tltjax.controller.guard import ContentionGuard
from tltjax.controller.partition import Replica, partition_devices
from tltjax.controller.replica import Phase, ReplicaLog, Transition

__all__ = ["ContentionGuard", "Phase", "Replica", "ReplicaLog", "Transition", "partition_devices"]
