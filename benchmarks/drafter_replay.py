"""Which online optimiser keeps the drafter aligned? Online drafter training replayed on one RL trajectory.

One policy trajectory, several online optimiser settings ("variants"). An RL trainer of the config
runs ``--steps`` steps at the policy lr ``--lr`` (2e-3 by default: the policy drifts, as in
``drafter_alignment.py``) with ``rl.drafter_steps=0``; each step's rollouts (prompt + response tokens
and the target features the engine returned, what the drafter buffer receives) and the policy
parameters that generated them are kept in memory. Then, for each variant, the online drafter
training of `tltjax.rl.trainer.Trainer` is replayed on them from the offline-trained warm-start
drafter: after step t's rollouts enter a `DrafterBuffer`, ``updates`` `drafter_update` steps on
packed windows of the last ``buffer_steps`` steps' rollouts (the trainer's batch shape, window and
random draws), with `tltjax.sft.make_optimizer` at peak ``lr`` after a linear warm-up of ``warmup``
updates, decaying over the run as the trainer's does. Spot training on idle replicas is not replayed.

Every variant sees the same rollouts, so they differ only in their updates, and a setting costs a
replay, not an RL run. At each step t the drafter trained through step t - 1 is scored on step t's
rollouts under step t's policy (what it drafts for at step t), on the response tokens it drafts
(from the second response token on; the target samples the first after the prompt):

- ``top1``: agreement of the drafter's argmax with the policy's;
- ``p_accept``: the policy's probability of the drafter's argmax, the chance that a greedy draft
  token is accepted by speculative sampling.

Step 1 comes before any update (every variant scores as the frozen drafter there), so the means
are over steps 2..N. Sequences are scored on their first ``drafter.seq_len`` entries, as training
windows are cut.

Variants: ``--variant NAME:KEY=VALUE,...`` (repeatable) with KEY among ``lr``, ``warmup``,
``updates`` and ``buffer_steps``; a key left out takes the config's ``rl.drafter_lr``,
``rl.drafter_warmup_steps``, ``rl.drafter_steps`` or ``rl.buffer_steps``. A ``frozen`` variant
(no updates) is always scored. Default: frozen; the offline ``drafter.lr`` without warm-up (the old
online setting); the config's online setting; and the same with twice the updates.

    python benchmarks/drafter_replay.py --steps 20
    python benchmarks/drafter_replay.py --steps 12 --lr 1e-3
    python benchmarks/drafter_replay.py --steps 12 --lr 1e-3 --variant updates8:updates=8 \
        --variant lr3e-3:lr=3e-3,updates=4
    python benchmarks/drafter_replay.py --steps 20 --save /tmp/trajectory.pkl       # keep the trajectory ...
    python benchmarks/drafter_replay.py --load /tmp/trajectory.pkl --variant b1:buffer_steps=1   # ... replay it again
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import pickle
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float

import common
from tltjax import sft, tiny_policy
from tltjax.config import load_config
from tltjax.data import segment_mask
from tltjax.drafter.buffer import DrafterBuffer
from tltjax.drafter.model import load_drafter
from tltjax.drafter.offline import get_drafter
from tltjax.drafter.packing import PackedDrafterBatch, Window, fill_rows
from tltjax.drafter.train import DrafterTrainState, drafter_update
from tltjax.rl.trainer import hash_seed

FROZEN = "frozen:updates=0"
SETTINGS = {  # variant key: (its rl config field, type)
    "lr": ("drafter_lr", float),
    "warmup": ("drafter_warmup_steps", int),
    "updates": ("drafter_steps", int),
    "buffer_steps": ("buffer_steps", int),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """An online optimiser setting: peak ``lr`` after a linear warm-up of ``warmup`` updates, ``updates``
    per RL step on windows of the last ``buffer_steps`` steps' rollouts."""

    name: str
    lr: float
    warmup: int
    updates: int
    buffer_steps: int


