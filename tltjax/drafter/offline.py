"""Offline drafter training: sample the policy on its task, train a drafter on the samples, cache it.

`get_drafter(cfg, policy_dir)` returns the directory of a drafter (`save_drafter`
format) for the policy at ``policy_dir``: trained on first use, then cached
under ``<cache dir>/drafter/<key>``, the key hashing the policy's directory and
every config field that changes the drafter. The ``train_drafter`` job
(``python -m tltjax.main --config.job=train_drafter``) gets the tiny policy the
same way, then its drafter, and prints what was measured: top-1 agreement with
the policy on held-out sampled responses before and after training. The
directory appears atomically, so a killed run never leaves half a drafter.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import time
from typing import Sequence

import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from tltjax import data, paths, tiny_policy
from tltjax.config import ConfigError
from tltjax.drafter.model import Drafter, DrafterConfig, save_drafter
from tltjax.drafter.train import evaluate, train_drafter
from tltjax.models.tokenizer import Tokenizer
from tltjax.models.transformer import CausalLM
from tltjax.rollout.dense import generate
from tltjax.rollout.sampling import SamplingParams

FORMAT_VERSION = 2  # bump when code changes what a config produces
REPORT = "tltjax_drafter_train.json"
SAMPLE_BATCH = 64  # prompts per `generate` call
PROMPT_SEED = 20_000  # offset from config.seed: other problems than the policy's SFT data


def check_config(cfg: ConfigDict) -> None:
    """Raises `ConfigError` naming the first ``config.drafter`` field that cannot work."""
    d = cfg.drafter
    rules = [
        ("num_sequences", d.num_sequences >= 1, "must be >= 1"),
        ("num_eval_sequences", d.num_eval_sequences >= 1, "must be >= 1"),
        ("temperature", 0 <= d.temperature < float("inf"), "must be finite and >= 0 (0 samples greedily)"),
        ("steps", d.steps >= 1, "must be >= 1"),
        ("batch_size", d.batch_size >= 1, "must be >= 1"),
        ("seq_len", d.seq_len >= 2, "must be >= 2 (prompt + response tokens per training sequence)"),
        ("lr", d.lr > 0, "must be > 0"),
        ("warmup_steps", d.warmup_steps >= 0, "must be >= 0"),
        ("ce_weight", d.ce_weight >= 0, "must be >= 0"),
        ("intermediate_size", d.intermediate_size >= 0, "must be >= 0 (0: the target's)"),
    ]
    for name, ok, why in rules:
        if not ok:
            raise ConfigError(f"config.drafter.{name}={d[name]!r} {why}")


def drafter_config(cfg: ConfigDict, target: CausalLM) -> DrafterConfig:
    """The `DrafterConfig` that ``cfg.drafter`` asks for on ``target``."""
    d = cfg.drafter
    layers = tuple(d.feature_layers) or None
    overrides = {"intermediate_size": int(d.intermediate_size)} if d.intermediate_size else {}
    overrides["input_norm"] = bool(d.input_norm)
    try:
        return DrafterConfig.for_target(target.config, layers, **overrides)
    except ValueError as e:
        raise ConfigError(
            f"config.drafter.feature_layers={tuple(d.feature_layers)} / intermediate_size={d.intermediate_size} "
            f"do not fit the policy: {e}"
        ) from None


def cache_key(cfg: ConfigDict, policy_dir: pathlib.Path) -> str:
    """Hash of the policy's directory and every config field that changes the trained drafter."""
    relevant = {
        "v": FORMAT_VERSION,
        "policy": str(pathlib.Path(policy_dir).resolve()),
        "seed": cfg.seed,
        "task": {"name": cfg.task.name, "options": cfg.task.options.to_dict()},  # the prompts
        "drafter": cfg.drafter.to_dict(),
    }
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=list).encode()).hexdigest()[:16]


def sample_sequences(
    target: CausalLM,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    *,
    seq_len: int,
    temperature: float,
    seed: int,
) -> list[list[int]]:
    """``prompt + response`` per prompt, responses sampled from ``target``, each cut to ``seq_len`` tokens.

    Responses stop at EOS (kept) or after ``seq_len - shortest prompt`` tokens;
    generation runs in batches of `SAMPLE_BATCH` (the last padded to that size,
    so batch shapes repeat).
    """
    max_new = max(seq_len - min(len(p) for p in prompts), 1)
    size = min(SAMPLE_BATCH, len(prompts))
    out: list[list[int]] = []
    for i in range(0, len(prompts), size):
        chunk = [list(p) for p in prompts[i : i + size]]
        n = len(chunk)
        chunk += [chunk[0]] * (size - n)
        gens = generate(target, chunk, max_new_tokens=max_new, params=SamplingParams(temperature),
                        stop_ids=(tokenizer.eos_id,), seed=seed + i, pad_id=tokenizer.pad_id or 0)
        out += [(p + g.tokens)[:seq_len] for p, g in zip(chunk[:n], gens[:n])]
    return out


