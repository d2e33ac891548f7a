"""Offline drafter training: sample the policy on its task, train a drafter on the samples, cache it.

`get_drafter(cfg, policy_dir)` returns the directory of a drafter for the
policy at ``policy_dir``, trained on first use and cached under the cache dir,
keyed by the policy and every ``config.drafter`` field that changes the
weights. The `train_drafter` job (``python -m tltjax.main
--config.job=train_drafter``) runs the same and prints what it measured.
The directory appears atomically, so a killed run never leaves half a drafter.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import time

import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from tltjax import data, paths, tiny_policy
from tltjax.drafter.model import Drafter, DrafterConfig, save_drafter
from tltjax.drafter.train import evaluate, train_drafter

FORMAT_VERSION = 1


def _check(cfg: ConfigDict) -> None:
    from tltjax.config import ConfigError

    d = cfg.drafter
    for name in ("num_prompts", "samples", "steps", "batch_size", "seq_len"):
        if int(d[name]) < 1:
            raise ConfigError(f"config.drafter.{name}={d[name]} must be >= 1")
    if not 0 < d.eval_fraction < 1:
        raise ConfigError(f"config.drafter.eval_fraction={d.eval_fraction} must lie in (0, 1)")
    if d.lr <= 0 or d.temperature < 0 or d.ce_weight < 0:
        raise ConfigError("config.drafter.lr must be > 0 and temperature, ce_weight >= 0")


def cache_key(cfg: ConfigDict, policy_dir: pathlib.Path) -> str:
    relevant = {"v": FORMAT_VERSION, "policy": str(pathlib.Path(policy_dir).resolve()), "seed": cfg.seed,
                "drafter": cfg.drafter.to_dict()}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=list).encode()).hexdigest()[:16]


def sample_sequences(cfg: ConfigDict, target, tokenizer, *, log=print) -> list[list[int]]:
    """prompt + response token sequences sampled from ``target`` on the config's task prompts."""
    from tltjax.rollout.engine import Engine, EngineConfig
    from tltjax.rollout.sampling import SamplingParams

    d = cfg.drafter
    examples = tiny_policy.task_examples(cfg, int(d.num_prompts), seed=cfg.seed + 20_000)
    prompts = data.encode_prompts([e.prompt for e in examples], tokenizer)
    longest = max(len(p) for p in prompts)
    engine = Engine(target, EngineConfig(max_batch=64, batch_buckets=(1, 8, 64), max_seq_len=longest + int(d.seq_len),
                                         strategies=(), prefill_batch=16, prefill_lengths=(32,), decode_steps=16))
    t0 = time.perf_counter()
    seqs, stats = engine.generate(prompts, n=int(d.samples), sampling=SamplingParams(float(d.temperature)),
                                  max_new_tokens=int(d.seq_len), stop_ids=[tokenizer.eos_id], seed=cfg.seed)
    lengths = [len(s.tokens) for s in seqs]
    log(f"drafter: sampled {len(seqs)} responses ({stats.tokens} tokens, median length {np.median(lengths):.0f}, "
        f"max {max(lengths)}) in {time.perf_counter() - t0:.0f} s")
    return [s.prompt + s.tokens for s in seqs]


def train_and_save(cfg: ConfigDict, policy_dir: pathlib.Path, out_dir: pathlib.Path, *, progress=True,
                   log=print) -> dict:
    """Samples, trains, evaluates (held-out top-1 agreement before and after) and saves to ``out_dir``."""
    _check(cfg)
    d = cfg.drafter
    target, tokenizer = tiny_policy.load_policy(policy_dir)
    seqs = sample_sequences(cfg, target, tokenizer, log=log)
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(seqs))
    n_eval = max(1, int(len(seqs) * float(d.eval_fraction)))
    held = [seqs[i] for i in order[:n_eval]]
    train = [seqs[i] for i in order[n_eval:]]
    layers = tuple(d.feature_layers) or None
    overrides = {"intermediate_size": int(d.intermediate_size)} if d.intermediate_size else {}
    dcfg = DrafterConfig.for_target(target.config, layers, **overrides)
    drafter = Drafter(dcfg, rngs=nnx.Rngs(cfg.seed))
    kw = dict(seq_len=int(d.seq_len), ce_weight=float(d.ce_weight))
    before = evaluate(drafter, target, held, **kw)
    t0 = time.perf_counter()
    history = train_drafter(drafter, target, train, steps=int(d.steps), batch_size=int(d.batch_size), lr=float(d.lr),
                            warmup=int(d.warmup_steps), seed=cfg.seed, progress=progress, **kw)
    seconds = time.perf_counter() - t0
    after = evaluate(drafter, target, held, **kw)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(drafter, tmp)
    report = dict(policy=str(policy_dir), train_sequences=len(train), eval_sequences=len(held), steps=int(d.steps),
                  train_seconds=seconds, before=before, after=after, history=history)
    (tmp / "tltjax_drafter_train.json").write_text(json.dumps(report, indent=2) + "\n")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    log(f"drafter: trained {int(d.steps)} steps in {seconds:.0f} s; held-out top-1 agreement with the policy "
        f"{before['top1']:.1%} -> {after['top1']:.1%}; saved to {out_dir}")
    return report


def get_drafter(cfg: ConfigDict, policy_dir: pathlib.Path, *, progress=True, log=print) -> pathlib.Path:
    """The cached drafter for ``policy_dir`` and ``cfg.drafter``, trained now if missing."""
    out = paths.cache_dir(cfg.cache_dir) / "drafter" / cache_key(cfg, policy_dir)
    if (out / "tltjax_drafter_train.json").exists():
        log(f"drafter: using the cached drafter at {out}")
        return out
    train_and_save(cfg, pathlib.Path(policy_dir), out, progress=progress, log=log)
    return out


def run(cfg: ConfigDict) -> int:
    """The ``train_drafter`` job: tiny policy (cached), then its drafter (cached), with a summary."""
    policy = tiny_policy.get_tiny_policy(cfg)
    out = get_drafter(cfg, policy)
    report = json.loads((out / "tltjax_drafter_train.json").read_text())
    print(f"drafter at {out}: top-1 agreement {report['before']['top1']:.1%} -> {report['after']['top1']:.1%} "
          f"on {report['eval_sequences']} held-out sequences ({report['after']['positions']} positions)")
    return 0
