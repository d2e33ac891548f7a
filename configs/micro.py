"""Micro config for tests and smoke runs: the default config, shrunk to run in seconds on CPU."""

from ml_collections import ConfigDict

from tltjax import default_config


def get_config() -> ConfigDict:
    """Returns the default config with tiny sizes."""
    config = default_config.get_config()
    config.workdir = "runs/micro"

    config.model.hidden_size = 64
    config.model.intermediate_size = 128
    config.model.num_hidden_layers = 2
    config.model.num_attention_heads = 2
    config.model.num_key_value_heads = 1

    config.task.num_train = 512

    config.sft.batch_size = 8
    config.sft.seq_len = 128
    config.sft.widths = (64, 128)
    config.sft.steps = 30
    config.sft.slip_rate = 0.0  # clean data: the tests' policy and figures predate slips in the default

    # Greedy samples: at temperature 0, top-1 agreement on them is the speculative acceptance rate.
    config.drafter.num_sequences = 48
    config.drafter.temperature = 0.0
    config.drafter.num_eval_sequences = 16
    config.drafter.steps = 60
    config.drafter.batch_size = 16
    config.drafter.seq_len = 96

    config.generate.max_new_tokens = 64

    config.rl.steps = 4
    config.rl.prompts_per_step = 4
    config.rl.samples_per_prompt = 4
    config.rl.max_new_tokens = 64
    config.rl.micro_batches = 2
    config.rl.mini_batches = 1
    config.rl.lr = 5e-4
    config.rl.update_lengths = (64, 128)
    config.rl.reward_workers = 1
    config.rl.drafter_steps = 2
    config.rl.drafter_batch = 8
    config.rl.buffer_tokens = 8192
    config.rl.logprob_check_rows = 4
    config.rl.eval_prompts = 16
    config.rl.checkpoint_every = 2
    config.rl.progress = False

    config.rollout.max_batch = 16
    config.rollout.batch_buckets = ()  # every power of two: the tests see every bucket's programs
    config.rollout.spec_threshold = 4
    config.rollout.prefill_batch = 8
    config.rollout.prefill_lengths = (32,)
    return config
