"""Reinforcement learning: tasks and rewards, GRPO losses and the trainer."""
