"""The embedded default config: a tiny Qwen2-style model trained by SFT on a toy task.

This module ships inside the package, so `python -m tltjax.main` works without a
checkout of `configs/`. `configs/default.py` re-exports it, and the other config
files start from it and change only what differs, so every default lives here once.
"""

from ml_collections import ConfigDict


def get_config() -> ConfigDict:
    """Returns the default config (job `sft_demo`)."""
    config = ConfigDict()
    config.job = "sft_demo"
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

    # Offline drafter training (job train_drafter; benchmarks use it too). Not part of the
    # tiny policy's cache key: changing these never retrains the policy.
    config.drafter = ConfigDict()
    config.drafter.num_sequences = 1024  # task prompts, one sampled response each, to train on
    config.drafter.num_eval_sequences = 64  # other prompts' responses: held-out top-1 agreement
    config.drafter.temperature = 1.0  # sampling the responses; 0 is greedy
    config.drafter.steps = 600
    config.drafter.batch_size = 16
    config.drafter.seq_len = 256  # tokens per sequence (prompt + response); longer ones are cut
    config.drafter.lr = 3e-3
    config.drafter.warmup_steps = 20
    config.drafter.ce_weight = 0.1  # weight of the cross-entropy against the policy's distribution
    config.drafter.feature_layers = ()  # target hidden layers read; empty: the final one (EAGLE-1)
    config.drafter.intermediate_size = 0  # 0: the target's

    config.generate = ConfigDict()
    config.generate.max_new_tokens = 256
    config.generate.temperature = 0.0
    config.generate.num_samples_to_print = 4
    return config
