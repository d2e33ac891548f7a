"""A long-tailed rollout: plain decoding, each static strategy, TLT's fixed table, and the adaptive engine.

``--prompts`` held-out task prompts × ``--samples`` responses each (≥ 128
sequences), sampled at ``--temperature`` until EOS: response lengths follow the
task's long tail, so the batch shrinks from ``--max-batch`` to a few rows. One
engine, whose pool holds every strategy of ``--strategies`` in every bucket, runs
the same rollout per mode, the modes interleaved within each repeat:

* ``plain``: never speculate;
* ``static:<strategy>``: that strategy in every bucket;
* ``tlt-table``: TLT's reference policy, the first strategy once the active rows
  fit a bucket of at most ``--threshold``, plain above (a fixed table);
* ``adaptive:<policy>``: a `tltjax.rollout.bandit.Bandit` (one per policy of
  ``--bandits``) chooses per bucket and chunk; it persists across the repeats as
  it does across RL steps. Before the repeats it has seen ``--adaptive-warmup``
  rollouts of other prompts (earlier RL steps) and the unreported warm-up pass.

Reported per mode: rollout wall time, the process's CPU time during the rollout
(on a CPU host shared with other work this is the load-independent cost), the
time the last 10% of sequences take (from the moment 90% have finished to the
end) and the mean accept length; and
each adaptive mode's time against the best and the worst of the other modes. On a
shared CPU, give several ``--repeats``: the medians are what the summary compares.

    python benchmarks/long_tail.py --quick
    python benchmarks/long_tail.py --prompts 32 --samples 4 --threshold 16
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import warnings

import numpy as np

import common

DEFAULT_STRATEGIES = ["eagle:depth=2", "eagle:depth=4", "eagle:depth=4,top_k=2,num_verify=6", "ngram:depth=4"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--threshold", type=int, default=16,
                   help="TLT table: speculate (first strategy) when the active rows fit this bucket; also the "
                        "bandit's default for buckets it has not measured")
    p.add_argument("--strategies", nargs="+", default=DEFAULT_STRATEGIES, help="the pool (Strategy.parse specs)")
    p.add_argument("--modes", nargs="+", default=["plain", "static", "tlt-table", "adaptive"],
                   help="which modes to run (static: every strategy of the pool)")
    p.add_argument("--bandits", nargs="+", default=["egreedy", "ucb"],
                   help="an adaptive mode per bandit policy (tltjax.rollout.bandit.POLICIES)")
    p.add_argument("--epsilon", type=float, default=None, help="default: BanditConfig's")
    p.add_argument("--window", type=int, default=None, help="default: BanditConfig's")
    p.add_argument("--hysteresis", type=float, default=None, help="default: BanditConfig's")
    p.add_argument("--adaptive-warmup", type=int, default=3,
                   help="unreported rollouts of other prompts each bandit sees first (earlier RL steps)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="0: every mode generates the same tokens (lossless), so only the schedule differs")
    p.add_argument("--new-tokens", type=int, default=320)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="16 prompts × 8, one repeat")
    p.add_argument("--out", default="benchmarks/results/long_tail.json")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.repeats = 16, 8, 1
    if args.prompts * args.samples < 1 or args.threshold < 0 or args.repeats < 1:
        p.error("--prompts, --samples and --repeats must be >= 1 and --threshold >= 0")
    return args


def tail_time(seqs) -> float:
    """Seconds from the moment 90% of the sequences had finished to the last one finishing."""
    t = np.sort([s.finish_time for s in seqs])
    return float(t[-1] - t[int(np.ceil(0.9 * len(t))) - 1])


def arms_used(trace) -> dict[str, dict[str, int]]:
    """Chunks per bucket and arm of one rollout (from `GenerateStats.batch_trace`)."""
    out: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    for bucket, _, arm in trace:
        out[str(bucket)][arm] += 1
    return {b: dict(v) for b, v in sorted(out.items(), key=lambda kv: int(kv[0]))}


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    from tltjax.rollout.bandit import Bandit, BanditConfig
    from tltjax.rollout.engine import Engine, EngineConfig
    from tltjax.rollout.sampling import SamplingParams
    from tltjax.rollout.speculative import Strategy

    cfg, target, tokenizer, drafter, info = common.load_target_and_drafter(args)
    prompts = common.task_prompts(cfg, tokenizer, args.prompts, args.seed)
    sampling = SamplingParams(args.temperature)
    strategies = [Strategy.parse(s) for s in args.strategies]
    ecfg = EngineConfig(
        max_batch=args.max_batch, max_seq_len=max(len(p) for p in prompts) + args.new_tokens + 1, page_size=16,
        decode_steps=8, spec_rounds=4, spec_threshold=args.threshold, strategies=tuple(strategies),
        spec_max_bucket=args.max_batch, prefill_batch=16, prefill_lengths=(32, 64),
    )
    eng = Engine(target, ecfg, drafter)
    t0 = time.perf_counter()
    eng.warmup(sampling)
    pool = eng.pool_summary()
    bcfg = {k: v for k, v in dict(epsilon=args.epsilon, window=args.window, hysteresis=args.hysteresis).items()
            if v is not None}
    print(f"compiled {pool['programs']} programs ({pool['spec_programs']} speculative, {pool['mb']:.1f} MB) "
          f"in {time.perf_counter() - t0:.0f} s")
    bandits = {f"adaptive:{b}": Bandit(BanditConfig(policy=b, default_threshold=args.threshold, seed=args.seed, **bcfg))
               for b in args.bandits}
    modes: dict[str, object] = {}
    for m in args.modes:
        if m == "plain":
            modes["plain"] = None
        elif m == "static":
            modes.update({f"static:{s.name}": s for s in strategies})
        elif m == "tlt-table":
            modes["tlt-table"] = "auto"  # the first strategy up to spec_threshold, plain above
        elif m == "adaptive":
            modes.update(bandits)
        else:
            raise SystemExit(f"unknown mode {m!r}; choose from plain, static, tlt-table, adaptive")
    results: dict[str, list] = {k: [] for k in modes}
    earlier = []
    for i in range(args.adaptive_warmup):  # the bandits' earlier "RL steps", on other prompts
        other = common.task_prompts(cfg, tokenizer, args.prompts, args.seed + 100 + i)
        for name in (m for m in modes if m in bandits):
            _, st = eng.generate(other, n=args.samples, sampling=sampling, max_new_tokens=args.new_tokens,
                                 stop_ids=[tokenizer.eos_id], seed=args.seed + 100 + i, strategy=bandits[name])
            earlier.append(dict(mode=name, step=i, seconds=st.time_total, metrics=bandits[name].metrics()))
            print(f"  earlier step {i} {name:28s} {st.time_total:6.2f} s", flush=True)
    for rep in range(args.repeats + 1):  # the first pass warms caches (and the bandit) and is not reported
        for name, strat in modes.items():
            c0 = time.process_time()
            seqs, st = eng.generate(prompts, n=args.samples, sampling=sampling, max_new_tokens=args.new_tokens,
                                    stop_ids=[tokenizer.eos_id], seed=args.seed + rep, strategy=strat)
            cpu_s = time.process_time() - c0
            lengths = [len(s.tokens) for s in seqs]
            run = dict(seconds=st.time_total, cpu_seconds=cpu_s, tokens=st.tokens,
                       tokens_per_s=st.tokens / st.time_total,
                       tail_10pct_s=tail_time(seqs), accept_length=st.mean_accept_length,
                       spec_calls=st.spec_calls, decode_calls=st.decode_calls, compilations=st.compilations,
                       length_median=float(np.median(lengths)), length_p99=float(np.percentile(lengths, 99)),
                       length_max=int(max(lengths)), time_spec=st.time_spec, time_decode=st.time_decode,
                       time_prefill=st.time_prefill, time_host=st.time_host, arms=arms_used(st.batch_trace))
            if name in bandits:
                b = bandits[name]
                run["bandit"] = dict(metrics=b.metrics(), table=b.table(), threshold=b.threshold())
            if rep:
                results[name].append(run)
            label = "warm-up" if not rep else f"repeat {rep}"
            print(f"  {label} {name:34s} {st.time_total:6.2f} s ({cpu_s:5.2f} cpu)  "
                  f"{run['tokens_per_s']:6.0f} tok/s  tail {run['tail_10pct_s']:5.2f} s  "
                  f"τ {run['accept_length']:.2f}  lengths median {run['length_median']:.0f} max {run['length_max']}",
                  flush=True)
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in results.items()}
    cpu = {k: statistics.median(r["cpu_seconds"] for r in v) for k, v in results.items()}
    tail = {k: statistics.median(r["tail_10pct_s"] for r in v) for k, v in results.items()}
    tau = {k: statistics.mean(r["accept_length"] for r in v) for k, v in results.items()}
    tps = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in results.items()}
    summary = dict(sequences=len(prompts) * args.samples, seconds=med, cpu_seconds=cpu, tail_10pct_s=tail,
                   accept_length=tau, tokens_per_s=tps)
    if "plain" in med and "tlt-table" in med:  # the fields of the earlier two-mode benchmark
        summary.update(plain_s=med["plain"], speculative_s=med["tlt-table"],
                       rollout_speedup=med["plain"] / med["tlt-table"], plain_tail_s=tail["plain"],
                       speculative_tail_s=tail["tlt-table"],
                       tail_speedup=tail["plain"] / max(tail["tlt-table"], 1e-9))
    adaptive = {}
    for clock, times in (("wall", med), ("cpu", cpu)):
        others = {k: v for k, v in times.items() if k not in bandits}
        if not others:
            break
        best, worst = min(others, key=others.get), max(others, key=others.get)
        summary[f"best_static_{clock}"], summary[f"worst_static_{clock}"] = best, worst
        for name in bandits:
            if name in times:
                a = adaptive.setdefault(name, {})
                a[f"vs_best_{clock}"], a[f"vs_worst_{clock}"] = times[name] / others[best], times[name] / others[worst]
    for name, b in bandits.items():
        if name in adaptive:
            adaptive[name].update(table=b.table(), threshold=b.threshold(), estimates=b.estimates())
    summary["adaptive"] = adaptive
    print(f"\nrollout of {summary['sequences']} sequences (2 shared CPU cores: figures carry other load's noise)")
    print("| mode | rollout s | rollout CPU s | tail (last 10%) s | accept length | tokens/s | vs plain |")
    print("|---|---|---|---|---|---|---|")
    for k in modes:
        vs = f"{med['plain'] / med[k]:.2f}×" if "plain" in med else "—"
        print(f"| {k} | {med[k]:.2f} | {cpu[k]:.2f} | {tail[k]:.2f} | {tau[k]:.2f} | {tps[k]:.0f} | {vs} |")
    for name, a in adaptive.items():
        print(f"\n{name}: wall / best other ({summary['best_static_wall']}) {a['vs_best_wall']:.3f}, / worst "
              f"({summary['worst_static_wall']}) {a['vs_worst_wall']:.3f}; CPU / best ({summary['best_static_cpu']}) "
              f"{a['vs_best_cpu']:.3f}, / worst ({summary['worst_static_cpu']}) {a['vs_worst_cpu']:.3f}; "
              f"table {a['table']}, threshold {a['threshold']}")
    common.write_json(dict(benchmark="long_tail", machine=common.machine(), args=vars(args), models=info,
                           pool={k: v for k, v in pool.items() if k != "arms"}, summary=summary, runs=results,
                           adaptive_earlier_steps=earlier),
                      args.out)


if __name__ == "__main__":
    main()
