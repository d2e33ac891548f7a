"""Filesystem locations shared by all jobs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(config_value: str = "") -> Path:
    """The cache directory, created if needed: `config_value`, else ``$TLTJAX_CACHE``, else
    ``~/.cache/tltjax``. Pass ``config.cache_dir``."""
    path = Path(config_value or os.environ.get("TLTJAX_CACHE") or "~/.cache/tltjax").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path.absolute()
