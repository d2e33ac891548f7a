"""Batch buckets of the rollout engine: compile time of the program pool against rollout time.

Every batch bucket costs a compiled plain program, and every bucket up to ``rollout.spec_threshold``
a speculative one per strategy; a batch runs in the smallest bucket that holds it, so fewer
buckets means more padded rows. For each bucket set (``--buckets NAME:4,16,64,128``, repeatable;
``pow2`` is the engine's powers of two) an RL trainer of the config is built, its engine warmed up
(every program compiled, timed), and then the same ``--rollouts`` rollouts (the trainer's first
prompt batches, ``rl.samples_per_prompt`` samples each, the RL step's sampling, speculation and
features) are timed with the policy and drafter unchanged. The same seeds give the same tokens under
every bucket set (speculation is lossless and the sampling keys do not depend on the bucket); the
script checks that the token counts agree.

Each set is measured ``--repeats`` times, the sets alternating, and the median of each is reported.

    python benchmarks/engine_buckets.py
    python benchmarks/engine_buckets.py --buckets pow2: --buckets from8:8,16,32,64,128 --rollouts 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import common

DEFAULT_SETS = ("pow2:", "from4:4,8,16,32,64,128", "four:4,16,64,128")


def parse_set(text: str) -> tuple[str, tuple[int, ...]]:
    name, _, sizes = text.partition(":")
    if not name:
        raise SystemExit(f"--buckets {text!r}: expected NAME:SIZE,SIZE,... (NAME: for the powers of two)")
    try:
        return name, tuple(int(s) for s in sizes.split(",") if s.strip())
    except ValueError:
        raise SystemExit(f"--buckets {text!r}: sizes must be integers") from None


def measure(args, buckets: tuple[int, ...]) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        trainer = common.make_trainer(args.config, args.set, workdir, 1, {"rollout.batch_buckets": buckets})
        try:
            t0 = time.perf_counter()
            trainer.warmup()
            warmup = time.perf_counter() - t0
            engine = trainer._engines()[0]
            times, tokens = [], 0
            for i in range(args.rollouts):
                prompts = [trainer.prompt_ids[j] for j in trainer.sampler.next()]
                t0 = time.perf_counter()
                _, stats = engine.generate(
                    prompts, n=trainer.rl.samples_per_prompt, sampling=trainer.sampling,
                    max_new_tokens=trainer.rl.max_new_tokens, stop_ids=(trainer.eos_id,), seed=i,
                    strategy=trainer.rollout_strategy, return_features=trainer.train_drafter)
                times.append(time.perf_counter() - t0)
                tokens += stats.tokens
            return dict(buckets=list(engine.config.buckets), programs=engine.num_programs,
                        warmup_s=warmup, rollout_s=sum(times), rollouts_s=times, tokens=tokens)
        finally:
            trainer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(common.REPO / "configs/default.py"))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--buckets", action="append", default=None, metavar="NAME:SIZES",
                   help=f"bucket sets to compare (default: {' '.join(DEFAULT_SETS)})")
    p.add_argument("--rollouts", type=int, default=6, help="rollouts timed per measurement")
    p.add_argument("--repeats", type=int, default=1, help="measurements per bucket set, alternating")
    p.add_argument("--out", default="benchmarks/results/engine_buckets.json")
    args = p.parse_args()
    sets = [parse_set(s) for s in (args.buckets or DEFAULT_SETS)]
    runs: dict[str, list[dict]] = {name: [] for name, _ in sets}
    for r in range(args.repeats):
        for name, buckets in sets:
            m = measure(args, buckets)
            runs[name].append(m)
            print(f"[{r + 1}/{args.repeats}] {name:8s} buckets {m['buckets']}: {m['programs']} programs, "
                  f"warm-up {m['warmup_s']:.1f} s, {args.rollouts} rollouts {m['rollout_s']:.1f} s "
                  f"({m['tokens']} tokens)", flush=True)
    tokens = {m["tokens"] for ms in runs.values() for m in ms}
    if len(tokens) != 1:
        print(f"warning: the bucket sets generated different token counts {sorted(tokens)}")
    summary = {name: dict(buckets=ms[0]["buckets"], programs=ms[0]["programs"],
                          warmup_s=statistics.median(m["warmup_s"] for m in ms),
                          rollout_s=statistics.median(m["rollout_s"] for m in ms)) for name, ms in runs.items()}
    print(f"\n{'set':8s} {'programs':>8s} {'warm-up s':>10s} {'rollouts s':>10s}")
    for name, s in summary.items():
        print(f"{name:8s} {s['programs']:8d} {s['warmup_s']:10.1f} {s['rollout_s']:10.1f}")
    common.write_json({"benchmark": "engine_buckets", "machine": common.machine(), "args": vars(args),
                       "same_tokens": len(tokens) == 1, "summary": summary, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
