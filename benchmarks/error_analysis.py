"""Where the tiny policy goes wrong on `longtail_arith`: the first wrong line of each response, by kind.

Each held-out problem is answered greedily and with samples at temperature 1; every response is
checked line by line against the prompt, and its first error is classified:

- ``copy``: the step starts from a value other than the previous result (or the start value);
- ``operand``: the step applies another operation or operand than its labelled one in the prompt;
- ``arith+`` / ``arith-`` / ``arith*``: the step's result is wrong;
- ``label``, ``format``, ``answer_early``, ``stopped_early``, ``no_answer``, ``extra_step``,
  ``answer_copy``: the response's shape is wrong (see `classify`).

Also accuracy by chain length. Prints a table and writes JSON.

    python benchmarks/error_analysis.py
    python benchmarks/error_analysis.py --set sft.slip_rate=0.15
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

import numpy as np

_LINE = re.compile(r"^([a-z]):(\d+)([-+*])(\d+)=(\d+)$")
_PROMPT_OP = re.compile(r" ([a-z])([-+*])(\d+)")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def classify(prompt: str, response: str) -> str:
    """The kind of the first error of `response` to the `longtail_arith` `prompt`, or "ok"."""
    ops = _PROMPT_OP.findall(prompt)
    value = int(prompt.split()[0])
    lines = response.split("\n")
    for i, (label, op, b) in enumerate(ops):
        if i >= len(lines):
            return "stopped_early"
        m = _LINE.match(lines[i])
        if m is None:
            return "answer_early" if lines[i].startswith("#") else "format"
        if m.group(1) != label:
            return "label"
        if int(m.group(2)) != value:
            return "copy"
        if m.group(3) != op or int(m.group(4)) != int(b):
            return "operand"
        value = _APPLY[op](value, int(b))
        if int(m.group(5)) != value:
            return f"arith{op}"
    if len(lines) <= len(ops):
        return "no_answer"
    if lines[len(ops)] != f"#{value}":
        return "extra_step" if _LINE.match(lines[len(ops)]) else "answer_copy"
    return "ok"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, help="config file (default: configs/default.py)")
    p.add_argument("--problems", type=int, default=256)
    p.add_argument("--samples", type=int, default=4, help="sampled responses per problem (temperature 1)")
    p.add_argument("--seed", type=int, default=12345, help="seed of the held-out problems")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. sft.slip_rate=0.15")
    p.add_argument("--out", default="benchmarks/results/error_analysis.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import common

    from tltjax import data, tiny_policy
    from tltjax.config import load_config
    from tltjax.rollout.engine import Engine, EngineConfig
    from tltjax.rollout.sampling import SamplingParams

    cfg = load_config(args.config or str(common.REPO / "configs/default.py"), [f"--config.{kv}" for kv in args.set])
    if cfg.task.name != "longtail_arith":
        sys.exit(f"error_analysis reads longtail_arith responses; config.task.name is {cfg.task.name!r}")
    model, tok = tiny_policy.load_policy(tiny_policy.get_tiny_policy(cfg, progress=False))
    problems = tiny_policy.task_examples(cfg, args.problems, seed=args.seed)
    prompts = data.encode_prompts([e.prompt for e in problems], tok)
    engine = Engine(model, EngineConfig(max_batch=128, max_seq_len=max(map(len, prompts)) + cfg.rl.max_new_tokens,
                                        spec_threshold=0, max_group=max(args.samples, 1)))
    results = {}
    for name, temperature, n in (("greedy", 0.0, 1), ("sampled", 1.0, args.samples)):
        seqs, _ = engine.generate(prompts, n=n, sampling=SamplingParams(temperature=temperature),
                                  max_new_tokens=cfg.rl.max_new_tokens, stop_ids=(tok.eos_id,), seed=1)
        kinds, by_steps = collections.Counter(), collections.defaultdict(list)
        for s in seqs:
            e = problems[s.prompt_index]
            kind = classify(e.prompt, tok.decode(s.tokens, skip_special_tokens=True))
            kinds[kind] += 1
            by_steps[e.num_steps].append(kind == "ok")
        total = sum(kinds.values())
        results[name] = {
            "responses": total, "accuracy": kinds["ok"] / total,
            "first_error": {k: v / total for k, v in kinds.most_common()},
            "accuracy_by_steps": {str(k): {"accuracy": float(np.mean(v)), "responses": len(v)}
                                  for k, v in sorted(by_steps.items())},
        }
        print(f"{name}: accuracy {kinds['ok'] / total:.1%} of {total}; first error: "
              + ", ".join(f"{k} {v / total:.1%}" for k, v in kinds.most_common() if k != "ok"))
        print("  accuracy by steps: " + ", ".join(
            f"{k}: {np.mean(v):.0%} ({len(v)})" for k, v in sorted(by_steps.items()) if k <= 8))
    common.write_json({"benchmark": "error_analysis", "machine": common.machine(), "args": vars(args), **results}, args.out)


if __name__ == "__main__":
    main()
