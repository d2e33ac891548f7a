"""Rollout replicas: sub-meshes of one host's devices, tensor parallel inside.

A replica is ``replica_size`` devices of one process (host), laid out as a
`tltjax.sharding.make_mesh` mesh with every device on the ``tensor`` axis, so a
replica's engine splits attention heads and MLP columns over them. Replicas never
span hosts: a host's devices are cut into replicas on their own, and every host
must hold a whole number of replicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from tltjax.sharding import make_mesh


@dataclasses.dataclass(frozen=True)
class Replica:
    """Rollout replica ``index`` on host ``host``: its devices and their (tensor-parallel) mesh."""

    index: int
    host: int
    devices: tuple
    mesh: Mesh = dataclasses.field(compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.devices)


def partition_devices(devices: Sequence | None = None, replica_size: int = 1) -> list[Replica]:
    """Cuts ``devices`` (default: all) into replicas of ``replica_size`` devices, host by host.

    Devices keep their order within a host (neighbours share a replica); replica
    indices run host by host. Raises ValueError when a host's device count is not a
    multiple of ``replica_size``: a replica may not span hosts.
    """
    devices = list(jax.devices() if devices is None else devices)
    if replica_size < 1:
        raise ValueError(f"replica_size={replica_size} must be >= 1")
    if not devices:
        raise ValueError("no devices to partition")
    by_host: dict[int, list] = {}
    for d in devices:
        by_host.setdefault(d.process_index, []).append(d)
    replicas = []
    for host in sorted(by_host):
        local = by_host[host]
        if len(local) % replica_size:
            raise ValueError(
                f"host {host} has {len(local)} devices, not a multiple of replica_size={replica_size}; "
                "replicas never span hosts: pick a replica_size that divides every host's device count"
            )
        for i in range(0, len(local), replica_size):
            group = tuple(local[i : i + replica_size])
            replicas.append(Replica(len(replicas), host, group, make_mesh({"tensor": replica_size}, group)))
    return replicas
