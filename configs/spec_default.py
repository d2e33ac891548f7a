"""The default tiny policy with the longer-trained offline drafter that the rollout benchmarks use.

The embedded default trains its drafter briefly (256 sequences, 150 steps) so that
the whole first-use pipeline stays within its time budget; the RL run then keeps
training it online. The rollout benchmarks measure a drafter trained offline to
convergence on the same policy: 1024 sequences, 600 steps.
"""

from ml_collections import ConfigDict

from tltjax import default_config


def get_config() -> ConfigDict:
    config = default_config.get_config()
    config.drafter.num_sequences = 1024
    config.drafter.steps = 600
    config.drafter.input_norm = True  # as measured; drafters for export use False
    return config
