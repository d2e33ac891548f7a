"""What the rollout benchmarks share: the in-repo target, its offline-trained drafter, task prompts, output.

The target is the tiny policy of ``configs/default.py`` (trained on first use and
cached) or any Hugging Face directory given with ``--model``. The drafter is
trained offline on the target's own sampled responses (the ``train_drafter``
job's code) and cached next to it, or read from ``--drafter``.
"""

from __future__ import annotations

import json
import pathlib
import platform
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def add_model_args(p) -> None:
    p.add_argument("--config", default=str(REPO / "configs/default.py"), help="config of the target and its task")
    p.add_argument("--model", help="a Hugging Face model directory to use as target instead of the tiny policy")
    p.add_argument("--drafter", help="a drafter directory (save_drafter format); default: train one offline and cache it")
    p.add_argument("--seed", type=int, default=0)


def load_target_and_drafter(args, log=print):
    """(config, target CausalLM, tokenizer, drafter, description dict)."""
    from tltjax import tiny_policy
    from tltjax.config import load_config
    from tltjax.drafter import load_drafter
    from tltjax.drafter.offline import get_drafter

    cfg = load_config(args.config)
    if args.model:
        path = pathlib.Path(args.model)
    else:
        path = tiny_policy.get_tiny_policy(cfg, log=log)
    target, tokenizer = tiny_policy.load_policy(path)
    if args.drafter:
        drafter_dir = pathlib.Path(args.drafter)
    else:
        drafter_dir = get_drafter(cfg, path, log=log)
    drafter = load_drafter(drafter_dir, target.config)
    info = dict(
        target=dict(path=str(path), params=target.config.num_params(), layers=target.config.num_hidden_layers,
                    hidden_size=target.config.hidden_size, vocab_size=target.config.vocab_size),
        drafter=dict(path=str(drafter_dir), feature_layers=list(drafter.config.feature_layers)),
    )
    return cfg, target, tokenizer, drafter, info


def task_prompts(cfg, tokenizer, n: int, seed: int) -> list[list[int]]:
    """``n`` held-out prompts of the config's task, encoded as the policy was trained on them."""
    from tltjax import data, tiny_policy

    examples = tiny_policy.task_examples(cfg, n, seed=10_000 + seed)
    return data.encode_prompts([e.prompt for e in examples], tokenizer)


def machine() -> dict:
    import jax

    return dict(platform=platform.platform(), python=platform.python_version(), jax=jax.__version__,
                backend=jax.default_backend(), devices=[str(d) for d in jax.devices()][:4])


def write_json(result: dict, out: str, quiet: bool = False) -> None:
    if not out:
        return
    path = pathlib.Path(out)
    if not path.is_absolute():
        path = REPO / path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file
    if not quiet:
        print(f"wrote {path}")