def parse_variant(spec: str, rl) -> Variant:
    """The `Variant` of ``NAME:KEY=VALUE,...``; keys left out take their ``rl`` config field (`SETTINGS`)."""
    name, _, settings = spec.partition(":")
    values = {key: kind(rl[field]) for key, (field, kind) in SETTINGS.items()}
    for item in filter(None, settings.split(",")):
        key, eq, value = item.partition("=")
        if key not in SETTINGS or not eq:
            raise SystemExit(f"--variant {spec!r}: {item!r} is not KEY=VALUE with KEY one of {', '.join(SETTINGS)}")
        kind = SETTINGS[key][1]
        try:
            values[key] = kind(value)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise SystemExit(f"--variant {spec!r}: {key}={value!r} is not {what}") from None
    v = Variant(name, **values)
    problems = [msg for bad, msg in (
        (not name, "the name before ':' is empty"),
        (not v.lr > 0, f"lr={v.lr} must be > 0"),
        (v.warmup < 0, f"warmup={v.warmup} must be >= 0"),
        (v.updates < 0, f"updates={v.updates} must be >= 0 (0: frozen)"),
        (v.buffer_steps < 1, f"buffer_steps={v.buffer_steps} must be >= 1"),
    ) if bad]
    if problems:
        raise SystemExit(f"--variant {spec!r}: " + "; ".join(problems))
    return v


def variants_of(specs: list[str], cfg) -> list[Variant]:
    """The variants of the ``--variant`` specs (none: `default_specs`), a frozen one first unless one is named so."""
    specs = specs or default_specs(cfg)
    variants = [parse_variant(s, cfg.rl) for s in specs]
    if "frozen" not in {v.name for v in variants}:
        variants.insert(0, parse_variant(FROZEN, cfg.rl))
    names = [v.name for v in variants]
    if len(set(names)) < len(names):
        raise SystemExit(f"--variant names must differ; got {names}")
    return variants


def default_specs(cfg) -> list[str]:
    """Frozen; the offline drafter.lr without warm-up (the old online setting); the config's online
    setting; the same with twice the updates."""
    return [FROZEN, f"offline_lr:lr={cfg.drafter.lr},warmup=0", "default",
            f"more_updates:updates={2 * cfg.rl.drafter_steps}"]


@dataclasses.dataclass
class StepRollouts:
    """One RL step's rollouts as the drafter buffer receives them, and the policy that generated them."""

    step: int
    target_params: nnx.State  # host copy of the rollout policy's state (nnx.state of the CausalLM)
    contexts: list[np.ndarray]  # prompt + response tokens of each sequence
    features: list[np.ndarray]  # [len(context) - 1, F]: the target feature at each position but the last
    prompt_lengths: list[int]
    metrics: dict[str, float]  # the RL step's


@dataclasses.dataclass
class Trajectory:
    """The rollouts of consecutive RL steps of the policy trained from the tiny policy at ``policy_dir``."""

    policy_dir: str
    lr: float  # the policy's RL learning rate
    steps: list[StepRollouts]

    def save(self, path: str) -> None:
        """A pickle of plain dicts (no class of this script's), for `load`."""
        with open(path, "wb") as f:
            pickle.dump({"policy_dir": self.policy_dir, "lr": self.lr, "steps": [vars(s) for s in self.steps]}, f)
        print(f"wrote {path}")

    @classmethod
    def load(cls, path: str) -> "Trajectory":
        with open(path, "rb") as f:
            d = pickle.load(f)
        return cls(d["policy_dir"], d["lr"], [StepRollouts(**s) for s in d["steps"]])


