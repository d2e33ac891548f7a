"""tltjax: reasoning-RL training in JAX that tames the long tail of rollouts."""

__version__ = "0.1.0"
