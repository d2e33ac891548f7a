"""Spot drafter training must not delay the critical path: RL steps with it on vs off, side by side.

Two trainers from the same config and seed run on rollout replicas
(``controller.replica_size``) over virtual CPU devices, speculation off (so the
drafter cannot change the rollout): one trains the drafter on the replicas that
finish early (spot training), the other leaves them idle. Their steps alternate.
Reported per arm: mean RL step time and rollout wall time, and their ratio (the
target is within 2%), idle device-seconds without and with spot training, spot
updates per RL step and the drafter's loss over the run.

    python benchmarks/spot_training.py --steps 8
    python benchmarks/spot_training.py --devices 8 --replica-size 2 --steps 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, help="config file (default: configs/default.py)")
    p.add_argument("--devices", type=int, default=4, help="virtual CPU devices (set before JAX starts)")
    p.add_argument("--replica-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the timing (compilations)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. rl.lr=1e-4")
    p.add_argument("--out", default="benchmarks/results/spot_training.json")
    return p.parse_args(argv)


def make_trainer(args, workdir: str, spot: bool):
    import common

    return common.make_trainer(args.config, args.set, workdir, args.steps, {
        "rl.drafter_steps": 0,  # no inline drafter updates: only spot training differs
        "rollout.spec_threshold": 0,  # speculation off: the rollout is the same with or without
        "controller.replica_size": args.replica_size, "controller.spot_training": spot})


def main(argv=None):
    args = parse_args(argv)
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np

    import common

    args.config = args.config or str(common.REPO / "configs/default.py")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"spot": make_trainer(args, f"{tmp}/spot", True), "idle": make_trainer(args, f"{tmp}/idle", False)}
        hist = common.alternate_steps(runs, args.steps, lambda name, m: (
            f"{m['time/step']:6.2f} s (rollout {m['time/rollout']:6.2f} s, idle "
            f"{m['controller/idle_device_seconds']:6.2f} dev-s, left idle {m['controller/idle_device_seconds_spot']:6.2f}, "
            f"spot updates {m.get('spot/steps', 0):.0f}, stop latency {m['controller/stop_latency']:.3f} s)"))
    timed = {k: [r for r in v if r["step"] > args.skip] or v for k, v in hist.items()}
    mean = lambda rows, key: float(statistics.fmean(r.get(key, 0.0) for r in rows))  # noqa: E731
    summary = {name: {
        "mean_step_s": mean(rows, "time/step"), "mean_rollout_s": mean(rows, "time/rollout"),
        "idle_device_s": mean(rows, "controller/idle_device_seconds"),
        "idle_device_s_left": mean(rows, "controller/idle_device_seconds_spot"),
        "spot_updates_per_step": mean(rows, "spot/steps"), "stop_latency_s": mean(rows, "controller/stop_latency"),
    } for name, rows in timed.items()}
    losses = [(r["step"], r["spot/loss_first"], r["spot/loss_last"]) for r in hist["spot"] if "spot/loss_first" in r]
    s, i = summary["spot"], summary["idle"]
    step_ratio, rollout_ratio = s["mean_step_s"] / i["mean_step_s"], s["mean_rollout_s"] / i["mean_rollout_s"]
    print(f"\nstep time: spot training {s['mean_step_s']:.2f} s vs idle {i['mean_step_s']:.2f} s -> "
          f"{100 * (step_ratio - 1):+.1f}% (rollout {100 * (rollout_ratio - 1):+.1f}%); idle device-seconds per step "
          f"{i['idle_device_s']:.2f} -> {s['idle_device_s_left']:.2f} left idle with {s['spot_updates_per_step']:.1f} "
          f"spot updates per step")
    if losses:
        print(f"drafter loss: {losses[0][1]:.3f} (first spot update) -> {losses[-1][2]:.3f} (last)")
    common.write_json({"benchmark": "spot_training", "machine": common.machine(), "args": vars(args),
                       "summary": summary, "step_time_ratio": step_ratio, "rollout_time_ratio": rollout_ratio,
                       "drafter_loss": losses, "history": hist}, args.out)
    return np.isfinite(step_ratio)


if __name__ == "__main__":
    main()