def collect(args) -> Trajectory:
    """``args.steps`` RL steps at policy lr ``args.lr`` without online drafter updates; every step's rollouts."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = common.make_trainer(args.config, args.set, tmp, args.steps,
                                      {"rl.lr": args.lr, "rl.drafter_steps": 0})
        policy_dir = str(trainer.policy_dir)
        # the sequences the trainer hands its drafter buffer (per replica, with a controller): its one hook
        harvested: dict[int, list] = {}
        harvest = trainer._harvest

        def record(step, seqs):
            harvested.setdefault(step, []).extend(seqs)
            harvest(step, seqs)

        trainer._harvest = record
        steps = []
        try:
            for step in range(1, args.steps + 1):
                t0 = time.perf_counter()
                # a host copy of the rollout's policy: the update donates the trainer's
                params = jax.device_get(nnx.state(nnx.merge(trainer.state.graphdef, trainer.local_params)))
                m = trainer.step(step).metrics
                seqs = harvested.pop(step)
                steps.append(StepRollouts(
                    step=step, target_params=params, contexts=[np.asarray(s.context, np.int32) for s in seqs],
                    features=[np.asarray(s.features) for s in seqs], prompt_lengths=[len(s.prompt) for s in seqs],
                    metrics=m))
                print(f"step {step:3d}: reward {m['reward/mean']:.3f}, length {m['response_length/mean']:.0f}, "
                      f"entropy {m['entropy']:.3f}, accept {m['rollout/accept_length']:.2f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        finally:
            trainer.close()
    return Trajectory(policy_dir, args.lr, steps)


def scoring_batches(rollouts: StepRollouts, rows: int, row_len: int) -> list[tuple[PackedDrafterBatch, np.ndarray]]:
    """Every sequence of the step (its first ``row_len`` entries) as one window, laid end to end in
    ``[rows, row_len]`` batches, each with its ``drafted`` mask: entry ``t`` of a window is True when
    drafter position ``t`` predicts a token the drafter drafts, ``x_{t+2}`` with ``t + 2 > prompt length``."""
    out, placed = [], []
    drafted = np.zeros((rows, row_len), bool)
    row = off = 0
    for i, (tokens, features, prompt) in enumerate(zip(rollouts.contexts, rollouts.features,
                                                       rollouts.prompt_lengths)):
        n = min(len(features), row_len)
        if n < 2:
            continue
        if off + n > row_len:
            row, off = row + 1, 0
        if row == rows:
            out.append((fill_rows(placed, rows, row_len), drafted))
            placed, drafted, row = [], np.zeros((rows, row_len), bool), 0
        placed.append((Window(tokens=tokens[:n], features=features[:n], hidden=None, step=rollouts.step, sequence=i,
                              offset=0), row, off))
        drafted[row, off : off + n] = np.arange(n) + 2 > prompt
        off += n
    if placed:
        out.append((fill_rows(placed, rows, row_len), drafted))
    return out


@functools.partial(jax.jit, static_argnums=(0, 2))
def _score_sums(
    graphdef, params: nnx.State, target_graphdef, target_params: nnx.State, batch: PackedDrafterBatch,
    drafted: Bool[Array, "rows seq"],
) -> tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""]]:
    """(top-1 agreements, sum of the policy's probability of the drafter's argmax, positions) over the
    valid drafted positions of ``batch``."""
    drafter, target = nnx.merge(graphdef, params), nnx.merge(target_graphdef, target_params)
    tokens, features, hidden, _, valid = batch.aligned(drafter.config, target.config.num_hidden_layers)
    layout = batch.layout()
    out = drafter(target, tokens, features, positions=layout["positions"], mask=segment_mask(layout["segment_ids"]))
    logits = target.logits_from_hidden(hidden.astype(target.config.jnp_dtype))
    guess = jnp.argmax(out.logits, -1)
    top1 = (guess == jnp.argmax(logits, -1)).astype(jnp.float32)
    p_accept = jnp.take_along_axis(jax.nn.softmax(logits, -1), guess[..., None], -1)[..., 0]
    m = (valid & drafted[:, :-1]).astype(jnp.float32)
    return jnp.sum(m * top1), jnp.sum(m * p_accept), jnp.sum(m)


def score(state: DrafterTrainState, target_params: nnx.State, batches) -> tuple[float, float]:
    """(top-1 agreement, mean p_accept) of ``state``'s drafter on `scoring_batches`
    under the policy ``target_params``."""
    sums = np.zeros(3)
    for batch, drafted in batches:
        sums += np.asarray(jax.device_get(_score_sums(state.graphdef, state.params, state.target_graphdef,
                                                      target_params, batch, drafted)))
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])


def replay(variant: Variant, trajectory: list[StepRollouts], batches: list, drafter, target, cfg,
           pad_id: int) -> dict[str, list[float]]:
    """``variant``'s online training of ``drafter`` along ``trajectory``, as `Trainer` runs it inline;
    the ``top1`` and ``p_accept`` curves (`score` before each step's updates)."""
    rl = cfg.rl
    decay = len(trajectory) * max(variant.updates, cfg.controller.spot_max_steps or 64)  # as the trainer's
    tx = sft.make_optimizer(variant.lr, max(decay, 1), variant.warmup, 0.0, 1.0)
    state = DrafterTrainState.create(drafter, target, tx, ce_weight=cfg.drafter.ce_weight)
    buffer = DrafterBuffer.for_drafter(drafter.config, target.config.num_hidden_layers, rl.buffer_tokens)
    curves = {"top1": [], "p_accept": []}
    for rollouts, step_batches in zip(trajectory, batches):
        for key, value in zip(curves, score(state, rollouts.target_params, step_batches)):
            curves[key].append(value)
        for tokens, features in zip(rollouts.contexts, rollouts.features):
            buffer.add(rollouts.step, tokens, features)
        rng = np.random.default_rng(hash_seed(cfg.seed + 1, rollouts.step))  # the trainer's draws
        for _ in range(variant.updates):
            batch = buffer.sample_batch(rng, rl.drafter_batch, cfg.drafter.seq_len, window=rl.drafter_window,
                                        last_steps=variant.buffer_steps, pad_id=pad_id)
            state, _ = drafter_update(state, rollouts.target_params, batch)
    return curves


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(common.REPO / "configs/default.py"))
    p.add_argument("--steps", type=int, default=20, help="RL steps collected (with --load: the first ones replayed)")
    p.add_argument("--lr", type=float, default=2e-3, help="policy learning rate (10x the default 2e-4: the policy drifts)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides, e.g. rl.drafter_batch=32")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="an online optimiser setting (repeatable), KEY in lr, warmup, updates, buffer_steps; none: "
                        "frozen, offline_lr, default, more_updates")
    p.add_argument("--save", help="write the collected trajectory (pickle) here")
    p.add_argument("--load", help="replay a trajectory written by --save instead of collecting one")
    p.add_argument("--out", default="benchmarks/results/drafter_replay.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.steps < 2:
        raise SystemExit(f"--steps={args.steps}: need at least 2 (step 1 comes before any update)")
    cfg = load_config(args.config, [f"--config.{kv}" for kv in args.set])
    variants = variants_of(args.variant, cfg)
    trajectory = Trajectory.load(args.load) if args.load else collect(args)
    if len(trajectory.steps) < args.steps:
        n = len(trajectory.steps)
        raise SystemExit(f"--steps={args.steps}, but {args.load} holds {n} steps; pass --steps {n} or fewer")
    if args.save:
        trajectory.save(args.save)
    steps = trajectory.steps[: args.steps]
    policy_dir = pathlib.Path(trajectory.policy_dir)
    target, tokenizer = tiny_policy.load_policy(policy_dir)
    drafter = load_drafter(get_drafter(cfg, policy_dir, progress=False), target.config)
    batches = [scoring_batches(r, cfg.rl.drafter_batch, cfg.drafter.seq_len) for r in steps]

    results = {}
    for v in variants:
        t0 = time.perf_counter()
        curves = replay(v, steps, batches, drafter, target, cfg, tokenizer.pad_id or 0)
        results[v.name] = {**dataclasses.asdict(v), **curves,
                           **{f"{k}_mean": statistics.fmean(c[1:]) for k, c in curves.items()},
                           "seconds": time.perf_counter() - t0}
        for key, label in (("top1", "top-1"), ("p_accept", "p(accept)")):
            print(f"{v.name if key == 'top1' else '':14s} {label:9s} " + " ".join(f"{x:.3f}" for x in curves[key])
                  + f" | mean of steps 2-{len(steps)} {results[v.name][key + '_mean']:.3f}", flush=True)

    n = len(steps)
    print(f"\npolicy lr {trajectory.lr:g}, {n} steps; on the drafted response tokens of each step, the drafter "
          f"trained through the step before:")
    print(f"{'':14s} {'':>7s} {'':>7s} {'':>7s} {'':>6s} | {'top-1':^23s} | {'p(accept)':^16s}")
    print(f"{'variant':14s} {'lr':>7s} {'warm-up':>7s} {'updates':>7s} {'buffer':>6s} | {'step 2':>7s} "
          f"{f'2-{n}':>7s} {f'step {n}':>7s} | {f'2-{n}':>7s} {f'step {n}':>8s}")
    for name, r in results.items():
        lr, warmup = (f"{r['lr']:.0e}", str(r["warmup"])) if r["updates"] else ("-", "-")  # frozen: no optimiser
        print(f"{name:14s} {lr:>7s} {warmup:>7s} {r['updates']:7d} {r['buffer_steps']:6d} | "
              f"{r['top1'][1]:7.3f} {r['top1_mean']:7.3f} {r['top1'][-1]:7.3f} | "
              f"{r['p_accept_mean']:7.3f} {r['p_accept'][-1]:8.3f}")
    common.write_json({"benchmark": "drafter_replay", "machine": common.machine(), "args": vars(args),
                       "trajectory": {"policy_dir": trajectory.policy_dir, "lr": trajectory.lr, "steps": n},
                       "settings": {"rows": cfg.rl.drafter_batch, "row_len": cfg.drafter.seq_len,
                                    "window": cfg.rl.drafter_window, "buffer_tokens": cfg.rl.buffer_tokens,
                                    "ce_weight": cfg.drafter.ce_weight},
                       "averaged_steps": [2, n], "variants": results,
                       "history": [{"step": r.step, **r.metrics} for r in steps]}, args.out)
    return results


if __name__ == "__main__":
    main()
