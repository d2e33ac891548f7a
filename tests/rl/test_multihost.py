"""Two processes × 4 virtual CPU devices under `jax.distributed` run the micro RL config together.

Each process rolls out its half of the prompts on its own two TP-2 replicas (the idle one trains
the drafter), the policy update runs on the global 8-device mesh, and the drafter is averaged
over the processes at every step boundary: both must end with identical policy and drafter
parameters, and log the same global rewards.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tltjax import checkpoint as ckpt_lib
from tltjax.controller.replica import Phase

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_end_with_identical_policy_and_drafter(tmp_path):
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "tltjax.main", "--config=configs/micro.py", f"--config.workdir={tmp_path / 'run'}",
            f"--config.cache_dir={tmp_path / 'cache'}", f"--config.rl.steps={STEPS}", "--config.rl.eval_prompts=4",
            "--config.rl.plots=false", "--config.rl.tensorboard=false", "--config.controller.replica_size=2",
            "--config.distributed.num_processes=2", f"--config.distributed.coordinator_address=localhost:{port}"]
    procs = [subprocess.Popen(args + [f"--config.distributed.process_id={i}"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=900)[0])
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-6000:]}"

    dirs = [tmp_path / "run", tmp_path / "run" / "process_1"]
    summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
    for part in ("policy", "drafter"):  # bit-exact fingerprints of each process's final weights
        assert summaries[0]["params_sha256"][part] == summaries[1]["params_sha256"][part], part
    # the one checkpoint directory holds the last step, and it restores
    ck = ckpt_lib.Checkpointer(dirs[0] / "checkpoints")
    assert ck.latest_step() == STEPS
    state, host = ck.restore(STEPS)
    ck.close()
    assert host["step"] == STEPS and {"policy", "drafter"} <= set(state)
    # each process's drafter buffer holds its own rollouts: they differ
    buffers = [np.load(d / "drafter_buffer" / f"{STEPS}.npz") for d in dirs]
    assert not np.array_equal(buffers[0]["tokens"], buffers[1]["tokens"])
    # both processes logged the same global rewards and update statistics
    metrics = [[json.loads(line) for line in open(d / "metrics.jsonl")] for d in dirs]
    assert [m["step"] for m in metrics[0]] == list(range(1, STEPS + 1))
    for key in ("reward/mean", "accuracy", "groups/zero_variance_frac", "loss", "grad_norm"):
        assert [m[key] for m in metrics[0]] == [m[key] for m in metrics[1]], key
    controller_log = [json.loads(line) for line in open(dirs[1] / "controller.jsonl")]
    assert any(t["dst"] == Phase.DRAFT_TRAIN.value for t in controller_log), "process 1's idle replica never trained"
