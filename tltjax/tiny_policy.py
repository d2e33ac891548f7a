"""The tiny policy every demo and test starts from, trained in-repo since nothing is downloaded.

`get_tiny_policy(config)` returns the directory of a Hugging Face-format model
(config.json, model.safetensors, tokenizer files) trained by SFT on the
config's synthetic task. It is trained on first use and cached under the cache
dir, keyed by a hash of everything that affects the weights; the same seed
gives the same model. The directory appears atomically (written to a temporary
name, then renamed), so a killed run never leaves a half-written policy.
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

from tltjax import data, paths
from tltjax.models import CausalLM, ModelConfig, from_pretrained, save_pretrained
from tltjax.models.tokenizer import Tokenizer, char_tokenizer
from tltjax.rl import tasks as tasks_lib
from tltjax.rollout.dense import generate
from tltjax.rollout.sampling import SamplingParams
from tltjax import sft

FORMAT_VERSION = 2  # bump when training code or a task format changes what a config produces


def task_examples(cfg: ConfigDict, n: int, seed: int) -> list[tasks_lib.Example]:
    """``n`` problems of the config's task, generated with its ``task.options``."""
    task = tasks_lib.get_task(cfg.task.name)
    try:
        return task.generate(n, seed=seed, **cfg.task.options.to_dict())
    except TypeError as e:
        from tltjax.config import ConfigError

        raise ConfigError(f"config.task.options {cfg.task.options.to_dict()} do not fit task {task.name!r}: {e}") from None


def task_tokenizer(task: tasks_lib.Task) -> Tokenizer:
    """The character tokenizer for a synthetic task."""
    return char_tokenizer(task.alphabet)


def model_config(cfg: ConfigDict, tokenizer: Tokenizer) -> ModelConfig:
    """The Qwen2-style ModelConfig that ``cfg.model`` describes (vocab from the tokenizer when 0)."""
    m = cfg.model
    if m.hidden_size % m.num_attention_heads:
        from tltjax.config import ConfigError

        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not a multiple of model.num_attention_heads={m.num_attention_heads}"
        )
    return ModelConfig(
        model_type="qwen2",
        vocab_size=m.vocab_size or tokenizer.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        head_dim=m.hidden_size // m.num_attention_heads,
        rope_theta=m.rope_theta,
        tie_word_embeddings=m.tie_word_embeddings,
        attention_bias=True,
        max_position_embeddings=m.max_position_embeddings,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )


SLIP_VERSION = 2  # how tasks make SFT slips; part of the key only where slips are on


def cache_key(cfg: ConfigDict) -> str:
    """Hash of every config field that changes the trained weights."""
    relevant = {
        "v": FORMAT_VERSION,
        "seed": cfg.seed,
        "model": cfg.model.to_dict(),
        "task": {k: v for k, v in cfg.task.to_dict().items() if k != "num_eval"},
        # slip_rate 0 (no slips) is left out, so policies cached before it existed stay valid
        "sft": {k: v for k, v in cfg.sft.to_dict().items()
                if k != "log_every" and not (k == "slip_rate" and not v)},
    }
    if cfg.sft.get("slip_rate", 0.0):
        relevant["slips"] = SLIP_VERSION
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def accuracy(
    model: CausalLM,
    tokenizer: Tokenizer,
    examples: Sequence[tasks_lib.Example],
    task: tasks_lib.Task,
    *,
    max_new_tokens: int,
    batch_size: int = 256,
) -> tuple[float, list[str]]:
    """Greedy accuracy of ``model`` on ``examples`` by the task's scorer; also the decoded responses."""
    prompts = data.encode_prompts([e.prompt for e in examples], tokenizer)
    texts: list[str] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        gens = generate(
            model,
            chunk,
            max_new_tokens=max_new_tokens,
            params=SamplingParams(temperature=0.0),
            stop_ids=(tokenizer.eos_id,),
            pad_id=tokenizer.pad_id or 0,
        )
        texts += [tokenizer.decode(g.tokens, skip_special_tokens=True) for g in gens]
    scores = [task.score(t, e.answer) for t, e in zip(texts, examples)]
    return float(np.mean(scores)), texts


