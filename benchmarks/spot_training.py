"""Spot drafter training must not delay the critical path: RL steps with it on vs off, side by side.

Three trainers from the same config and seed run on rollout replicas
(``controller.replica_size``) over virtual CPU devices, speculation off (so the
drafter cannot change the rollout): two train the drafter on the replicas that
finish early (spot training), one with the contention guard of the config
(``controller.spot_guard``, which rations the updates by how much they slow the
decoding replicas down) and one without it; the third leaves them idle. Their
steps alternate, the arm that goes first changing every step (it pays the
compilations they share). Reported per spot arm against the idle one: mean RL
step time and rollout wall time, and their ratio (the target is within 2%), idle
device-seconds without and with spot training, spot updates per RL step, their
mean duration, the stop latency (how long the step boundary waited for the update
in flight), background compilation time, the guard's measured slowdown and duty,
and the drafter's loss over the run; and the machine's load average before and
after (the virtual devices share the host's cores with whatever else runs there)
and its measured parallelism (`common.host_parallelism`: how many single-threaded
computations it runs at once at full speed), which bounds what an "idle" virtual
device has to itself.

``--emulate-free-devices`` models training devices that are separate hardware
(GPUs), which this host's virtual devices are not: a spot update runs its real
host side (sampling, packing, placing the state and batch on the training mesh,
the trainer thread, the guard, the stop), and its device computation is a sleep
as long as a real update of that mesh size (the first ``--calibrate`` updates of
each size run for real; the shortest of them sets the sleep). The decoding replicas then lose only
what the host side of spot training costs them, as on GPUs; the drafter does
not learn past those first updates.

    python benchmarks/spot_training.py --steps 8
    python benchmarks/spot_training.py --devices 8 --replica-size 2 --steps 10
    python benchmarks/spot_training.py --steps 24 --emulate-free-devices
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, help="config file (default: configs/default.py)")
    p.add_argument("--devices", type=int, default=4, help="virtual CPU devices (set before JAX starts)")
    p.add_argument("--replica-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the timing (compilations)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. rl.lr=1e-4")
    p.add_argument("--no-unguarded", dest="unguarded", action="store_false",
                   help="leave out the third arm: spot training without the contention guard")
    p.add_argument("--emulate-free-devices", action="store_true",
                   help="model the training devices as separate hardware: an update's device computation is a "
                        "sleep as long as a real one (see the module)")
    p.add_argument("--calibrate", type=int, default=1,
                   help="with --emulate-free-devices: real updates per mesh size before the sleeps")
    p.add_argument("--out", default="benchmarks/results/spot_training.json")
    return p.parse_args(argv)


class FreeDeviceEmulation:
    """Makes a `SpotTrainer`'s updates cost the host only their host side (see ``--emulate-free-devices``).

    The first ``calibrate`` updates of each mesh size run the real program and are timed to
    completion; later ones sleep for the shortest of those times (the one least slowed by the
    decoding replicas) and return the state unchanged with the last real metrics. A sleep holds
    neither a core nor the GIL, like a host thread waiting for a GPU.
    """

    def __init__(self, spot, calibrate: int = 1):
        if calibrate < 1:
            raise ValueError(f"calibrate={calibrate} must be >= 1 (the sleep's length comes from real updates)")
        self.calibrate, self.real, self.emulated = calibrate, 0, 0
        self.seconds: dict[int, list[float]] = {}
        self._metrics: dict[int, object] = {}
        get = spot.programs.get
        spot.programs.get = lambda devices: None if (p := get(devices)) is None else self._wrap(p, len(devices))

    def _wrap(self, program, size: int):
        import jax

        def run(state, target_params, batch):
            times = self.seconds.setdefault(size, [])
            if len(times) < self.calibrate:
                t0 = time.perf_counter()
                state, metrics = jax.block_until_ready(program(state, target_params, batch))
                times.append(time.perf_counter() - t0)
                self._metrics[size], self.real = metrics, self.real + 1
                return state, metrics
            time.sleep(min(times))
            self.emulated += 1
            return state, self._metrics[size]

        return run

    def summary(self) -> dict:
        return {"real_updates": self.real, "emulated_updates": self.emulated,
                "update_s": {str(k): min(v) for k, v in sorted(self.seconds.items())}}


def make_trainer(args, workdir: str, spot: bool, guard: bool = True):
    import common

    extra = {} if guard else {"controller.spot_guard": 0.0}
    return common.make_trainer(args.config, args.set, workdir, args.steps, {
        "rl.drafter_steps": 0,  # no inline drafter updates: only spot training differs
        "rollout.spec_threshold": 0,  # speculation off: the rollout is the same with or without
        "controller.replica_size": args.replica_size, "controller.spot_training": spot, **extra})


def main(argv=None):
    args = parse_args(argv)
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np

    import common

    args.config = args.config or str(common.REPO / "configs/default.py")
    cores = common.host_parallelism(workers=args.devices)  # what "idle" virtual devices can have to themselves
    print(f"host: {cores['cpu_count']} CPUs, {cores['effective_cores']:.2f} cores' worth of computation at once "
          f"(a single-threaded loop: {cores['alone_s']:.2f} s alone, "
          + ", ".join(f"{t:.2f}" for t in cores["together_s"]) + f" s as {cores['workers']} at once)")
    if args.emulate_free_devices:
        print("emulated free devices: a spot update's device computation is a sleep as long as a real update "
              "(its host side runs for real), as if the idle replicas were separate chips")
    elif cores["effective_cores"] < args.devices - 0.5:
        print(f"note: {args.devices} virtual devices share about {cores['effective_cores']:.1f} cores' worth of "
              "computation here, so an idle replica is not free hardware: the rollout time of the spot arm "
              "includes contention, and the controller's own cost is the stop latency")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"spot": make_trainer(args, f"{tmp}/spot", True), "idle": make_trainer(args, f"{tmp}/idle", False)}
        if args.unguarded:
            runs["unguarded"] = make_trainer(args, f"{tmp}/unguarded", True, guard=False)
        emulations = {name: FreeDeviceEmulation(t.controller.spot, args.calibrate)
                      for name, t in runs.items() if args.emulate_free_devices and name != "idle"}
        hist = common.alternate_steps(runs, args.steps, rotate=True, line=lambda name, m: (
            f"{m['time/step']:6.2f} s (rollout {m['time/rollout']:6.2f} s, idle "
            f"{m['controller/idle_device_seconds']:6.2f} dev-s, left idle {m['controller/idle_device_seconds_spot']:6.2f}, "
            f"spot updates {m.get('spot/steps', 0):.0f} of {m.get('spot/update_seconds', 0):.2f} s, stop latency "
            f"{m['controller/stop_latency']:.3f} s (" + ", ".join(
                f"{v:.3f} {k.removeprefix('spot/stop_')}" for k, v in m.items() if k.startswith("spot/stop_while_"))
            + f"), compiling {m.get('spot/compile_seconds', 0):.1f} s"
            + (f"; guard: slowdown {m['spot/guard_slowdown']:.2f}, duty {m['spot/guard_duty']:.3f}"
               if "spot/guard_duty" in m else "") + ")"))
    load_after = os.getloadavg()
    timed = {k: [r for r in v if r["step"] > args.skip] or v for k, v in hist.items()}
    mean = lambda rows, key: float(statistics.fmean(r.get(key, 0.0) for r in rows))  # noqa: E731
    summary = {name: {
        "mean_step_s": mean(rows, "time/step"), "mean_rollout_s": mean(rows, "time/rollout"),
        "idle_device_s": mean(rows, "controller/idle_device_seconds"),
        "idle_device_s_left": mean(rows, "controller/idle_device_seconds_spot"),
        "spot_updates_per_step": mean(rows, "spot/steps"), "stop_latency_s": mean(rows, "controller/stop_latency"),
        "max_stop_latency_s": max(r.get("controller/stop_latency", 0.0) for r in rows),
        "spot_update_s": mean([r for r in rows if r.get("spot/steps")] or rows, "spot/update_seconds"),
        "spot_compile_s": mean(rows, "spot/compile_seconds"), "spot_compile_waits": mean(rows, "spot/compile_waits"),
        "stop_in_update_s": mean(rows, "spot/stop_in_update"), "stop_after_update_s": mean(rows, "spot/stop_after_update"),
        "mean_update_s": mean(rows, "time/update"),
        # the spot trainer's loop: seconds per phase and step; what the stops waited for, by phase
        "guard_slowdown": rows[-1].get("spot/guard_slowdown"), "guard_duty": rows[-1].get("spot/guard_duty"),
        "spot_phase_s": {k.removeprefix("spot/seconds_"): mean(rows, k) for k in sorted(
            {k for r in rows for k in r if k.startswith("spot/seconds_")})},
        "stop_while": {k.removeprefix("spot/stop_while_"): [r[k] for r in rows if k in r] for k in sorted(
            {k for r in rows for k in r if k.startswith("spot/stop_while_")})},
    } for name, rows in timed.items()}
    i = summary["idle"]
    ratios, losses = {}, {}
    for arm in [a for a in ("spot", "unguarded") if a in summary]:
        s = summary[arm]
        losses[arm] = [(r["step"], r["spot/loss_first"], r["spot/loss_last"]) for r in hist[arm]
                       if "spot/loss_first" in r]
        step_ratio, rollout_ratio = s["mean_step_s"] / i["mean_step_s"], s["mean_rollout_s"] / i["mean_rollout_s"]
        # the same step of both arms has the same rollout and update shapes: its ratio cancels what they share
        per_step = [a["time/step"] / b["time/step"] for a, b in zip(timed[arm], timed["idle"])]
        paired = statistics.median(per_step)
        se = statistics.stdev(per_step) / len(per_step) ** 0.5 if len(per_step) > 1 else float("nan")
        ratios[arm] = {"step_time_ratio": step_ratio, "step_time_ratio_median": paired,
                       "step_time_ratio_paired_mean": statistics.fmean(per_step), "step_time_ratio_se": se,
                       "rollout_time_ratio": rollout_ratio}
        d_step, d_rollout = s["mean_step_s"] - i["mean_step_s"], s["mean_rollout_s"] - i["mean_rollout_s"]
        label = "spot training with the guard" if arm == "spot" else "spot training without the guard"
        print(f"\nstep time: {label} {s['mean_step_s']:.2f} s vs idle {i['mean_step_s']:.2f} s -> "
              f"{100 * (step_ratio - 1):+.1f}% (the steps' ratios: mean {100 * (statistics.fmean(per_step) - 1):+.1f}% "
              f"± {100 * se:.1f}% (standard error), median {100 * (paired - 1):+.1f}%; rollout "
              f"{100 * (rollout_ratio - 1):+.1f}%); idle device-seconds per step {i['idle_device_s']:.2f} -> "
              f"{s['idle_device_s_left']:.2f} left idle with {s['spot_updates_per_step']:.1f} spot updates per step")
        print(f"step-time difference {d_step:+.2f} s = rollout {d_rollout:+.2f} s + stop latency "
              f"{s['stop_latency_s']:.3f} s (max {s['max_stop_latency_s']:.3f} s; in the update in flight "
              f"{s['stop_in_update_s']:.3f} s, after it {s['stop_after_update_s']:.3f} s; a spot update takes "
              f"{s['spot_update_s']:.2f} s) + the rest {d_step - d_rollout - s['stop_latency_s']:+.2f} s")
        if s.get("guard_duty") is not None:
            print(f"guard: measured slowdown of a decode call under training {s['guard_slowdown']:.2f}, "
                  f"duty {s['guard_duty']:.3f} (the share of the tail it lets the trainer be busy)")
        if arm in emulations:
            e = emulations[arm].summary()
            print(f"emulated free devices: {e['real_updates']} real updates, {e['emulated_updates']} emulated "
                  "(a sleep of " + ", ".join(f"{v:.3f} s on {k}" for k, v in e["update_s"].items())
                  + " devices); the drafter learned from the real ones only")
        if losses[arm]:
            print(f"drafter loss: {losses[arm][0][1]:.3f} (first spot update) -> {losses[arm][-1][2]:.3f} (last)")
    print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    step_ratio = ratios["spot"]["step_time_ratio"]
    common.write_json({"benchmark": "spot_training", "machine": common.machine(), "args": vars(args),
                       "host_parallelism": cores,
                       "emulated_free_devices": {k: e.summary() for k, e in emulations.items()},
                       "load_average": {"before": load_before, "after": load_after}, "summary": summary,
                       **ratios["spot"], "ratios": ratios,
                       "drafter_loss": losses["spot"], "drafter_losses": losses, "history": hist}, args.out)
    return np.isfinite(step_ratio)


if __name__ == "__main__":
    main()
