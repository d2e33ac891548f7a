"""What the rollout benchmarks share: the in-repo target, its offline-trained drafter, task prompts, output.

The target is the tiny policy of ``configs/spec_default.py`` (the default's) (trained on first use and
cached) or any Hugging Face directory given with ``--model``. The drafter is
trained offline on the target's own sampled responses (the ``train_drafter``
job's code) and cached next to it, or read from ``--drafter``.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def add_model_args(p) -> None:
    p.add_argument("--config", default=str(REPO / "configs/spec_default.py"),
                   help="config of the target, its task and its offline drafter")
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


_CORE_PROBE = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
loop = jax.jit(lambda x: jax.lax.fori_loop(0, 20, lambda i, x: jnp.tanh(x @ x), x))
x = jnp.full((256, 256), 0.01)
loop(x).block_until_ready()
sys.stdout.write("ready\\n"); sys.stdout.flush(); sys.stdin.readline()
t = time.perf_counter()
for _ in range(int(sys.argv[1])):
    loop(x).block_until_ready()
print(time.perf_counter() - t)
"""


def host_parallelism(workers: int = 2, reps: int = 60) -> dict:
    """How many cores' worth of CPU computation the host gives at once, measured.

    ``workers`` processes each run the same single-threaded jitted loop, first one alone, then all
    at the same time (started together after they have compiled); ``effective_cores`` is
    ``workers * alone / together`` (mean over the workers): ``workers`` when each gets a core of its
    own, 1 when they only share one. Virtual CPU devices share these cores, so an "idle" one is
    free hardware only as far as this exceeds the devices still busy.
    """
    import subprocess

    if int(workers) != workers or workers < 1 or int(reps) != reps or reps < 1:
        raise ValueError(f"host_parallelism: workers={workers!r} and reps={reps!r} must be whole numbers >= 1")

    def run(n: int) -> list[float]:
        procs = [subprocess.Popen([sys.executable, "-c", _CORE_PROBE, str(reps)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for _ in range(n)]
        try:
            for p in procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError("host_parallelism: a probe process failed before its loop (see its stderr)")
            for p in procs:  # all compiled: start the timed loops together
                p.stdin.write("go\n")
                p.stdin.flush()
            out = [p.communicate(timeout=600)[0] for p in procs]
            if any(p.returncode for p in procs):
                raise RuntimeError("host_parallelism: a probe process failed (see its stderr)")
            return [float(x) for x in out]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    alone = run(1)[0]
    together = run(workers)
    return dict(workers=workers, alone_s=alone, together_s=together,
                effective_cores=effective_cores(alone, together), cpu_count=os.cpu_count())


def effective_cores(alone: float, together: list[float]) -> float:
    """Cores' worth of computation that ``len(together)`` copies of a loop taking ``alone`` seconds by
    itself got when they ran at once, each taking ``together[i]`` seconds."""
    return len(together) * alone / (sum(together) / len(together))


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


def make_trainer(config: str, sets, workdir: str, steps: int, overrides: dict | None = None):
    """An RL `Trainer` for a benchmark arm: ``config`` with ``--set`` overrides ``sets`` (KEY=VALUE),
    then ``overrides`` ({"section.name": value}); quiet, no plots, held-out eval or checkpoints."""
    from tltjax.config import load_config
    from tltjax.rl.trainer import Trainer

    cfg = load_config(config, [f"--config.{kv}" for kv in sets])
    fixed = {"workdir": workdir, "rl.steps": steps, "rl.resume": False, "rl.progress": False, "rl.plots": False,
             "rl.eval_prompts": 0, "rl.checkpoint_every": steps + 1}
    with cfg.unlocked():
        for key, value in {**fixed, **(overrides or {})}.items():
            *path, name = key.split(".")
            node = cfg
            for p in path:
                node = node[p]
            node[name] = value
    return Trainer(cfg, log_fn=lambda *a: None)


def alternate_steps(runs: dict, steps: int, line, before=None, rotate: bool = False) -> dict[str, list[dict]]:
    """Warms up every trainer of ``runs`` then runs their steps alternately (arm a step 1, arm b step 1, ...).

    ``line(name, metrics)`` formats the progress line printed after each step; ``before(name, step)``
    (optional) runs just before each arm's step; ``rotate``: the arm that goes first changes every
    step (the first pays the compilations the arms share: a jitted function both call with a new
    shape compiles once per process). Returns each arm's metrics per step. The trainers are closed
    at the end.
    """
    for t in runs.values():
        t.warmup()
    hist = {k: [] for k in runs}
    try:
        for step in range(1, steps + 1):
            order = list(runs.items())
            if rotate:
                k = (step - 1) % len(order)
                order = order[k:] + order[:k]
            for name, t in order:
                if before is not None:
                    before(name, step)
                m = t.step(step).metrics
                hist[name].append({"step": step, **m})
                print(f"step {step:3d} {name}: {line(name, m)}", flush=True)
    finally:
        for t in runs.values():
            t.close()
    return hist
