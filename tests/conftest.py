"""Test-wide setup: 8 virtual CPU devices (for mesh tests) and tiny Hugging Face models."""

import os

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