def train_policy(cfg: ConfigDict, out_dir: pathlib.Path, *, progress: bool = True, log=print) -> dict:
    """Trains the tiny policy that ``cfg`` describes and saves it (model + tokenizer) to ``out_dir``."""
    task = tasks_lib.get_task(cfg.task.name)
    tok = task_tokenizer(task)
    mcfg = model_config(cfg, tok)
    examples = task_examples(cfg, cfg.task.num_train, seed=cfg.seed)
    slip_rate = float(cfg.sft.get("slip_rate", 0.0))
    if slip_rate:
        if task.slip is None:
            raise ValueError(f"config.sft.slip_rate={slip_rate} needs a task that can make slips; "
                             f"task {task.name!r} cannot: set sft.slip_rate = 0.")
        rng = np.random.default_rng(cfg.seed + 1)
        clean = examples
        examples = [task.slip(e, rng, slip_rate) for e in examples]
        wrong = sum(a.answer != b.answer for a, b in zip(clean, examples))
        log(f"sft: {slip_rate:.0%} of worked steps slip; {wrong / len(examples):.0%} of the examples end wrong")
    batches = data.PackedSFTBatches(
        examples, tok, cfg.sft.batch_size, cfg.sft.seq_len, seed=cfg.seed, epochs=None, widths=cfg.sft.widths
    )
    if batches.num_skipped:
        log(f"sft: skipped {batches.num_skipped} of {batches.num_examples} examples longer than seq_len={cfg.sft.seq_len}")
    model = CausalLM(mcfg, rngs=nnx.Rngs(cfg.seed))
    log(f"sft: training a {mcfg.num_params() / 1e6:.2f}M-parameter {mcfg.model_type} model for {cfg.sft.steps} steps")
    tx = sft.make_optimizer(cfg.sft.lr, cfg.sft.steps, cfg.sft.warmup_steps, cfg.sft.weight_decay, cfg.sft.grad_clip)
    state = sft.TrainState.create(model, tx)
    history = []

    def on_log(entry: sft.TrainLog):
        history.append(entry.__dict__)
        if not progress:
            log(f"sft step {entry.step}: loss {entry.loss:.4f}, {entry.tokens_per_s:.0f} target tok/s")

    t0 = time.perf_counter()
    state = sft.train(state, batches, cfg.sft.steps, log_every=cfg.sft.log_every, on_log=on_log, progress=progress)
    seconds = time.perf_counter() - t0
    model = state.model()
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tmp)
    tok.save_pretrained(tmp)
    info = {
        "cache_key": cache_key(cfg),
        "params": mcfg.num_params(),
        "train_seconds": seconds,
        "steps": cfg.sft.steps,
        "final_loss": history[-1]["loss"] if history else None,
        "history": history,
        "task": cfg.task.name,
    }
    (tmp / "tltjax_sft.json").write_text(json.dumps(info, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return info


def get_tiny_policy(cfg: ConfigDict, *, progress: bool = True, log=print) -> pathlib.Path:
    """Directory of the trained tiny policy for ``cfg``: cached, or trained now and cached."""
    root = paths.cache_dir(cfg.cache_dir) / "tiny_policy"
    out = root / cache_key(cfg)
    if (out / "tltjax_sft.json").exists():
        log(f"sft: using the cached policy at {out}")
        return out
    root.mkdir(parents=True, exist_ok=True)
    train_policy(cfg, out, progress=progress, log=log)
    return out


def load_policy(path: pathlib.Path, dtype: str = "float32") -> tuple[CausalLM, Tokenizer]:
    """The model and tokenizer saved in ``path``."""
    return from_pretrained(path, dtype=dtype), Tokenizer.from_pretrained(path)
