"""Test-wide setup: 8 virtual CPU devices (for mesh tests) and tiny Hugging Face models."""

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.hf_models import FAMILIES, make_hf_model  # noqa: E402


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def hf_model(request, tmp_path_factory):
    """(family, torch model, directory) of a random tiny Hugging Face model, saved once per session."""
    family = request.param
    path = tmp_path_factory.mktemp(f"hf_{family}")
    model = make_hf_model(family, path)
    return family, model, path


@pytest.fixture(scope="session")
def micro_cache(tmp_path_factory):
    """A cache dir holding the micro config's tiny policy and its offline drafter, trained once per session."""
    from tltjax import tiny_policy
    from tltjax.config import load_config
    from tltjax.drafter import offline

    cache = tmp_path_factory.mktemp("micro_cache")
    cfg = load_config(str(pathlib.Path(__file__).resolve().parents[1] / "configs/micro.py"), [f"--config.cache_dir={cache}"])
    policy = tiny_policy.get_tiny_policy(cfg, progress=False, log=lambda *a: None)
    offline.get_drafter(cfg, policy, progress=False, log=lambda *a: None)
    return cache
