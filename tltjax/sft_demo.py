"""Job ``sft_demo``: get the tiny policy (train it on first use), measure it, sample from it.

Writes ``<workdir>/sft_demo.json`` with the task's length distribution, the
model size, training time and greedy accuracy on held-out problems.
"""

from __future__ import annotations

import json
import pathlib
import time

from ml_collections import ConfigDict

from tltjax import tiny_policy
from tltjax.rl import tasks as tasks_lib

EVAL_SEED_OFFSET = 1_000_003  # held-out problems: a seed stream disjoint from training's


def run(config: ConfigDict) -> int:
    task = tasks_lib.get_task(config.task.name)
    stats = tasks_lib.length_stats(tiny_policy.task_examples(config, 5000, seed=config.seed))
    print(
        f"task {task.name}: response length (chars) median {stats['median']:.0f}, p90 {stats['p90']:.0f}, "
        f"p99 {stats['p99']:.0f}, max {stats['max']:.0f}, p99/median {stats['ratio_p99_median']:.2f}"
    )
    path = tiny_policy.get_tiny_policy(config)
    info = json.loads((path / "tltjax_sft.json").read_text())
    model, tok = tiny_policy.load_policy(path)
    evals = tiny_policy.task_examples(config, config.task.num_eval, seed=config.seed + EVAL_SEED_OFFSET)
    t0 = time.perf_counter()
    acc, texts = tiny_policy.accuracy(model, tok, evals, task, max_new_tokens=config.generate.max_new_tokens)
    eval_s = time.perf_counter() - t0
    print(
        f"policy {path}: {info['params'] / 1e6:.2f}M params, trained {info['steps']} steps in "
        f"{info['train_seconds']:.0f} s; greedy accuracy on {len(evals)} held-out problems: {acc:.1%} "
        f"(eval {eval_s:.0f} s)"
    )
    for e, t in list(zip(evals, texts))[: config.generate.num_samples_to_print]:
        mark = "ok " if task.score(t, e.answer) else "BAD"
        print(f"--- [{mark}] {e.prompt!r} (answer {e.answer}, {e.num_steps} steps)\n{t}")
    workdir = pathlib.Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    summary = {
        "task": task.name,
        "length_stats": stats,
        "policy_dir": str(path),
        "params": info["params"],
        "train_seconds": info["train_seconds"],
        "sft_steps": info["steps"],
        "final_loss": info["final_loss"],
        "eval_accuracy": acc,
        "num_eval": len(evals),
    }
    (workdir / "sft_demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {workdir / 'sft_demo.json'}")
    return 0
