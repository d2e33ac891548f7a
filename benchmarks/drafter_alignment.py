"""Does the online drafter keep up with a drifting policy? Accept length per RL step, three drafters.

Three RL runs from the same config, seed and offline-trained drafter, with a
learning rate high enough that the policy drifts within the run:
  (a) frozen:     the drafter of the warm start, never updated;
  (b) online:     the drafter trained every step on the rollouts' own features;
  (c) model-free: n-gram drafting from the context (no drafter at all).
Their steps alternate (a1, b1, c1, a2, ...) in one process. Reported: accept
length per step for each (JSON + PNG, with the reward curves that show the
policy moving), and the gain of (b) over (a) over the last half of the run.

    python benchmarks/drafter_alignment.py --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import common

ARMS = {
    "frozen": {"rl.drafter_steps": 0},
    "online": {},
    "model_free": {"rl.drafter_steps": 0, "rollout.strategies": ("ngram:depth=4",)},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(common.REPO / "configs/default.py"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3, help="policy learning rate (high: the policy drifts)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every arm")
    p.add_argument("--out", default="benchmarks/results/drafter_alignment.json")
    p.add_argument("--plot", default="benchmarks/results/drafter_alignment.png")
    return p.parse_args(argv)


def make_trainer(args, workdir: str, overrides: dict):
    return common.make_trainer(args.config, args.set, workdir, args.steps, {"rl.lr": args.lr, **overrides})


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: make_trainer(args, f"{tmp}/{name}", o) for name, o in ARMS.items()}
        hist = common.alternate_steps(runs, args.steps, lambda name, m: (
            f"accept {m['rollout/accept_length']:.2f}, reward {m['reward/mean']:.3f}, length "
            f"{m['response_length/mean']:.0f}, entropy {m['entropy']:.3f}"
            + (f", drafter top1 {m['drafter/top1']:.2f}" if "drafter/top1" in m else "")))
    curves = {k: [r["rollout/accept_length"] for r in v] for k, v in hist.items()}
    half = args.steps // 2
    late = {k: statistics.fmean(v[half:]) for k, v in curves.items()}
    gain = late["online"] / late["frozen"] - 1 if late["frozen"] else float("nan")
    print(f"\naccept length over the last {args.steps - half} steps: frozen {late['frozen']:.2f}, online "
          f"{late['online']:.2f} ({100 * gain:+.0f}%), model-free {late['model_free']:.2f}; first step "
          + ", ".join(f"{k} {v[0]:.2f}" for k, v in curves.items()))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        for k, v in curves.items():
            ax[0].plot(range(1, len(v) + 1), v, label=k)
            ax[1].plot(range(1, len(v) + 1), [r["reward/mean"] for r in hist[k]], label=k)
        ax[0].set(xlabel="RL step", ylabel="accept length (tokens / verify)", title="drafter alignment")
        ax[1].set(xlabel="RL step", ylabel="reward mean", title="policy")
        ax[0].legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    except ImportError:
        pass
    common.write_json({"benchmark": "drafter_alignment", "machine": common.machine(), "args": vars(args),
                       "accept_length": curves, "late_mean": late, "online_gain_over_frozen": gain,
                       "history": hist}, args.out)


if __name__ == "__main__":
    main()
