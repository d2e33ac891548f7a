"""Joining a multi-host run through JAX's own runtime (`jax.distributed.initialize`).

A run spans several processes (hosts) when ``config.distributed.num_processes > 1``, or
when it is launched as several SLURM tasks (``srun``): then JAX reads the coordinator,
the number of processes and this process's index from SLURM's environment. Every process
runs the same command; each one drives its own devices (its rollout replicas and its spot
trainer) and all of them share the global mesh of the policy update.

On CPU the cross-process collectives go through gloo, which this module switches on
before the runtime starts (the default CPU runtime has none).
"""

from __future__ import annotations

import logging
import os

import jax
from ml_collections import ConfigDict

from tltjax.config import ConfigError

log = logging.getLogger(__name__)

_started = False


def slurm_tasks() -> int:
    """The number of tasks of the SLURM step this process belongs to (1 outside SLURM)."""
    if "SLURM_JOB_ID" not in os.environ:
        return 1
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS", "1")))


def wanted(config: ConfigDict) -> bool:
    """True when ``config`` (or the SLURM environment) asks for more than one process."""
    d = config.get("distributed")
    if d is not None and d.num_processes > 1:
        return True
    return d is not None and d.slurm and slurm_tasks() > 1


def initialize(config: ConfigDict) -> tuple[int, int]:
    """Starts JAX's distributed runtime when the config asks for it; returns (process index, count).

    Idempotent; a no-op for single-process runs. Must run before anything touches a JAX
    backend (the runtime cannot join a group afterwards).
    """
    global _started
    if _started or not wanted(config):
        return jax.process_index(), jax.process_count()
    d = config.distributed
    kwargs = {}
    if d.num_processes > 1:
        if not d.coordinator_address:
            raise ConfigError(
                f"config.distributed.num_processes={d.num_processes} needs coordinator_address "
                "(host:port of process 0, reachable from every process), e.g. --config.distributed."
                "coordinator_address=10.0.0.1:12355")
        if not 0 <= d.process_id < d.num_processes:
            raise ConfigError(
                f"config.distributed.process_id={d.process_id} must be in [0, {d.num_processes}); give each "
                "process its own index")
        kwargs = dict(coordinator_address=d.coordinator_address, num_processes=d.num_processes,
                      process_id=d.process_id)
    # gloo: cross-process collectives for the CPU backend (GPUs and TPUs bring their own)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs, initialization_timeout=int(d.timeout_s))
    _started = True
    log.info("distributed: process %d of %d, %d local of %d devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return jax.process_index(), jax.process_count()


def barrier(name: str, timeout_s: float = 3600.0) -> None:
    """Waits until every process reaches the barrier ``name`` (through the coordinator; no device work).

    Unlike a collective (whose transport may time out within seconds), this waits as long as
    ``timeout_s`` allows, e.g. while process 0 trains something the others will read.
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed

    jax_distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))
