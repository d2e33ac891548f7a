"""Plain decoding throughput: tltjax `dense.generate` against Hugging Face `transformers` `generate`.

Both decode greedily from the same weights, in this process, one after the other for each
batch size: a warm-up call (compilation, caches) that is not timed, then ``--repeats`` timed
calls whose median is reported. Prompts are random token ids of one length (no padding, so
both sides do the same work), and no stop token is used, so every row produces exactly
``--new-tokens`` tokens. Throughput is generated tokens (batch × new tokens) per second of
wall time, prefill included. The script also checks that both produce the same greedy tokens.

    python benchmarks/decode.py --quick
    python benchmarks/decode.py --batch-sizes 1 4 16 64 --new-tokens 256 --model /path/to/hf_dir
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
import warnings

REPO = pathlib.Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Greedy decoding throughput of tltjax dense.generate vs transformers generate (same weights).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="a Hugging Face model directory (config.json + safetensors) of a supported family; default: the "
        "tiny policy of configs/default.py if it is in the cache, else a random model of its shape",
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16], metavar="B", help="batch sizes to run")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per (random) prompt")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting; the median is reported")
    p.add_argument("--quick", action="store_true", help="batch sizes 1 and 4, 32 new tokens (a smoke run)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the random model")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 0 keeps torch's choice (one per core), which on a small or shared CPU "
        "makes transformers many times slower on tiny models (its OpenMP threads contend with JAX's and others')",
    )
    p.add_argument("--out", default="benchmarks/results/decode.json", help="JSON results file ('' to skip)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.new_tokens = [1, 4], 32
    for name in ("new_tokens", "prompt_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.batch_sizes) < 1:
        p.error(f"--batch-sizes must all be >= 1, got {args.batch_sizes}")
    return args


def random_tiny_policy(path: pathlib.Path, seed: int) -> None:
    """Saves a randomly initialised model with the tiny policy's shape and tokenizer to ``path``.

    Weights are drawn at a scale (std 0.08, norms 1 ± 0.1) that gives decisive logits, so the
    greedy comparison is not decided by float-noise near-ties as it would be at init scale.
    """
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tltjax import tiny_policy
    from tltjax.config import load_config
    from tltjax.models import CausalLM, save_pretrained
    from tltjax.rl import tasks

    cfg = load_config(REPO / "configs/default.py")
    tok = tiny_policy.task_tokenizer(tasks.get_task(cfg.task.name))
    model = nnx.eval_shape(lambda: CausalLM(tiny_policy.model_config(cfg, tok), rngs=nnx.Rngs(seed)))
    rng = np.random.RandomState(seed)
    for name, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        noise = rng.normal(size=var.shape).astype(np.float32)
        var.set_value(jnp.asarray(1.0 + 0.1 * noise if "norm" in ".".join(map(str, name)) else 0.08 * noise))
    save_pretrained(model, path)
    tok.save_pretrained(path)


def resolve_model(args, scratch: pathlib.Path) -> tuple[pathlib.Path, str]:
    """(model directory, where it came from)."""
    if args.model:
        path = pathlib.Path(args.model)
        if not (path / "config.json").is_file():
            sys.exit(f"error: --model {path} has no config.json; pass a Hugging Face model directory")
        return path, "--model"
    from tltjax import paths, tiny_policy
    from tltjax.config import load_config

    cfg = load_config(REPO / "configs/default.py")
    cached = paths.cache_dir(cfg.cache_dir) / "tiny_policy" / tiny_policy.cache_key(cfg)
    if (cached / "tltjax_sft.json").exists():
        return tiny_policy.get_tiny_policy(cfg, progress=False, log=lambda *_: None), "tiny policy (cached)"
    random_tiny_policy(scratch, args.seed)
    return scratch, "random model of the tiny policy's shape (no cached tiny policy)"


def timed(fn, repeats: int):
    """(output of the warm-up call, wall seconds of each of ``repeats`` timed calls)."""
    out = fn()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return out, seconds


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax
    import numpy as np
    import torch
    import transformers

    from tltjax.models import from_pretrained
    from tltjax.rollout.dense import generate
    from tltjax.rollout.sampling import SamplingParams

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    # transformers runs on the GPU when JAX does and torch can; otherwise both run on the CPU.
    torch_device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    transformers.utils.logging.disable_progress_bar()
    # dense.decode donates a cache it does not return; the warning says nothing about speed on CPU.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    with tempfile.TemporaryDirectory() as scratch:
        path, source = resolve_model(args, pathlib.Path(scratch))
        ours = from_pretrained(path, dtype="float32")
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(torch_device)
    saved_at = None if path == pathlib.Path(scratch) else str(path)  # the scratch copy is gone now
    cfg = ours.config
    # No stop token on either side. An unset eos_token_id in the GenerationConfig passed to generate
    # falls back to the model's own generation_config (eos from config.json), so clear it there.
    ref.generation_config.eos_token_id = None
    gen_cfg = transformers.GenerationConfig(
        max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=cfg.pad_token_id or 0
    )
    rng = np.random.RandomState(args.seed)
    n = args.new_tokens

    rows = []
    for b in args.batch_sizes:
        prompts = rng.randint(0, cfg.vocab_size, (b, args.prompt_len))

        def run_tltjax():
            gens = generate(ours, prompts.tolist(), max_new_tokens=n, params=SamplingParams(temperature=0.0))
            return np.asarray([g.tokens for g in gens])

        def run_hf():
            x = torch.from_numpy(prompts).to(torch_device)
            with torch.inference_mode():
                out = ref.generate(x, attention_mask=torch.ones_like(x), generation_config=gen_cfg)
            return out[:, args.prompt_len :].cpu().numpy()  # .cpu() waits for the device

        ours_toks, ours_s = timed(run_tltjax, args.repeats)
        hf_toks, hf_s = timed(run_hf, args.repeats)
        if hf_toks.shape != (b, n) or ours_toks.shape != (b, n):
            sys.exit(f"error: expected {n} new tokens per row, got tltjax {ours_toks.shape}, transformers {hf_toks.shape}")
        same_rows = (ours_toks == hf_toks).all(axis=1)
        diff = np.argwhere(ours_toks != hf_toks)
        ours_tps, hf_tps = b * n / statistics.median(ours_s), b * n / statistics.median(hf_s)
        rows.append(
            dict(
                batch_size=b,
                new_tokens=n,
                prompt_len=args.prompt_len,
                tltjax=dict(seconds=ours_s, median_s=statistics.median(ours_s), tokens_per_s=ours_tps),
                transformers=dict(seconds=hf_s, median_s=statistics.median(hf_s), tokens_per_s=hf_tps),
                ratio=ours_tps / hf_tps,
                greedy_identical=bool(same_rows.all()),
                rows_identical=int(same_rows.sum()),
                first_mismatch=None if not len(diff) else dict(row=int(diff[0][0]), step=int(diff[0][1])),
            )
        )

    result = dict(
        benchmark="decode",
        what="greedy decoding throughput, tltjax dense.generate vs transformers generate, same weights",
        model=dict(
            path=saved_at,
            source=source,
            model_type=cfg.model_type,
            params=cfg.num_params(),
            layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            dtype="float32",
        ),
        settings=dict(repeats=args.repeats, warmup_runs=1, seed=args.seed, statistic="median"),
        environment=dict(
            jax=jax.__version__,
            jax_backend=jax.default_backend(),
            jax_devices=[str(d) for d in jax.devices()],
            torch=torch.__version__,
            torch_device=torch_device,
            torch_threads=torch.get_num_threads(),
            transformers=transformers.__version__,
            cpu_count=os.cpu_count(),
            platform=platform.platform(),
            python=platform.python_version(),
        ),
        results=rows,
    )
    print_table(result)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return result


def print_table(result: dict) -> None:
    m, env = result["model"], result["environment"]
    print(
        f"model: {m['source']}: {m['model_type']}, {m['params'] / 1e6:.2f}M params, {m['layers']} layers, float32\n"
        f"jax {env['jax']} ({env['jax_backend']}), torch {env['torch']} ({env['torch_device']}, "
        f"{env['torch_threads']} threads), "
        f"transformers {env['transformers']}; median of {result['settings']['repeats']} after 1 warm-up"
    )
    head = f"{'batch':>5} {'prompt':>6} {'new':>5} {'tltjax tok/s':>13} {'transformers tok/s':>19} {'ratio':>6}  greedy identical"
    print(head)
    print("-" * len(head))
    for r in result["results"]:
        same = "yes" if r["greedy_identical"] else f"no ({r['rows_identical']}/{r['batch_size']} rows, first diff {r['first_mismatch']})"
        print(
            f"{r['batch_size']:>5} {r['prompt_len']:>6} {r['new_tokens']:>5} {r['tltjax']['tokens_per_s']:>13.1f} "
            f"{r['transformers']['tokens_per_s']:>19.1f} {r['ratio']:>5.2f}x  {same}"
        )


if __name__ == "__main__":
    main()
