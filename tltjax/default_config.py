"""The embedded default config: a tiny Qwen2-style model trained by SFT on a toy task.

This module ships inside the package, so `python -m tltjax.main` works without a
checkout of `configs/`. `configs/default.py` re-exports it, and the other config
files start from it and change only what differs, so every default lives here once.
"""

from ml_collections import ConfigDict


def get_config() -> ConfigDict:
    """Returns the default config (job `rl`: the tiny policy, then GRPO with speculative rollouts)."""
    config = ConfigDict()
    config.job = "rl"
    config.seed = 0
    config.workdir = "runs/default"
    # Empty: $TLTJAX_CACHE, else ~/.cache/tltjax (see tltjax.paths.cache_dir).
    config.cache_dir = ""

    # A tiny Qwen2-style decoder. Field names follow HF config.json.
    config.model = ConfigDict()
    config.model.vocab_size = 0  # 0: take the size from the tokenizer.
    config.model.hidden_size = 128
    config.model.intermediate_size = 384
    config.model.num_hidden_layers = 2
    config.model.num_attention_heads = 4
    config.model.num_key_value_heads = 2
    config.model.rope_theta = 10000.0
    config.model.tie_word_embeddings = True
    config.model.max_position_embeddings = 512

    config.task = ConfigDict()
    config.task.name = "longtail_arith"
    config.task.num_train = 20000
    config.task.num_eval = 256
    # Keyword arguments of the task's generator (see tltjax/rl/tasks.py).
    config.task.options = ConfigDict({"max_value": 29})

    config.sft = ConfigDict()
    config.sft.batch_size = 4  # rows of seq_len token slots; narrower rows come proportionally more
    config.sft.seq_len = 416
    # Row widths for packed batches: each example is packed into the narrowest that holds it.
    config.sft.widths = (64, 128, 256, 416)
    config.sft.lr = 3e-3
    config.sft.warmup_steps = 30
    config.sft.steps = 1500
    config.sft.weight_decay = 0.01
    config.sft.grad_clip = 1.0
    config.sft.log_every = 50
    # Fraction of worked steps in the SFT data whose result is off by 1 or 2 (later steps continue
    # from it). The policy then slips at about this rate when it samples, as models distilled from
    # imperfect solutions do: errors for RL's reward to remove. 0: clean data. With clean data the tiny
    # policy's errors are systematic (it reads the wrong operand) and 24 RL steps barely move them.
    config.sft.slip_rate = 0.15

    # Offline drafter training (job train_drafter; benchmarks use it too). Not part of the
    # tiny policy's cache key: changing these never retrains the policy.
    config.drafter = ConfigDict()
    config.drafter.num_sequences = 256  # task prompts, one sampled response each, to train on
    config.drafter.num_eval_sequences = 64  # other prompts' responses: held-out top-1 agreement
    config.drafter.temperature = 1.0  # sampling the responses; 0 is greedy
    config.drafter.steps = 150
    config.drafter.batch_size = 16
    config.drafter.seq_len = 256  # tokens per sequence (prompt + response); longer ones are cut
    config.drafter.lr = 3e-3
    config.drafter.warmup_steps = 20
    config.drafter.ce_weight = 0.1  # weight of the cross-entropy against the policy's distribution
    config.drafter.feature_layers = ()  # target hidden layers read; empty: the final one (EAGLE-1)
    config.drafter.intermediate_size = 0  # 0: the target's
    # False: no RMSNorm on the layer's input, as EAGLE-1 (SGLang / vLLM can load the exported drafter).
    config.drafter.input_norm = False

    # The RL run (job rl): GRPO-family updates on rollouts of the engine below.
    config.rl = ConfigDict()
    config.rl.algorithm = "dapo"  # grpo | drgrpo | dapo (see tltjax/rl/grpo.py ALGORITHMS)
    config.rl.steps = 24
    config.rl.prompts_per_step = 32
    config.rl.samples_per_prompt = 8
    config.rl.temperature = 1.0
    config.rl.top_p = 1.0
    config.rl.max_new_tokens = 320
    # Low: the first AdamW steps move every weight by about the lr, which at 1e-3 undid the SFT
    # policy on the toy task (docs/rl.md, "What limits the reward's rise on the toy task").
    config.rl.lr = 2e-4
    config.rl.warmup_steps = 2
    config.rl.weight_decay = 0.0
    config.rl.grad_clip = 1.0
    # Optimiser steps per RL step, each on a slice of the kept rows (PPO-style: the rollout's log-probs
    # are the old policy's for all of them); 1: one full-batch step. Costs no more compute than 1.
    config.rl.mini_batches = 4
    config.rl.micro_batches = 4  # per optimiser step; mini * micro must divide prompts_per_step * samples_per_prompt
    # Loss overrides of the algorithm's preset; 0 / "" keep the preset's value.
    config.rl.clip_low = 0.0
    config.rl.clip_high = 0.0
    config.rl.kl_coef = 0.0  # > 0 keeps a frozen reference policy in memory
    config.rl.kl_kind = "low_var_kl"  # kl | low_var_kl | mse
    # Update widths: each micro-batch (rows sorted by length) is padded to the narrowest that holds it.
    config.rl.update_lengths = (64, 128, 256, 416)
    # Rewards: "" uses the task's scorer (config.task.name); else a registered name or "module:function".
    config.rl.reward = ""
    config.rl.reward_workers = 2
    config.rl.reward_timeout_s = 10.0
    # Prompts: "" generates them from config.task; else a .jsonl / .parquet file with these fields.
    config.rl.dataset = ""
    config.rl.prompt_field = "prompt"
    config.rl.answer_field = "answer"
    config.rl.baseline = False  # True: the same run without speculative decoding
    config.rl.drafter_init = "offline"  # offline (the train_drafter job's, cached) | scratch
    config.rl.drafter_steps = 2  # online drafter updates per RL step, on that step's rollouts
    config.rl.drafter_batch = 16  # packed rows of drafter.seq_len entries per inline update
    # The online drafter's own optimiser (inline and spot updates): it refines a trained drafter, so a
    # lower peak lr than drafter.lr, reached by a linear warm-up over this many updates (a fresh Adam
    # state's first steps are full-size: without it the first updates undo part of the warm start).
    config.rl.drafter_lr = 1e-3
    config.rl.drafter_warmup_steps = 10
    # Drafter data: the rollouts' own target features (no extra forward pass), in a ring buffer.
    config.rl.buffer_tokens = 65536  # entries (token + feature) the ring holds
    config.rl.buffer_steps = 4  # train on windows of the last N RL steps' rollouts
    config.rl.drafter_window = 512  # longest training window (cut to drafter.seq_len, the packed row)
    config.rl.logprob_check_rows = 8  # rows whose log-probs are recomputed each step (mismatch logged)
    config.rl.eval_prompts = 128  # held-out prompts, greedy, at the start and the end (0: none)
    config.rl.eval_samples = 4  # and this many responses each sampled at rl.temperature (0: none)
    config.rl.checkpoint_every = 5
    config.rl.keep_checkpoints = 2
    config.rl.resume = True  # continue from the workdir's last complete checkpoint
    config.rl.tensorboard = True
    config.rl.wandb = False
    config.rl.plots = True
    config.rl.progress = True

    # The controller (tltjax/controller): rollout replicas and spot drafter training on idle ones.
    config.controller = ConfigDict()
    config.controller.replica_size = 0  # devices per rollout replica; 0: one engine on the default device
    config.controller.spot_training = True  # replicas that finish early train the drafter (needs >= 2)
    config.controller.spot_rows_per_device = 4  # packed rows per training device and update
    config.controller.spot_max_steps = 0  # most spot updates per RL step (0: as many as the tail allows)
    # spot training slows the decoding replicas by at most this (measured; tltjax/controller/guard.py); 0: off
    config.controller.spot_guard = 0.02
    config.controller.nice = 19  # priority of spot training's background XLA compilations (shared CPU cores); -1 keeps it

    # Several processes (hosts): jax.distributed (tltjax/distributed.py). Each runs the same command.
    config.distributed = ConfigDict()
    config.distributed.num_processes = 1  # > 1: join a group of this many processes
    config.distributed.coordinator_address = ""  # host:port of process 0
    config.distributed.process_id = 0  # this process's index in [0, num_processes)
    config.distributed.slurm = True  # under srun with several tasks, read all of the above from SLURM
    config.distributed.timeout_s = 300  # seconds to wait for every process to join

    # The rollout engine (tltjax/rollout/engine.py EngineConfig).
    config.rollout = ConfigDict()
    config.rollout.max_batch = 128
    # Batch buckets, one compiled program each (and a speculative one each up to spec_threshold); empty:
    # the powers of two up to max_batch; sizes above max_batch are dropped and max_batch is always one.
    # A batch runs in the smallest bucket that holds it. On CPU four
    # buckets roll out as fast as all eight powers of two and compile in half the time (docs/benchmarks.md).
    config.rollout.batch_buckets = (4, 16, 64, 128)
    config.rollout.page_size = 16
    config.rollout.memory_budget_mb = 0.0  # 0: room for max_batch full-length rows
    config.rollout.decode_steps = 8
    config.rollout.spec_rounds = 4
    config.rollout.spec_threshold = 16  # speculate when the active rows fit this bucket
    config.rollout.strategies = ("eagle:depth=4",)
    config.rollout.prefill_batch = 16
    config.rollout.prefill_lengths = (32, 64)
    # Adaptive rollout (tltjax/rollout/bandit.py, docs/adaptive_rollout.md): a bandit picks plain or a
    # strategy per batch bucket from measured tokens/s; spec_threshold is then only its first guess.
    config.rollout.adaptive = False
    config.rollout.bandit = "ucb"  # ucb (window mean) | egreedy (TLT's: window median, random exploration)
    config.rollout.epsilon = 0.05  # egreedy: share of chunks that try another arm
    config.rollout.window = 16  # rewards kept per (bucket, arm)
    config.rollout.hysteresis = 0.05  # another arm must beat the current one by this fraction
    config.rollout.confirm = 3  # ... on at least this many rewards
    config.rollout.horizon = 256  # a reward expires after this many chunks of its bucket
    config.rollout.pool_budget_mb = 0.0  # memory for compiled programs (0: no limit; small buckets first)

    config.generate = ConfigDict()
    config.generate.max_new_tokens = 256
    config.generate.temperature = 0.0
    config.generate.num_samples_to_print = 4
    return config
