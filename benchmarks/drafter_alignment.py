"""Does the online drafter keep up with a drifting policy? Accept length per RL step, three drafters.

One policy trajectory, three drafters. Three RL trainers of the default config (same seed, same
prompts, same offline-trained warm-start drafter) roll out every step with the *same* policy:
  (a) frozen:     the warm-start drafter, never updated (``rl.drafter_steps=0``);
  (b) online:     the drafter trained every step on the rollouts' own features, with the default
                  online settings (``rl.drafter_steps``, ``rl.drafter_lr``, ``rl.drafter_warmup_steps``);
  (c) model-free: n-gram drafting from the context (no drafter at all).
The online arm is the RL run; before each step the other two take a copy of its policy (params
and optimiser state), so their rollouts differ from its only in the drafting and, through it, in
the random draws (speculation is lossless: the same distribution). Their own policy updates are
thrown away. Without this each arm's policy would follow its own trajectory, and at a high lr
those part ways (in one such run the online arm's reward fell to 0 and its entropy doubled
while the frozen arm's did not), which says nothing about the drafters.

How the policy is made to drift. RL at lr 5e-4 or 1e-3 (the default is 2e-4) mostly sharpens the tiny
policy: its outputs get more predictable and a frozen drafter gets *easier* to match. This
benchmark's RL runs at ``--lr 2e-3`` (10x the default) instead: the updates move the policy faster
than the reward can guide them, the reward falls (about 0.5 -> 0.01 within 8 steps) and then the
policy collapses into loops that run to the length cap (mean response length about 35 -> 200
tokens by step 20). ``--lr 1.5e-3`` drifts without collapsing (reward 0.5 -> about 0.15, length
45 -> 41-59 tokens). Neither drift is progress; they stand in for the slow shift of a long real
RL run, and the reward and length curves (JSON, PNG) show them. Nothing else changes: task,
reward, prompts and drafters are the default's.

Reported: accept length per step for each arm, their means over the first 3 and the last 5
steps, and online / frozen over the last 5 steps (JSON + PNG).

    python benchmarks/drafter_alignment.py --steps 20
    python benchmarks/drafter_alignment.py --steps 20 --lr 1.5e-3 \
        --out benchmarks/results/drafter_alignment_lr1.5e-3.json --plot benchmarks/results/drafter_alignment_lr1.5e-3.png
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import common

ARMS = {  # the online arm last: the others copy its policy before it takes the step
    "frozen": {"rl.drafter_steps": 0},
    "model_free": {"rl.drafter_steps": 0, "rollout.strategies": ("ngram:depth=4",)},
    "online": {},
}
DRIVER = "online"
FIRST, LAST = 3, 5  # steps averaged for the "start" and "end" figures


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(common.REPO / "configs/default.py"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=2e-3, help="policy learning rate (10x the default 2e-4: the policy drifts)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every arm")
    p.add_argument("--out", default="benchmarks/results/drafter_alignment.json")
    p.add_argument("--plot", default="benchmarks/results/drafter_alignment.png")
    return p.parse_args(argv)


def make_trainer(args, workdir: str, overrides: dict):
    return common.make_trainer(args.config, args.set, workdir, args.steps, {"rl.lr": args.lr, **overrides})


def follow(trainer, driver) -> None:
    """``trainer`` takes a copy of ``driver``'s policy (params and optimiser state) into its engine."""
    import jax
    import jax.numpy as jnp

    trainer.state = jax.tree.map(jnp.copy, driver.state)  # a copy: the policy update donates its state
    trainer.local_params = trainer.state.params
    trainer._sync_engine()


def start_end(values: list[float]) -> dict[str, float]:
    """Means over the first `FIRST` and the last `LAST` steps."""
    return {"start": statistics.fmean(values[:FIRST]), "end": statistics.fmean(values[-LAST:])}


def plot(hist: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("rollout/accept_length", "accept length (tokens / verify)", "drafter alignment"),
              ("reward/mean", "reward mean", "policy: reward"),
              ("response_length/mean", "response length (tokens)", "policy: response length")]
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 3.6))
    for ax, (key, ylabel, title) in zip(axes, panels):
        for name, rows in hist.items():
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker=".", label=name)
        ax.set(xlabel="RL step", ylabel=ylabel, title=title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    if args.steps < FIRST + LAST:
        raise SystemExit(f"--steps={args.steps}: need at least {FIRST + LAST} (first {FIRST} and last {LAST} are averaged)")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: make_trainer(args, f"{tmp}/{name}", o) for name, o in ARMS.items()}
        online = runs["online"].rl
        online_settings = {k: online[k] for k in ("drafter_steps", "drafter_batch", "drafter_lr", "drafter_warmup_steps",
                                                  "buffer_steps")}

        def before(name: str, step: int) -> None:
            if name != DRIVER:
                follow(runs[name], runs[DRIVER])

        hist = common.alternate_steps(runs, args.steps, before=before, line=lambda name, m: (
            f"accept {m['rollout/accept_length']:.2f}, reward {m['reward/mean']:.3f}, length "
            f"{m['response_length/mean']:.0f}, entropy {m['entropy']:.3f}"
            + (f", drafter top1 {m['drafter/top1']:.2f}" if "drafter/top1" in m else "")))
    curves = {k: [r["rollout/accept_length"] for r in v] for k, v in hist.items()}
    accept = {k: start_end(v) for k, v in curves.items()}
    policy = {k: {"reward": start_end([r["reward/mean"] for r in v]),
                  "response_length": start_end([r["response_length/mean"] for r in v])} for k, v in hist.items()}
    ratio = accept["online"]["end"] / accept["frozen"]["end"]
    print(f"\naccept length, mean of the first {FIRST} -> last {LAST} steps: "
          + ", ".join(f"{k} {v['start']:.2f} -> {v['end']:.2f}" for k, v in accept.items())
          + f"; online / frozen at the end {ratio:.2f}x")
    print("reward: " + ", ".join(f"{k} {v['reward']['start']:.3f} -> {v['reward']['end']:.3f}" for k, v in policy.items()))
    try:
        plot(hist, args.plot)
    except ImportError:
        print("matplotlib is not installed: no plot")
    common.write_json({"benchmark": "drafter_alignment", "machine": common.machine(), "args": vars(args),
                       "online_settings": online_settings, "averaged_steps": {"start": FIRST, "end": LAST},
                       "accept_length": curves, "accept_length_start_end": accept, "policy_start_end": policy,
                       "online_over_frozen_end": ratio, "history": hist}, args.out)


if __name__ == "__main__":
    main()
