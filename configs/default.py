"""Default config: what `python -m tltjax.main` runs without --config.

The values live in tltjax/default_config.py (shipped inside the package); edit them there.
"""

from tltjax.default_config import get_config

__all__ = ["get_config"]
