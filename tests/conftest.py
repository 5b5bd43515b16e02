"""Test setup: moe_ep first (it picks the interpreter without a GPU), hypothesis profiles, markers."""

import os
import tempfile

# a developer's own tuned configs (~/.config/moe-ep/configs, searched before the shipped ones) must not change
# what the tests see: the tests (and the processes they spawn) get an empty user folder of their own
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="moe-ep-tests-config-")

import moe_ep  # noqa: E402,F401  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch
from hypothesis import settings

from moe_ep.testing.profiles import CI, register_profiles

register_profiles()
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", CI))

HAS_GPU = torch.cuda.is_available()


def pytest_addoption(parser):
    # the compile checks (tests/test_compile.py) are a build per kernel variant, per target: minutes without a warm
    # Triton cache. CI runs the suite on two Tritons, each one shard: each builds every variant (for one of the two
    # targets, alternating), and the two together build every variant for both targets
    parser.addoption("--compile-shard", choices=["all", "0", "1"], default="all",
                     help="tests/test_compile.py: build every kernel variant for both targets (all), or one half")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def dev():
    """The device the kernels run on here (cuda, or cpu through the interpreter)."""
    return moe_ep.triton_runtime.device()