def train_and_save(
    cfg: ConfigDict, policy_dir: pathlib.Path, out_dir: pathlib.Path, *, progress: bool = True, log=print
) -> dict:
    """Samples the policy, trains a drafter, measures it before and after, saves it to ``out_dir``; the report."""
    check_config(cfg)
    d = cfg.drafter
    target, tokenizer = tiny_policy.load_policy(pathlib.Path(policy_dir))
    dcfg = drafter_config(cfg, target)
    seq_len, temperature = int(d.seq_len), float(d.temperature)

    n_eval = int(d.num_eval_sequences)
    t0 = time.perf_counter()
    examples = tiny_policy.task_examples(cfg, n_eval + int(d.num_sequences), seed=cfg.seed + PROMPT_SEED)
    prompts = data.encode_prompts([e.prompt for e in examples], tokenizer)
    seqs = sample_sequences(target, tokenizer, prompts, seq_len=seq_len, temperature=temperature, seed=cfg.seed)
    held, train = seqs[:n_eval], seqs[n_eval:]
    lengths = [len(s) for s in train]
    log(f"drafter: sampled {len(train)} training and {len(held)} held-out sequences at temperature {temperature} "
        f"(median length {np.median(lengths):.0f}, {sum(n == seq_len for n in lengths)} cut at seq_len={seq_len}) "
        f"in {time.perf_counter() - t0:.1f} s")

    kw = dict(seq_len=seq_len, batch_size=int(d.batch_size), ce_weight=float(d.ce_weight))
    before = evaluate(Drafter(dcfg, rngs=nnx.Rngs(cfg.seed)), target, held, **kw)  # train_drafter's initial weights
    t0 = time.perf_counter()
    drafter, history = train_drafter(
        target, dcfg, train, steps=int(d.steps), lr=float(d.lr), seed=cfg.seed, warmup_steps=int(d.warmup_steps),
        progress=progress, **kw,
    )
    seconds = time.perf_counter() - t0
    after = evaluate(drafter, target, held, **kw)

    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(drafter, tmp)
    report = dict(
        cache_key=out_dir.name, policy=str(policy_dir), train_sequences=len(train), eval_sequences=len(held),
        steps=int(d.steps), train_seconds=seconds, before=before, after=after, history=history,
    )
    (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    log(f"drafter: trained {int(d.steps)} steps in {seconds:.1f} s; held-out top-1 agreement with the policy "
        f"{before['top1']:.1%} -> {after['top1']:.1%}; saved to {out_dir}")
    return report


def get_drafter(cfg: ConfigDict, policy_dir: pathlib.Path, *, progress: bool = True, log=print) -> pathlib.Path:
    """Directory of the drafter for the policy at ``policy_dir`` and ``cfg.drafter``: cached, or trained now."""
    check_config(cfg)
    out = paths.cache_dir(cfg.cache_dir) / "drafter" / cache_key(cfg, policy_dir)
    if (out / REPORT).exists():
        log(f"drafter: using the cached drafter at {out}")
        return out
    train_and_save(cfg, pathlib.Path(policy_dir), out, progress=progress, log=log)
    return out


def run(cfg: ConfigDict) -> int:
    """The ``train_drafter`` job: the tiny policy (cached), then its drafter (cached), and a summary."""
    check_config(cfg)
    policy = tiny_policy.get_tiny_policy(cfg)
    out = get_drafter(cfg, policy)
    report = json.loads((out / REPORT).read_text())
    before, after = report["before"], report["after"]
    print(f"drafter at {out}\n"
          f"  top-1 agreement with the policy on {report['eval_sequences']} held-out sequences "
          f"({after['positions']} positions): {before['top1']:.1%} before training, {after['top1']:.1%} after\n"
          f"  held-out loss {before['loss']:.3f} -> {after['loss']:.3f}; {report['steps']} steps "
          f"on {report['train_sequences']} sequences in {report['train_seconds']:.1f} s")
    return 0
