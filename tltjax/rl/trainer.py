"""The RL loop (job ``rl``): rollout → rewards → GRPO update → online drafter update, checkpointed.

The host side only schedules pure jitted steps: `Engine.generate` (plain and
speculative rollout), `grpo_accumulate` / `grpo_apply`, `drafter_update` and a log-prob check.
One RL step:

1. a batch of prompts (resumable sampler) × ``samples_per_prompt`` rollouts at
   ``rl.temperature``; speculation below ``rollout.spec_threshold`` active rows
   (none with ``rl.baseline``). Each finished sequence goes to the reward pool
   at once, so rewards overlap the rollout's tail;
2. group advantages (the algorithm's estimator), DAPO's dynamic sampling;
3. a log-prob recompute on a few rows (the rollout's log-probs are the old
   log-probs: exact, since speculation is lossless) and ``rl.mini_batches`` optimiser steps,
   each over micro-batches of rows sorted by length and padded to their own width;
4. the new policy goes to the engine; the drafter takes a few updates on this
   step's sequences against the new policy, and goes to the engine too.

Every ``rl.checkpoint_every`` steps everything the next steps depend on is saved
(policy and drafter params and optimiser states, the prompt sampler's position);
a run restarted in the same workdir resumes from the last complete checkpoint
and reproduces the metrics an uninterrupted run would have logged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from tltjax import sft, tiny_policy
from tltjax.config import ConfigError
from tltjax.controller import controller as controller_lib
from tltjax.rl import datasets as datasets_lib
from tltjax.rl import grpo
from tltjax.rl import reward_pool
from tltjax.rl import tasks as tasks_lib
from tltjax.rollout.sampling import SamplingParams

log = logging.getLogger("tltjax.rl.trainer")

EVAL_SEED_OFFSET = 1_000_003  # held-out problems (as in sft_demo)
PROMPT_SEED_OFFSET = 40_000  # RL prompts: a seed stream apart from the SFT data


# ---------------------------------------------------------------------------- batch building
def update_width(lengths: list[int], buckets: tuple[int, ...]) -> int:
    """The narrowest of ``buckets`` holding the longest sequence (the widest one if none does)."""
    longest = max(lengths)
    for w in sorted(buckets):
        if w >= longest:
            return int(w)
    return int(max(buckets))


def update_layout(keep: np.ndarray, lengths: np.ndarray, mini_batches: int, micro_rows: int) -> list[list[np.ndarray]]:
    """The rollout rows of each optimiser step's micro-batches.

    The kept rows (``keep``, one flag per rollout row) are dealt in order into ``mini_batches``
    slices, as evenly as they go; a slice that receives none is left out (no optimiser step on zero
    gradients: AdamW would still move the params along its momentum). Within a slice the rows are
    sorted by ``lengths`` (prompt + response) and cut into micro-batches of ``micro_rows`` rows (the
    last may be short; `Trainer._micro_batch` pads it), so that each micro-batch is padded only to
    its own longest row. Sorting inside a slice leaves that step's gradient unchanged (it is the sum
    over its micro-batches).
    """
    plan = []
    for part in np.array_split(np.flatnonzero(keep), mini_batches):
        if len(part):
            part = part[np.argsort(np.asarray(lengths)[part], kind="stable")]
            plan.append([part[i : i + micro_rows] for i in range(0, len(part), micro_rows)])
    return plan


def build_batch(
    seqs, advantages: np.ndarray, keep: np.ndarray, width: int, pad_id: int
) -> grpo.GRPOBatch:
    """The `GRPOBatch` of ``seqs`` (prompt + response, right-padded to ``width``).

    ``loss_mask[r, t] = 1`` where token ``t`` of row ``r`` is a response token
    (cut at ``width``) and the row is kept; ``old_logp`` holds the rollout's
    log-probs of those tokens. Rows not kept (dynamic sampling) count for nothing.
    """
    n = len(seqs)
    tokens = np.full((n, width), pad_id, np.int32)
    mask = np.zeros((n, width), np.float32)
    old = np.zeros((n, width), np.float32)
    for r, s in enumerate(seqs):
        ctx = (s.prompt + s.tokens)[:width]
        tokens[r, : len(ctx)] = ctx
        p = len(s.prompt)
        m = max(min(len(s.tokens), width - p), 0)
        if keep[r] and m:
            mask[r, p : p + m] = 1.0
            old[r, p : p + m] = s.logprobs[:m]
    return grpo.GRPOBatch(
        tokens=jnp.asarray(tokens), positions=None, loss_mask=jnp.asarray(mask), old_logp=jnp.asarray(old),
        advantages=jnp.asarray(advantages, jnp.float32), ref_logp=None,
    )


def length_stats(lengths) -> dict[str, float]:
    a = np.asarray(lengths, np.float64)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "max": float(a.max())}


# ---------------------------------------------------------------------------- the trainer
@dataclasses.dataclass
class StepResult:
    step: int
    metrics: dict[str, float]
    lengths: list[int]


class Trainer:
    """Holds the policy, drafter, engine, reward pool, sampler and logger of one RL run."""

    def __init__(self, config: ConfigDict, *, log_fn=print):
        from tltjax import checkpoint as ckpt_lib
        from tltjax import metrics as metrics_lib

        check_config(config)
        self.config, self.rl, self.log = config, config.rl, log_fn
        rl = config.rl
        # Several processes (tltjax.distributed): each rolls out its share of the prompts on its own
        # devices; the policy update runs on the global mesh. Process 0 writes to the workdir, the
        # others to workdir/process_<i> (their metrics, checkpoints and drafter data are their own).
        self.host, self.hosts = jax.process_index(), jax.process_count()
        self.workdir = pathlib.Path(config.workdir)
        if self.host:
            self.workdir = self.workdir / f"process_{self.host}"
        self.workdir.mkdir(parents=True, exist_ok=True)

        # ---- policy and tokenizer (process 0 trains what is not cached yet; the others then read it)
        with self._process_zero_first("policy"):
            self.policy_dir = tiny_policy.get_tiny_policy(config, progress=rl.progress, log=log_fn)
        policy, self.tokenizer = tiny_policy.load_policy(self.policy_dir)
        self.task = tasks_lib.get_task(config.task.name)
        self.eos_id = self.tokenizer.eos_id
        self.pad_id = self.tokenizer.pad_id or 0

        # ---- prompts, rewards
        if rl.dataset:
            examples = datasets_lib.load_prompt_dataset(rl.dataset, rl.prompt_field, rl.answer_field)
        else:
            examples = datasets_lib.task_dataset(
                config.task.name, config.task.num_train, config.seed + PROMPT_SEED_OFFSET, **config.task.options.to_dict()
            )
        self.examples = examples
        self.prompt_ids = datasets_lib.encode(examples, self.tokenizer)
        longest_prompt = max(len(p) for p in self.prompt_ids)
        self.sampler = datasets_lib.PromptSampler(examples, rl.prompts_per_step, seed=config.seed)
        self.reward_name = rl.reward or config.task.name
        self.rewards = reward_pool.RewardPool(self.reward_name, num_workers=rl.reward_workers,
                                              timeout_s=rl.reward_timeout_s)
        self.evals = tiny_policy.task_examples(config, rl.eval_prompts, seed=config.seed + EVAL_SEED_OFFSET) \
            if rl.eval_prompts else []
        self.eval_prompt_ids = datasets_lib.encode(self.evals, self.tokenizer)
        longest_prompt = max([longest_prompt] + [len(p) for p in self.eval_prompt_ids])

        # ---- policy train state
        # max_len: Dr.GRPO's constant divisor is the generation budget, whatever a micro-batch's width.
        self.loss_cfg = grpo.loss_config(rl.algorithm, temperature=float(rl.temperature),
                                         max_len=int(rl.max_new_tokens), **loss_overrides(rl))
        tx = sft.make_optimizer(rl.lr, rl.steps * rl.mini_batches, rl.warmup_steps * rl.mini_batches,
                                rl.weight_decay, rl.grad_clip)
        self.state = sft.TrainState.create(policy, tx)
        self.mesh = None
        self.local_params = self.state.params  # the policy params on this process's devices
        if self.hosts > 1:
            from tltjax import sharding as shd

            self.mesh = shd.make_mesh({"fsdp": -1})  # every device of every process
            self.state = self._to_global(self.state)
        # the reference policy: the initial one, frozen; held only when the KL term is on
        self.ref_params = jax.tree.map(jnp.copy, self.state.params) if self.loss_cfg.kl_coef > 0 else None
        self.sampling = SamplingParams(temperature=rl.temperature, top_p=rl.top_p)
        self.max_seq_len = longest_prompt + rl.max_new_tokens
        self.update_lengths = tuple(sorted(set(int(w) for w in rl.update_lengths) | {self.max_seq_len}))
        # rows per micro-batch: a full batch makes mini_batches * micro_batches of them
        self.micro_rows = rl.prompts_per_step * rl.samples_per_prompt // (rl.mini_batches * rl.micro_batches)

        # ---- drafter (its own train state; the engine reads its params)
        from tltjax.drafter import offline
        from tltjax.drafter.model import Drafter, load_drafter
        from tltjax.drafter.train import DrafterTrainState

        self.speculate = not rl.baseline and (config.rollout.spec_threshold > 0 or config.rollout.adaptive)
        if rl.drafter_init == "offline":
            with self._process_zero_first("drafter"):
                drafter_dir = offline.get_drafter(config, self.policy_dir, progress=rl.progress, log=log_fn)
            drafter = load_drafter(drafter_dir, policy.config)
        else:
            drafter = Drafter(offline.drafter_config(config, policy), rngs=nnx.Rngs(config.seed))
        if self.hosts > 1:  # every process starts from process 0's weights (caches may be per host)
            from jax.experimental import multihost_utils

            for module in (policy, drafter):
                nnx.update(module, multihost_utils.broadcast_one_to_all(nnx.state(module)))
        ctl = config.controller
        updates_per_step = max(rl.drafter_steps, ctl.spot_max_steps or 64)
        dtx = sft.make_optimizer(rl.drafter_lr, max(rl.steps * updates_per_step, 1), rl.drafter_warmup_steps,
                                 0.0, 1.0)
        self.drafter_state = DrafterTrainState.create(drafter, policy, dtx, ce_weight=config.drafter.ce_weight)
        self.train_drafter = not rl.baseline  # the baseline is the system without speculation or drafter
        from tltjax.drafter.buffer import DrafterBuffer

        self.buffer = DrafterBuffer.for_drafter(drafter.config, policy.config.num_hidden_layers, rl.buffer_tokens)
        self.buffer_lock = threading.Lock()  # replicas add while the spot trainer samples
        self.drafter_row_len = int(config.drafter.seq_len)

        # ---- engine
        from tltjax.rollout.engine import Engine, EngineConfig

        r = config.rollout
        self.engine_config = EngineConfig(
            max_batch=r.max_batch, max_seq_len=self.max_seq_len, page_size=r.page_size,
            memory_budget_mb=r.memory_budget_mb, decode_steps=r.decode_steps, spec_rounds=r.spec_rounds,
            spec_threshold=r.spec_threshold if self.speculate else 0, strategies=tuple(r.strategies),
            prefill_batch=r.prefill_batch, prefill_lengths=tuple(n for n in r.prefill_lengths if n <= self.max_seq_len),
            max_group=rl.samples_per_prompt, pool_budget_mb=r.pool_budget_mb,
            spec_max_bucket=r.max_batch if self.speculate and r.adaptive else 0,
            batch_buckets=engine_buckets(r.get("batch_buckets", ()), r.max_batch),
        )
        # adaptive: one bandit for every step (and every replica: they are alike), saved in checkpoints
        self.bandit = make_bandit(r, config.seed) if self.speculate and r.adaptive else None
        self.rollout_strategy = self.bandit or ("auto" if self.speculate else None)
        self.controller = None
        if ctl.replica_size:
            self.engine, self.controller = None, self._make_controller(policy, drafter)
        else:
            self.engine = Engine(policy, self.engine_config, drafter)

        # ---- checkpoints, metrics
        # (one directory for all processes: orbax's primary process writes the arrays, which are the
        # same everywhere; each process's drafter buffer, its own data, goes to its workdir)
        self.checkpointer = ckpt_lib.Checkpointer(pathlib.Path(config.workdir) / "checkpoints",
                                                  keep=rl.keep_checkpoints)
        self.start_step = 0
        if rl.resume and self.checkpointer.latest_step() is not None:
            self._restore()
        self.metrics = metrics_lib.MetricsLogger(
            self.workdir, tensorboard=rl.tensorboard, wandb=rl.wandb,
            resume_step=self.start_step if self.start_step else None,
        )
        if not self.start_step:
            # a fresh run in a used workdir: drop metrics of an earlier run
            self.metrics.close()
            self.metrics = metrics_lib.MetricsLogger(self.workdir, tensorboard=rl.tensorboard, wandb=rl.wandb,
                                                     resume_step=0)
        self.metrics_lib = metrics_lib

    # ------------------------------------------------------------------ checkpoints
    # ------------------------------------------------------------------ several processes
    @contextlib.contextmanager
    def _process_zero_first(self, what: str):
        """Runs the body on process 0, then on the others (so that a shared cache is written once)."""
        from tltjax import distributed

        if self.hosts > 1 and self.host:
            distributed.barrier(f"tltjax {what} ready")
        yield
        if self.hosts > 1 and not self.host:
            distributed.barrier(f"tltjax {what} ready")

    def _to_global(self, state: sft.TrainState) -> sft.TrainState:
        """``state`` (the same values on every process) laid out on the global mesh by logical axes."""
        from tltjax import sharding as shd

        def place(x, sharding):
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        shardings = jax.tree.leaves(shd.state_shardings(state.params, self.mesh),
                                    is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
        leaves, treedef = jax.tree.flatten(state.params)
        params = treedef.unflatten([place(x, sh) for x, sh in zip(leaves, shardings, strict=True)])
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

        def like(ref):  # moments follow their params' layout; counters are replicated
            sh = ref.sharding
            return sh if isinstance(sh, jax.sharding.NamedSharding) and sh.mesh == self.mesh else replicated

        layout = jax.jit(state.tx.init)(params)
        opt_state = jax.tree.map(lambda x, ref: place(x, like(ref)), state.opt_state, layout)
        step = place(state.step, replicated)
        return state.replace(params=params, opt_state=opt_state, step=step)

    def _to_local(self, tree):
        """Whole copies of a tree of global arrays on this process (identity with one process)."""
        if self.hosts == 1:
            return tree
        from jax.experimental import multihost_utils

        return jax.tree.map(lambda x: jnp.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)

    def _global_batch(self, batch: grpo.GRPOBatch) -> grpo.GRPOBatch:
        """The batch (the same on every process) as global arrays, rows split over the devices when they divide."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        rows = batch.tokens.shape[0]
        spec = P("fsdp") if rows % jax.device_count() == 0 else P()

        def place(x):
            if x is None:
                return None
            host = np.asarray(x)
            sharding = NamedSharding(self.mesh, P(*spec, *([None] * (host.ndim - 1))) if spec else P())
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(place, batch, is_leaf=lambda x: x is None)

    def _gather_rollouts(self, batch_idx, seqs, rewards: np.ndarray):
        """Every process's sequences and rewards, on every process, in the global prompt-major order."""
        from jax.experimental import multihost_utils

        from tltjax.rollout.engine import GeneratedSequence

        width = self.rl.max_new_tokens
        toks = np.zeros((len(seqs), width), np.int32)
        lps = np.zeros((len(seqs), width), np.float32)
        lens = np.array([len(s.tokens) for s in seqs], np.int32)
        for r, s in enumerate(seqs):
            toks[r, : lens[r]], lps[r, : lens[r]] = s.tokens, s.logprobs
        g = multihost_utils.process_allgather({"t": toks, "l": lps, "n": lens, "r": rewards})
        n = self.rl.samples_per_prompt
        out = []
        for row in range(self.hosts * len(seqs)):
            h, r = divmod(row, len(seqs))
            p, j = divmod(row, n)
            s = GeneratedSequence(prompt_index=p, sample_index=j, prompt=list(self.prompt_ids[batch_idx[p]]))
            k = int(g["n"][h, r])
            s.tokens, s.logprobs = [int(t) for t in g["t"][h, r, :k]], [float(x) for x in g["l"][h, r, :k]]
            out.append(s)
        return out, np.asarray(g["r"]).reshape(-1, n)

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_state(self) -> dict:
        s, d = self.state, self.drafter_state
        # with several processes: whole host copies (the same on every process); buffers separately
        params, opt_state, pstep = (s.params, s.opt_state, s.step) if self.hosts == 1 else \
            (self.local_params, self._to_local(s.opt_state), self._to_local(s.step))
        out = {"policy": {"params": params, "opt_state": opt_state, "step": pstep},
               "drafter": {"params": d.params, "opt_state": d.opt_state, "step": d.step}}
        if self.hosts > 1:
            return jax.tree.map(np.asarray, out)
        return {**out, "buffer": self.buffer.state_dict(copy=False)}

    def _buffer_path(self, step: int) -> pathlib.Path:
        return self.workdir / "drafter_buffer" / f"{step}.npz"

    def _save_buffer(self, step: int) -> None:
        """This process's drafter buffer at ``step`` (several processes), written atomically; keeps as
        many as there are checkpoints."""
        path = self._buffer_path(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **self.buffer.state_dict(copy=False))
        os.replace(tmp, path)
        keep = {self._buffer_path(s) for s in self.checkpointer.all_steps()} | {path}
        for old in path.parent.glob("*.npz"):
            if old not in keep:
                old.unlink(missing_ok=True)

    def _save(self, step: int) -> None:
        host = {"step": step, "sampler": self.sampler.state(), "policy_dir": str(self.policy_dir),
                "reward_counts": dict(self.rewards.counts)}
        if self.bandit is not None:
            host["bandit"] = self.bandit.state_dict()
        if self.hosts > 1:
            self._save_buffer(step)
        self.checkpointer.save(step, self._ckpt_state(), host)

    def _restore(self) -> None:
        step = self.checkpointer.latest_step()
        state, host = self.checkpointer.restore(step, target=self._ckpt_state())
        if self.hosts > 1:
            state = {**state, **jax.tree.map(jnp.asarray, {k: state[k] for k in ("policy", "drafter")})}
        self.state = self.state.replace(**state["policy"])
        self.local_params = self.state.params
        if self.hosts > 1:
            self.state = self._to_global(self.state)
        self.drafter_state = self.drafter_state.replace(**state["drafter"])
        if self.hosts == 1:
            self.buffer = type(self.buffer).from_state_dict({k: np.asarray(v) for k, v in state["buffer"].items()})
        elif self._buffer_path(step).exists():
            with np.load(self._buffer_path(step)) as f:
                self.buffer = type(self.buffer).from_state_dict({k: f[k] for k in f.files})
        else:
            self.log(f"rl: no drafter buffer of step {step} in {self._buffer_path(step).parent}; starting it empty")
        self.sampler.restore(host["sampler"])
        if self.bandit is not None and "bandit" in host:
            self.bandit.load_state_dict(host["bandit"])
        self.start_step = int(host["step"])
        self._sync_engine()
        self.log(f"rl: resumed from the checkpoint of step {self.start_step} in {self.checkpointer.directory}")

    def _sync_engine(self) -> None:
        target, drafter = nnx.merge(self.state.graphdef, self.local_params), self.drafter_state.drafter()
        for engine in self._engines():
            engine.set_params(target=target, drafter=drafter)

    def warmup(self) -> None:
        """Compiles every rollout program of every engine now (the first step would otherwise), and the
        spot trainer's drafter update for every training mesh (`warmup_spot`)."""
        for engine in self._engines():
            engine.warmup(self.sampling, with_features=self.train_drafter)
        self.warmup_spot()

    def warmup_spot(self) -> None:
        """Readies the spot trainer's update for every device set the controller can hand it (one
        compilation per mesh size, rebindings for the other sets), so that no spot update of step 1
        waits for a compilation or competes with the rollout for one. No-op without a spot trainer."""
        spot = self.controller.spot if self.controller is not None else None
        if spot is None:
            return
        t0 = time.perf_counter()
        target = nnx.state(nnx.merge(self.state.graphdef, self.local_params))
        sets = self.controller.training_meshes()
        spot.warmup(self.drafter_state, target, self.buffer.batch_spec(1, self.drafter_row_len), sets)
        self.log(f"rl: spot drafter update ready for {len(sets)} training meshes "
                 f"({len(spot.programs.sizes)} sizes) in {time.perf_counter() - t0:.1f} s")

    def _engines(self) -> list:
        return self.controller.engines if self.controller is not None else [self.engine]

    def _make_controller(self, policy, drafter):
        """Rollout replicas over this host's devices, and a spot trainer when there are several."""
        from tltjax.controller import partition_devices
        from tltjax.controller.controller import Controller
        from tltjax.controller.guard import ContentionGuard
        from tltjax.controller.spot import SpotTrainer
        from tltjax.drafter.train import drafter_update
        from tltjax.rollout.engine import Engine

        ctl = self.config.controller
        replicas = partition_devices(jax.local_devices(), ctl.replica_size)
        engines = [Engine(policy, self.engine_config, drafter, mesh=r.mesh) for r in replicas]
        spot = None
        if ctl.spot_training and len(replicas) > 1 and self.train_drafter:
            spot = SpotTrainer(drafter_update, self._sample_drafter_batch, rows_per_device=ctl.spot_rows_per_device,
                               seed=self.config.seed + 2, nice=None if ctl.nice < 0 else ctl.nice,
                               max_steps=ctl.spot_max_steps or None,
                               guard=ContentionGuard(ctl.spot_guard) if ctl.spot_guard > 0 else None)
        self.log(f"rl: {len(replicas)} rollout replicas of {ctl.replica_size} device(s)"
                 + (", idle ones train the drafter" if spot else ""))
        return Controller(replicas, engines, spot=spot)

    def _harvest(self, step: int, seqs) -> None:
        """The rollout's target features go to the drafter buffer (no forward pass of their own)."""
        if self.train_drafter:
            with self.buffer_lock:
                self.buffer.extend(step, seqs)

    def _sample_drafter_batch(self, rng, rows: int):
        """A packed batch of windows from the last ``rl.buffer_steps`` steps, or None while the buffer is empty."""
        with self.buffer_lock:
            if len(self.buffer) < 2:
                return None
            return self.buffer.sample_batch(rng, rows, self.drafter_row_len, window=self.rl.drafter_window,
                                            last_steps=self.rl.buffer_steps, pad_id=self.pad_id)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> float:
        """Greedy accuracy of the current policy on the held-out problems (nan without any)."""
        if not self.evals:
            return float("nan")
        acc, _ = tiny_policy.accuracy(nnx.merge(self.state.graphdef, self.local_params), self.tokenizer, self.evals, self.task,
                                      max_new_tokens=self.rl.max_new_tokens)
        return acc

    def evaluate_sampled(self) -> float:
        """Accuracy of ``rl.eval_samples`` responses per held-out problem, sampled as the rollouts are.

        This is what the RL reward measures (greedy decoding hides the slips that sampling makes);
        the seed is fixed, so the start and end figures see the same random numbers.
        """
        if not self.evals or not self.rl.eval_samples:
            return float("nan")
        engine = self._engines()[0]
        seqs, _ = engine.generate(self.eval_prompt_ids, n=self.rl.eval_samples, sampling=self.sampling,
                                  max_new_tokens=self.rl.max_new_tokens, stop_ids=(self.eos_id,),
                                  seed=self.config.seed + EVAL_SEED_OFFSET, strategy="auto" if self.speculate else None,
                                  return_features=self.train_drafter)
        scores = [self.task.score(self.tokenizer.decode(s.tokens, skip_special_tokens=True),
                                  self.evals[s.prompt_index].answer) for s in seqs]
        return float(np.mean(scores))

    # ------------------------------------------------------------------ one step
    def step(self, step: int, progress=None) -> StepResult:
        rl = self.rl
        t_step = time.perf_counter()
        batch_idx = self.sampler.next()
        share = len(batch_idx) // self.hosts  # this process rolls out its block of the prompts
        mine = batch_idx[self.host * share : (self.host + 1) * share]
        prompts = [self.prompt_ids[i] for i in mine]
        answers = [self.examples[i].answer for i in mine]
        n = rl.samples_per_prompt

        # ---- rollout, rewards submitted as sequences finish
        def on_finish(s):
            text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
            self.rewards.submit(s.prompt_index * n + s.sample_index, text, answers[s.prompt_index])

        gen = dict(sampling=self.sampling, max_new_tokens=rl.max_new_tokens, stop_ids=(self.eos_id,),
                   seed=hash_seed(self.config.seed + 7919 * self.host, step), strategy=self.rollout_strategy,
                   on_finish=on_finish, return_features=self.train_drafter)
        # what produced the features
        rollout_params = nnx.state(nnx.merge(self.state.graphdef, self.local_params)) if self.train_drafter else None
        ctl_metrics: dict[str, float] = {}
        if self.controller is None:
            seqs, stats = self.engine.generate(prompts, n=n, progress=progress, **gen)
            self._harvest(step, seqs)
        else:
            spot = self.controller.spot is not None
            res = self.controller.rollout(
                step, prompts, n=n, drafter_state=self.drafter_state if spot else None,
                target_params=rollout_params if spot else None, on_replica_done=lambda r, seqs: self._harvest(step, seqs),
                **gen)
            seqs, stats = res.sequences, controller_lib.merge_stats(res.stats, res.wall)
            ctl_metrics = res.metrics()
            if spot:
                self.drafter_state = res.drafter_state
            with open(self.workdir / "controller.jsonl", "a") as f:  # every transition of the replicas
                f.writelines(json.dumps(t.to_dict()) + "\n" for t in self.controller.log.for_step(step))
        t0 = time.perf_counter()
        results = self.rewards.results()
        t_reward = time.perf_counter() - t0
        rewards = np.array([r.reward for r in results], np.float32).reshape(-1, n)
        failures = {k: sum(r.status == k for r in results) for k in ("error", "timeout")}
        if self.hosts > 1:
            seqs, rewards = self._gather_rollouts(batch_idx, seqs, rewards)

        # ---- advantages, dynamic sampling
        adv = np.asarray(grpo.get_advantage_estimator(self.loss_cfg.advantage)(jnp.asarray(rewards)))
        zero_var = np.asarray(grpo.zero_variance_groups(jnp.asarray(rewards)))
        keep = np.repeat(~zero_var if self.loss_cfg.dynamic_sampling else np.ones_like(zero_var), n)
        # Rows that count go to the update, sorted by length into micro-batches of micro_rows rows,
        # each padded to its own width bucket; rows of dropped groups do not (they would add nothing).
        lengths_ctx = np.array([len(s.prompt) + len(s.tokens) for s in seqs])
        plan = update_layout(keep, lengths_ctx, rl.mini_batches, self.micro_rows)
        adv_rows = adv.reshape(-1)
        batches = [[self._micro_batch(seqs, rows, adv_rows) for rows in micro] for micro in plan]

        # ---- log-prob check on a few rows: recompute under the rollout's params
        t0 = time.perf_counter()
        k = min(rl.logprob_check_rows, len(seqs))
        mismatch = 0.0
        if k:
            check = build_batch(seqs[:k], np.zeros(k), np.ones(k, bool),
                                update_width(lengths_ctx[:k].tolist(), self.update_lengths), self.pad_id)
            lp = grpo.compute_logprobs(self.state.graphdef, self.local_params, check.tokens,
                                       temperature=self.loss_cfg.temperature)
            m = np.asarray(check.loss_mask) > 0
            if m.any():
                mismatch = float(np.abs(np.asarray(lp) - np.asarray(check.old_logp))[m].max())
        t_check = time.perf_counter() - t0

        # ---- drafter, inline: a few updates on the buffer (the rollout's features and weights)
        t0 = time.perf_counter()
        dmetrics = self._train_drafter(step, rollout_params)
        if self.hosts > 1 and not (self.controller and self.controller.spot):  # (spot training averages itself)
            self.drafter_state = jax.tree.map(jnp.asarray, controller_lib.average_over_hosts(self.drafter_state))
        t_drafter = time.perf_counter() - t0

        # ---- policy update
        t0 = time.perf_counter()
        upd = self._update_policy(batches)
        t_update = time.perf_counter() - t0

        self._sync_engine()

        lengths = [len(s.tokens) for s in seqs]
        ls = length_stats(lengths)
        correct = (rewards >= 1.0).mean()
        rollout_plain = stats.time_decode + stats.time_prefill
        m = {
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()), "accuracy": float(correct),
            "response_length/mean": ls["mean"], "response_length/p50": ls["p50"],
            "response_length/p90": ls["p90"], "response_length/max": ls["max"],
            "groups/zero_variance_frac": float(zero_var.mean()),
            "loss": float(upd["loss"]), "pg_loss": float(upd["pg_loss"]), "kl": float(upd["kl"]),
            "entropy": float(upd["entropy"]), "clip_fraction": float(upd["clip_fraction"]),
            "grad_norm": float(upd["grad_norm"]), "logprob/mismatch_max": mismatch,
            "logprob/update_mismatch_max": float(upd["logp_mismatch_max"]), "optimizer_steps": upd["updates"],
            "rollout/tokens": stats.tokens, "rollout/tokens_per_s": stats.tokens / max(stats.time_total, 1e-9),
            "rollout/accept_length": stats.mean_accept_length, "rollout/spec_token_frac":
                stats.spec_tokens / max(stats.tokens, 1), "rollout/compilations": stats.compilations,
            "rollout/preemptions": stats.preemptions,
            "reward/errors": failures["error"], "reward/timeouts": failures["timeout"],
            "time/rollout": stats.time_total, "time/rollout_plain": rollout_plain, "time/rollout_spec": stats.time_spec,
            "time/rollout_host": stats.time_host, "time/reward": t_reward, "time/logprob_check": t_check,
            "time/update": t_update, "time/drafter": t_drafter,
        }
        m.update({f"drafter/{k}": float(v) for k, v in dmetrics.items()})
        m.update(ctl_metrics)
        if self.bandit is not None:
            m.update(self.bandit.metrics())
            m["rollout/pool_mb"] = sum(e.pool_summary()["mb"] for e in self._engines())
        m["drafter/buffer_entries"] = float(len(self.buffer))
        m["time/step"] = time.perf_counter() - t_step
        m["time/idle"] = stats.time_host + t_reward  # the device waits on the host
        return StepResult(step=step, metrics=m, lengths=lengths)

    def _micro_batch(self, seqs, rows: np.ndarray, adv_rows: np.ndarray) -> grpo.GRPOBatch:
        """The `GRPOBatch` of rollout ``rows`` (kept ones), padded with empty rows to ``micro_rows`` and
        to the narrowest update width that holds its longest row; reference log-probs when KL is on."""
        pad = self.micro_rows - len(rows)
        idx = np.concatenate([rows, np.full(pad, rows[0])])
        counts = np.arange(self.micro_rows) < len(rows)
        sub = [seqs[i] for i in idx]
        width = update_width([len(s.prompt) + len(s.tokens) for s in sub[: len(rows)]], self.update_lengths)
        batch = build_batch(sub, adv_rows[idx] * counts, counts, width, self.pad_id)
        if self.ref_params is not None:
            ref = grpo.compute_logprobs(self.state.graphdef, self.ref_params, batch.tokens,
                                        temperature=self.loss_cfg.temperature)
            batch = batch.replace(ref_logp=ref * batch.loss_mask)
        return batch

    def _update_policy(self, batches: list[list[grpo.GRPOBatch]]) -> dict[str, float]:
        """One optimiser step per mini-batch (`update_layout`), all against the rollout's old
        log-probs (PPO clipping bounds how far later ones move): `grpo.grpo_accumulate` over its
        micro-batches, each of its own width, then `grpo.grpo_apply`. With no mini-batch at all
        (every group dropped by dynamic sampling) the params stay as they are.

        Returns the steps' mean metrics (zeros when there is none) and ``updates``, the optimiser
        steps taken; ``logp_mismatch_max`` is the first step's, the one taken at the rollout's own
        parameters.
        """
        got = []
        for micro in batches:
            acc = None
            if self.hosts == 1:
                for mb in micro:
                    acc = grpo.grpo_accumulate(acc, self.state, mb, self.loss_cfg)
                self.state, upd = grpo.grpo_apply(self.state, acc)
            else:  # on the global mesh
                from tltjax import sharding as shd

                with shd.use_mesh(self.mesh):
                    for mb in micro:
                        acc = grpo.grpo_accumulate(acc, self.state, self._global_batch(mb), self.loss_cfg)
                    self.state, upd = grpo.grpo_apply(self.state, acc)
                upd = self._to_local(upd)
            got.append(upd)
        if not got:
            keys = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "grad_norm", "logp_mismatch_max")
            return {**dict.fromkeys(keys, 0.0), "updates": 0.0}
        # a whole copy of the new params for this process's engines
        self.local_params = self._to_local(self.state.params)
        got = jax.device_get(got)
        out = {k: float(np.mean([g[k] for g in got])) for k in got[0]}
        out["logp_mismatch_max"] = float(got[0]["logp_mismatch_max"])
        out["updates"] = float(len(got))
        return out

    def _train_drafter(self, step: int, target_params) -> dict[str, float]:
        """``rl.drafter_steps`` updates on the critical path (none when a spot trainer does the work)."""
        from tltjax.drafter.train import drafter_update

        rl = self.rl
        if rl.drafter_steps <= 0 or not self.train_drafter or (self.controller and self.controller.spot):
            return {}
        rng = np.random.default_rng(hash_seed(self.config.seed + 1, step))
        got = []
        for _ in range(rl.drafter_steps):
            batch = self._sample_drafter_batch(rng, rl.drafter_batch)
            if batch is None:
                break
            self.drafter_state, dm = drafter_update(self.drafter_state, target_params, batch)
            got.append(dm)
        got = jax.device_get(got)
        return {k: float(np.mean([g[k] for g in got])) for k in ("loss", "top1")} if got else {}

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        rl = self.rl
        progress = self.metrics_lib.Progress(total=rl.steps - self.start_step, desc="rl",
                                             enabled=rl.progress)
        t_run = time.perf_counter()
        self.warmup_spot()
        acc_start = self.evaluate() if self.start_step == 0 else float("nan")
        sampled_start = self.evaluate_sampled() if self.start_step == 0 else float("nan")
        if self.start_step == 0 and self.evals:
            self.log(f"rl: accuracy before RL on {len(self.evals)} held-out problems: greedy {acc_start:.1%}, "
                     f"sampled {sampled_start:.1%}")
        history: list[dict] = []
        lengths_all: list[int] = []
        try:
            for step in range(self.start_step + 1, rl.steps + 1):
                bar = self.metrics_lib.Progress(total=None, desc=f"rollout {step}", enabled=rl.progress, leave=False)

                def on_progress(p, bar=bar):
                    bar.update(0, tokens=p["tokens"], active=p["active"], accept=f"{p['accept']:.2f}")

                res = self.step(step, progress=on_progress)
                bar.close()
                self.metrics.log(step, res.metrics)
                history.append({"step": step, **res.metrics})
                lengths_all += res.lengths
                m = res.metrics
                progress.update(1, reward=f"{m['reward/mean']:.3f}", len=f"{m['response_length/mean']:.0f}",
                                tau=f"{m['rollout/accept_length']:.2f}", s=f"{m['time/step']:.1f}")
                if step % rl.checkpoint_every == 0 or step == rl.steps:
                    self._save(step)
        finally:
            progress.close()
            self.checkpointer.wait()
        acc_end, sampled_end = self.evaluate(), self.evaluate_sampled()
        wall = time.perf_counter() - t_run
        summary = self._summarize(history, lengths_all, (acc_start, sampled_start), (acc_end, sampled_end), wall)
        self.close()
        return summary

    def _summarize(self, history, lengths, acc_start, acc_end, wall) -> dict:
        ml = self.metrics_lib
        records = ml.read_metrics(self.workdir / "metrics.jsonl")
        cols = ["step", "reward/mean", "accuracy", "response_length/mean", "response_length/max",
                "rollout/accept_length", "time/rollout", "time/update", "time/step"]
        table = ml.summary_table(records, cols)
        self.log(table)
        plots = ml.write_plots(records, self.workdir / "plots", lengths=lengths) if self.rl.plots else []
        first = [r for r in records if r["step"] <= 3]
        last = [r for r in records if r["step"] > max(r2["step"] for r2 in records) - 3] if records else []
        mean = lambda rows, k: float(np.mean([r[k] for r in rows])) if rows else float("nan")  # noqa: E731
        summary = {
            "steps": len(records), "wall_seconds": wall, "baseline": bool(self.rl.baseline),
            "eval_accuracy_start": acc_start[0], "eval_accuracy_end": acc_end[0],
            "eval_sampled_accuracy_start": acc_start[1], "eval_sampled_accuracy_end": acc_end[1],
            "train_accuracy_first3": mean(first, "accuracy"), "train_accuracy_last3": mean(last, "accuracy"),
            "reward_first3": mean(first, "reward/mean"), "reward_last3": mean(last, "reward/mean"),
            # the whole curve's trend (a step's prompts differ in difficulty, so 3 steps are noisy)
            "reward_trend": ml.trend([r["reward/mean"] for r in records]),
            "mean_step_seconds": mean(records, "time/step"), "mean_rollout_seconds": mean(records, "time/rollout"),
            "rollout_share": mean(records, "time/rollout") / max(mean(records, "time/step"), 1e-9),
            "mean_accept_length": mean([r for r in records if r.get("rollout/accept_length")], "rollout/accept_length"),
            "reward_failures": dict(self.rewards.counts), "plots": [str(p) for p in plots],
            # bit-exact fingerprints of the final weights (processes of one run must agree)
            "params_sha256": {"policy": tree_digest(self.local_params), "drafter": tree_digest(self.drafter_state.params)},
        }
        (self.workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.log(f"rl: {summary['steps']} steps in {wall:.0f} s; held-out accuracy: greedy {acc_start[0]:.1%} -> "
                 f"{acc_end[0]:.1%}, sampled {acc_start[1]:.1%} -> {acc_end[1]:.1%}; train accuracy {summary['train_accuracy_first3']:.1%} (first 3 steps) -> "
                 f"{summary['train_accuracy_last3']:.1%} (last 3); reward {summary['reward_trend']['first_half']:.3f} "
                 f"(first half) -> {summary['reward_trend']['second_half']:.3f} (second half); rollout {summary['rollout_share']:.0%} of step time; "
                 f"wrote {self.workdir / 'summary.json'}" + (f" and {len(plots)} plots" if plots else ""))
        return summary

    def close(self) -> None:
        self.rewards.close()
        self.metrics.close()
        self.checkpointer.close()


def tree_digest(tree) -> str:
    """SHA-256 of a pytree's arrays (leaf order, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        x = np.asarray(x)
        h.update(f"{x.dtype}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def hash_seed(seed: int, step: int) -> int:
    """A 31-bit seed for (seed, step), the same in every process."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, step]).generate_state(1)[0] & 0x7FFFFFFF)


def loss_overrides(rl: ConfigDict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rl.clip_low:
        out["clip_low"] = float(rl.clip_low)
    if rl.clip_high:
        out["clip_high"] = float(rl.clip_high)
    if rl.kl_coef:
        out["kl_coef"] = float(rl.kl_coef)
        out["kl_kind"] = rl.kl_kind
    return out


def engine_buckets(buckets, max_batch: int) -> tuple[int, ...]:
    """``config.rollout.batch_buckets`` for a run with ``max_batch``: those below it, and max_batch
    itself (the largest bucket); empty stays empty (the engine's powers of two)."""
    if not buckets:
        return ()
    try:
        sizes = {int(b) for b in buckets}
    except (TypeError, ValueError):
        sizes = {0}
    if min(sizes) < 1:
        raise ConfigError(f"config.rollout.batch_buckets={tuple(buckets)} must hold integer sizes >= 1 "
                          f"(or be empty: the powers of two up to max_batch)")
    return tuple(sorted({b for b in sizes if b < max_batch} | {int(max_batch)}))


def make_bandit(rollout: ConfigDict, seed: int):
    """The adaptive rollout's `Bandit` from ``config.rollout``; bad values are `ConfigError`s."""
    from tltjax.rollout.bandit import Bandit, BanditConfig

    try:
        return Bandit(BanditConfig(
            policy=rollout.bandit, epsilon=rollout.epsilon, window=rollout.window, hysteresis=rollout.hysteresis,
            confirm=rollout.confirm, horizon=rollout.horizon, default_threshold=rollout.spec_threshold, seed=seed))
    except ValueError as e:
        raise ConfigError(f"config.rollout: {e}") from None


def check_config(config: ConfigDict) -> None:
    """Raises `ConfigError` naming the first ``config.rl`` field that cannot work."""
    rl = config.rl
    rows = rl.prompts_per_step * rl.samples_per_prompt
    rules = [
        ("algorithm", rl.algorithm in grpo.ALGORITHMS, f"must be one of {sorted(grpo.ALGORITHMS)}"),
        ("steps", rl.steps >= 1, "must be >= 1"),
        ("prompts_per_step", rl.prompts_per_step >= 1, "must be >= 1"),
        ("samples_per_prompt", rl.samples_per_prompt >= 1, "must be >= 1 (GRPO needs >= 2 to learn)"),
        ("micro_batches", rl.micro_batches >= 1 and rows % rl.micro_batches == 0,
         f"must be >= 1 and divide prompts_per_step * samples_per_prompt = {rows}"),
        ("mini_batches", rl.mini_batches >= 1 and rows % (rl.mini_batches * rl.micro_batches) == 0,
         f"must be >= 1, and mini_batches * micro_batches must divide prompts_per_step * samples_per_prompt = {rows}"),
        ("max_new_tokens", rl.max_new_tokens >= 1, "must be >= 1"),
        ("lr", rl.lr > 0, "must be > 0"),
        ("temperature", rl.temperature > 0, "must be > 0 (RL samples its rollouts)"),
        ("top_p", rl.top_p == 1.0, "must be 1.0: the update trains the temperature-scaled distribution, and "
         "top-p sampling would make the rollout's log-probs those of another one"),
        ("drafter_init", rl.drafter_init in ("offline", "scratch"), "must be 'offline' or 'scratch'"),
        ("checkpoint_every", rl.checkpoint_every >= 1, "must be >= 1"),
        ("keep_checkpoints", rl.keep_checkpoints >= 1, "must be >= 1"),
        ("kl_coef", rl.kl_coef >= 0, "must be >= 0 (0: no reference policy in memory)"),
        ("reward_workers", rl.reward_workers >= 0, "must be >= 0 (0 computes rewards in this process)"),
        ("reward_timeout_s", rl.reward_timeout_s > 0, "must be > 0"),
        ("eval_samples", rl.eval_samples >= 0, "must be >= 0 (0: no sampled evaluation)"),
        ("prompts_per_step", rl.prompts_per_step % jax.process_count() == 0,
         f"must be a multiple of the {jax.process_count()} processes (each rolls out an equal share)"),
    ]
    rules += [
        ("buffer_tokens", rl.buffer_tokens >= 2 * config.drafter.seq_len,
         f"must hold at least two training rows (2 * drafter.seq_len = {2 * config.drafter.seq_len})"),
        ("buffer_steps", rl.buffer_steps >= 1, "must be >= 1"),
        ("drafter_window", rl.drafter_window >= 2, "must be >= 2"),
        ("drafter_lr", rl.drafter_lr > 0, "must be > 0"),
        ("drafter_warmup_steps", rl.drafter_warmup_steps >= 0, "must be >= 0 (0: full lr from the first update)"),
    ]
    for name, ok, why in rules:
        if not ok:
            raise ConfigError(f"config.rl.{name}={rl[name]!r} {why}")
    ctl = config.controller
    local = jax.local_device_count()
    for name, ok, why in [
        ("replica_size", ctl.replica_size >= 0 and (ctl.replica_size == 0 or local % ctl.replica_size == 0),
         f"must be 0 (one engine) or divide this host's {local} devices (a replica never spans hosts)"),
        ("spot_rows_per_device", ctl.spot_rows_per_device >= 1, "must be >= 1"),
        ("spot_max_steps", ctl.spot_max_steps >= 0, "must be >= 0 (0: no cap)"),
        ("spot_guard", 0 <= ctl.spot_guard < 1, "must be in [0, 1): the allowed slowdown of the tail (0: no guard)"),
    ]:
        if not ok:
            raise ConfigError(f"config.controller.{name}={ctl[name]!r} {why}")
    if config.rollout.adaptive:
        make_bandit(config.rollout, config.seed)  # its settings fail here, before anything is trained
    if rows > config.rollout.max_batch:
        # the engine queues rows beyond max_batch: allowed, but say it once
        log.info("rl: %d rows per step exceed rollout.max_batch=%d; the rest wait", rows, config.rollout.max_batch)


def run(config: ConfigDict) -> int:
    """The ``rl`` job."""
    trainer = Trainer(config)
    trainer.run()
    return 0
