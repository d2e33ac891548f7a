"""End-to-end RL steps with and without speculative rollouts, side by side in one process.

Two trainers are built from the same config, seed and policy: one with
speculation below ``rollout.spec_threshold`` (the adaptive drafter trained
online), one with ``rl.baseline = True`` (plain decoding only). Their steps
alternate (step k of one, step k of the other, ...) so that both see the same machine
state. Reported: mean step time of each and the ratio, the rollout share of step
time, the per-phase breakdown, and both reward / accuracy curves. The arm that goes first changes
every step: it pays the compilations the two share (an update width or a log-prob check shape
seen for the first time compiles once per process), so each pays about half of them; the median
of the per-step ratios is reported beside the ratio of the means, as the figure those few
compile-heavy steps do not move. Speculation is
lossless, so the curves must agree within sampling noise (they are not equal
sample for sample: the two rollouts draw different random numbers).

    python benchmarks/rl_step.py --steps 8
    python benchmarks/rl_step.py --config configs/bench.py --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import numpy as np

import common

PHASES = ("time/rollout_plain", "time/rollout_spec", "time/rollout_host", "time/reward", "time/logprob_check",
          "time/update", "time/drafter")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(common.REPO / "configs/default.py"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=1, help="first steps left out of the timing (compilations)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. rl.lr=1e-4")
    p.add_argument("--out", default="benchmarks/results/rl_step.json")
    return p.parse_args(argv)


def make_trainer(args, workdir: str, baseline: bool):
    return common.make_trainer(args.config, args.set, workdir, args.steps, {"rl.baseline": baseline})


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"speculative": make_trainer(args, f"{tmp}/spec", False),
                "baseline": make_trainer(args, f"{tmp}/base", True)}
        hist = common.alternate_steps(runs, args.steps, rotate=True, line=lambda name, m: (
            f"{m['time/step']:6.2f} s (rollout {m['time/rollout']:6.2f} s, accept {m['rollout/accept_length']:.2f}), "
            f"reward {m['reward/mean']:.3f}, length mean {m['response_length/mean']:.0f} max "
            f"{m['response_length/max']:.0f}"))
    timed = {k: [r for r in v if r["step"] > args.skip] or v for k, v in hist.items()}
    mean = lambda rows, key: float(statistics.fmean(r[key] for r in rows))  # noqa: E731
    summary = {}
    for name, rows in timed.items():
        summary[name] = {
            "mean_step_s": mean(rows, "time/step"), "mean_rollout_s": mean(rows, "time/rollout"),
            "rollout_share": mean(rows, "time/rollout") / mean(rows, "time/step"),
            "phases_s": {p: mean(rows, p) for p in PHASES},
            "accept_length": mean(rows, "rollout/accept_length"),
            "reward_mean": float(np.mean([r["reward/mean"] for r in hist[name]])),
            "accuracy_mean": float(np.mean([r["accuracy"] for r in hist[name]])),
        }
    s, b = summary["speculative"], summary["baseline"]
    ratio = b["mean_step_s"] / s["mean_step_s"]
    rollout_ratio = b["mean_rollout_s"] / s["mean_rollout_s"]
    pairs = list(zip(timed["speculative"], timed["baseline"]))
    median = {key: float(statistics.median(y[key] / x[key] for x, y in pairs)) for key in ("time/step", "time/rollout")}
    # reward agreement: difference of the per-step mean rewards relative to its sampling noise
    diffs = np.array([x["reward/mean"] - y["reward/mean"] for x, y in zip(hist["speculative"], hist["baseline"])])
    z = float(diffs.mean() / (diffs.std(ddof=1) / np.sqrt(len(diffs)))) if len(diffs) > 1 and diffs.std() > 0 else 0.0
    print(f"\nstep time: baseline {b['mean_step_s']:.2f} s, speculative {s['mean_step_s']:.2f} s -> {ratio:.2f}x "
          f"(median of the steps' ratios {median['time/step']:.2f}x; rollout {rollout_ratio:.2f}x, median "
          f"{median['time/rollout']:.2f}x; rollout share {b['rollout_share']:.0%} baseline, "
          f"{s['rollout_share']:.0%} speculative; accept length {s['accept_length']:.2f})")
    print(f"reward mean over steps: baseline {b['reward_mean']:.3f}, speculative {s['reward_mean']:.3f} "
          f"(paired z = {z:.2f})")
    common.write_json({"benchmark": "rl_step", "machine": common.machine(), "args": vars(args),
                       "summary": summary, "step_speedup": ratio, "rollout_speedup": rollout_ratio,
                       "step_speedup_median": median["time/step"], "rollout_speedup_median": median["time/rollout"],
                       "reward_paired_z": z, "history": hist}, args.out)


if __name__ == "__main__":
    main()
