"""A long-tailed rollout: plain decoding vs speculation below a batch-size threshold.

``--prompts`` held-out task prompts × ``--samples`` responses each (≥ 128
sequences), sampled at ``--temperature`` until EOS: response lengths follow the
task's long tail, so the batch shrinks from ``--max-batch`` to a few rows. The
same engine runs the rollout twice per repeat, side by side: plain decoding
throughout, and with speculation switched on whenever the active rows fit a
bucket of at most ``--threshold`` (strategy ``--strategy``). Reported: rollout
wall time and speed-up, and the time the last 10% of sequences take (from the
moment 90% have finished to the end).

    python benchmarks/long_tail.py --quick
    python benchmarks/long_tail.py --prompts 32 --samples 4 --threshold 16
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np

import common


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--threshold", type=int, default=16, help="speculate when the active rows fit this bucket")
    p.add_argument("--strategy", default="eagle:depth=4")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--new-tokens", type=int, default=320)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="16 prompts × 8, one repeat")
    p.add_argument("--out", default="benchmarks/results/long_tail.json")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.repeats = 16, 8, 1
    if args.prompts * args.samples < 1 or args.threshold < 0:
        p.error("--prompts, --samples must be >= 1 and --threshold >= 0")
    return args


def tail_time(seqs) -> float:
    """Seconds from the moment 90% of the sequences had finished to the last one finishing."""
    t = np.sort([s.finish_time for s in seqs])
    return float(t[-1] - t[int(np.ceil(0.9 * len(t))) - 1])


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    from tltjax.rollout.engine import Engine, EngineConfig
    from tltjax.rollout.sampling import SamplingParams

    cfg, target, tokenizer, drafter, info = common.load_target_and_drafter(args)
    prompts = common.task_prompts(cfg, tokenizer, args.prompts, args.seed)
    sampling = SamplingParams(args.temperature)
    ecfg = EngineConfig(
        max_batch=args.max_batch, max_seq_len=max(len(p) for p in prompts) + args.new_tokens + 1, page_size=16,
        decode_steps=8, spec_rounds=4, spec_threshold=args.threshold, strategies=(args.strategy,),
        prefill_batch=16, prefill_lengths=(32, 64),
    )
    eng = Engine(target, ecfg, drafter)
    t0 = time.perf_counter()
    eng.warmup(sampling)
    print(f"compiled {eng.num_programs} programs in {time.perf_counter() - t0:.0f} s")
    results = {"plain": [], "speculative": []}
    for rep in range(args.repeats + 1):  # the first pass warms caches and is not reported
        for name, strat in [("plain", None), ("speculative", "auto")]:
            seqs, st = eng.generate(prompts, n=args.samples, sampling=sampling, max_new_tokens=args.new_tokens,
                                    stop_ids=[tokenizer.eos_id], seed=args.seed + rep, strategy=strat)
            lengths = [len(s.tokens) for s in seqs]
            run = dict(seconds=st.time_total, tokens=st.tokens, tokens_per_s=st.tokens / st.time_total,
                       tail_10pct_s=tail_time(seqs), accept_length=st.mean_accept_length,
                       spec_calls=st.spec_calls, decode_calls=st.decode_calls, compilations=st.compilations,
                       length_median=float(np.median(lengths)), length_p99=float(np.percentile(lengths, 99)),
                       length_max=int(max(lengths)), time_spec=st.time_spec, time_decode=st.time_decode)
            if rep:
                results[name].append(run)
            print(f"  {'warm-up' if not rep else f'repeat {rep}'} {name:12s} {st.time_total:6.1f} s  "
                  f"{run['tokens_per_s']:6.0f} tok/s  tail {run['tail_10pct_s']:5.1f} s  "
                  f"τ {run['accept_length']:.2f}  lengths median {run['length_median']:.0f} max {run['length_max']}")
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in results.items()}
    tail = {k: statistics.median(r["tail_10pct_s"] for r in v) for k, v in results.items()}
    summary = dict(sequences=len(prompts) * args.samples, plain_s=med["plain"], speculative_s=med["speculative"],
                   rollout_speedup=med["plain"] / med["speculative"], plain_tail_s=tail["plain"],
                   speculative_tail_s=tail["speculative"], tail_speedup=tail["plain"] / max(tail["speculative"], 1e-9))
    print(f"\nrollout of {summary['sequences']} sequences: plain {med['plain']:.1f} s, speculative "
          f"{med['speculative']:.1f} s → {summary['rollout_speedup']:.2f}×; last 10% of sequences: "
          f"{tail['plain']:.1f} s → {tail['speculative']:.1f} s ({summary['tail_speedup']:.2f}×)")
    common.write_json(dict(benchmark="long_tail", machine=common.machine(), args=vars(args), models=info,
                           summary=summary, runs=results), args.out)


if __name__ == "__main__":
    main()
