"""Plain vs speculative decoding throughput in the tltjax engine, and the transformers peer.

For each temperature and batch size B, B held-out task prompts are generated to
their end (EOS) or ``--new-tokens``, once with plain decoding and once per
strategy of the pool with speculation at every batch size (same engine, same
compiled pool, side by side in this process). Throughput is generated tokens
per second of wall time (prefill included), the median of ``--repeats`` timed
runs after a warm-up run. The accept length τ is the mean number of tokens a
speculative round emits per active row. At temperature 0 every strategy must
emit exactly the plain tokens; the script checks it.

The peer is Hugging Face ``transformers`` on the same weights (PyTorch, this
CPU): plain ``generate`` at every B, and assisted generation at B = 1 with a
small draft LM (the target's first decoder layer under its own norm and head).

    python benchmarks/spec_decode.py --quick
    python benchmarks/spec_decode.py --batch-sizes 1 4 16 64 --temperatures 0 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import common

DEFAULT_POOL = ["eagle:depth=3", "eagle:depth=5", "eagle:depth=4,top_k=2,num_verify=6", "ngram:depth=4"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--strategies", nargs="+", default=DEFAULT_POOL, help="the strategy pool (Strategy.parse syntax)")
    p.add_argument("--new-tokens", type=int, default=256, help="most tokens per response (EOS ends it earlier)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--spec-rounds", type=int, default=4)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="batch 1 and 4, T=0 and 1, two strategies, one repeat")
    p.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.repeats = [1, 4], 1
        args.strategies = args.strategies[:1] + args.strategies[-1:]
    return args


def _timed(fn, repeats):
    out = fn()  # warm-up
    secs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        secs.append(time.perf_counter() - t0)
    return out, statistics.median(secs)


def run_engine(args, target, drafter, tokenizer, prompts_all, temperature):
    from tltjax.rollout.engine import Engine, EngineConfig
    from tltjax.rollout.sampling import SamplingParams

    sampling = SamplingParams(temperature)
    longest = max(len(p) for p in prompts_all)
    bmax = max(args.batch_sizes)
    cfg = EngineConfig(
        max_batch=bmax, batch_buckets=tuple(sorted(set(args.batch_sizes))), max_seq_len=longest + args.new_tokens + 1,
        page_size=16, decode_steps=args.decode_steps, spec_rounds=args.spec_rounds, spec_threshold=bmax,
        strategies=tuple(args.strategies), prefill_batch=min(bmax, 16), prefill_lengths=(32, 64),
    )
    eng = Engine(target, cfg, drafter)
    t0 = time.perf_counter()
    compiles = eng.warmup(sampling)
    print(f"T={temperature}: compiled {eng.num_programs} programs ({compiles} compilations) in "
          f"{time.perf_counter() - t0:.0f} s")
    rows = []
    for b in args.batch_sizes:
        prompts = prompts_all[:b]
        runs = {}
        for strat in [None] + list(cfg.strategies):
            name = "plain" if strat is None else strat.name

            def go():
                return eng.generate(prompts, sampling=sampling, max_new_tokens=args.new_tokens,
                                    stop_ids=[tokenizer.eos_id], seed=args.seed, strategy=strat)

            (seqs, st), sec = _timed(go, args.repeats)
            runs[name] = dict(seconds=sec, tokens=st.tokens, tokens_per_s=st.tokens / sec,
                              accept_length=st.mean_accept_length, compilations=st.compilations,
                              tokens_out=[s.tokens for s in seqs])
        plain = runs["plain"]
        for name, r in runs.items():
            r["speedup"] = r["tokens_per_s"] / plain["tokens_per_s"]
            if temperature == 0:
                r["identical_to_plain"] = r["tokens_out"] == plain["tokens_out"]
        best = max((n for n in runs if n != "plain"), key=lambda n: runs[n]["tokens_per_s"])
        for r in runs.values():
            r.pop("tokens_out")
        rows.append(dict(batch_size=b, temperature=temperature, runs=runs, best=best,
                         best_speedup=runs[best]["speedup"]))
        line = "  ".join(f"{n} {r['tokens_per_s']:7.0f} tok/s (τ {r['accept_length']:.2f})" for n, r in runs.items())
        print(f"  B={b:3d}  {line}")
    return rows


def run_hf(args, path, prompts_all, eos_id, temperature):
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)
    transformers.utils.logging.disable_progress_bar()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    draft = copy.deepcopy(ref)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    kw = dict(max_new_tokens=args.new_tokens, eos_token_id=eos_id, pad_token_id=eos_id)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)
    rows = []
    for b in args.batch_sizes:
        prompts = prompts_all[:b]
        width = max(len(p) for p in prompts)
        ids = np.full((b, width), eos_id, np.int64)
        mask = np.zeros((b, width), np.int64)
        for i, p in enumerate(prompts):  # left padding, as decoder-only generation expects
            ids[i, width - len(p):] = p
            mask[i, width - len(p):] = 1
        x, m = torch.from_numpy(ids), torch.from_numpy(mask)

        def count(out):
            new = out[:, width:].numpy()
            total = 0
            for row in new:
                stop = np.nonzero(row == eos_id)[0]
                total += int(stop[0]) + 1 if len(stop) else len(row)
            return total

        def plain():
            with torch.inference_mode():
                return ref.generate(x, attention_mask=m, **kw)

        out, sec = _timed(plain, args.repeats)
        row = dict(batch_size=b, temperature=temperature, plain=dict(seconds=sec, tokens_per_s=count(out) / sec))
        if b == 1:
            def assisted():
                with torch.inference_mode():
                    return ref.generate(x, attention_mask=m, assistant_model=draft, **kw)

            out, sec = _timed(assisted, args.repeats)
            row["assisted"] = dict(seconds=sec, tokens_per_s=count(out) / sec, draft_layers=1)
        rows.append(row)
        extra = f", assisted {row['assisted']['tokens_per_s']:.0f}" if "assisted" in row else ""
        print(f"  transformers B={b:3d}: plain {row['plain']['tokens_per_s']:.0f} tok/s{extra}")
    return rows


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    cfg, target, tokenizer, drafter, info = common.load_target_and_drafter(args)
    prompts = common.task_prompts(cfg, tokenizer, max(args.batch_sizes), args.seed)
    engine_rows, hf_rows = [], []
    for t in args.temperatures:
        engine_rows += run_engine(args, target, drafter, tokenizer, prompts, t)
        if not args.no_hf:
            hf_rows += run_hf(args, info["target"]["path"], prompts, tokenizer.eos_id, t)
    summary = []
    for r in engine_rows:
        hf = next((h for h in hf_rows if h["batch_size"] == r["batch_size"] and h["temperature"] == r["temperature"]),
                  None)
        best = r["runs"][r["best"]]
        s = dict(batch_size=r["batch_size"], temperature=r["temperature"],
                 plain_tok_s=r["runs"]["plain"]["tokens_per_s"], best=r["best"], best_tok_s=best["tokens_per_s"],
                 tau=best["accept_length"], speedup_vs_plain=r["best_speedup"])
        if hf:
            s["hf_plain_tok_s"] = hf["plain"]["tokens_per_s"]
            s["speedup_vs_hf_plain"] = best["tokens_per_s"] / hf["plain"]["tokens_per_s"]
            if "assisted" in hf:
                s["hf_assisted_tok_s"] = hf["assisted"]["tokens_per_s"]
        summary.append(s)
    print("\n  T    B  plain tok/s  best strategy                      tok/s     τ   ×plain   ×HF")
    for s in summary:
        print(f"{s['temperature']:4.1f} {s['batch_size']:4d} {s['plain_tok_s']:12.0f}  {s['best']:32s} "
              f"{s['best_tok_s']:7.0f} {s['tau']:5.2f} {s['speedup_vs_plain']:7.2f} "
              f"{s.get('speedup_vs_hf_plain', float('nan')):6.2f}")
    result = dict(benchmark="spec_decode", machine=common.machine(), args=vars(args), models=info,
                  summary=summary, engine=engine_rows, transformers=hf_rows)
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
