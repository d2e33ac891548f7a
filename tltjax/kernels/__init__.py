"""Attention kernels and the one dispatch point that chooses them by backend."""

from tltjax.kernels.attention import attention

__all__ = ["attention"]
