"""Test setup: moe_ep first (it picks the interpreter without a GPU), hypothesis profiles, markers."""

import importlib
import importlib.util
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

# Hypothesis imports some of its modules lazily, in the middle of a test's search (the optimiser when a test reports
# a target, ...), and pytest rewrites them as it imports them (hypothesis is a pytest plugin). There, deep in the
# test's stack, CPython 3.11's compile() can fail with "SystemError: AST constructor recursion depth mismatch" (a
# CPython bug: python/cpython#106905, pytest-dev/pytest#10763), failing the test: imported here, at the top, instead.
for _lazy in ("hypothesis.internal.conjecture.optimiser", "hypothesis.internal.conjecture.pareto",
              "hypothesis.internal.conjecture.datatree", "hypothesis.internal.conjecture.providers",
              "hypothesis.internal.observability", "hypothesis.internal.entropy", "hypothesis.database",
              "hypothesis.vendor.pretty"):
    if importlib.util.find_spec(_lazy) is not None:  # (the names of one hypothesis release: others may differ)
        importlib.import_module(_lazy)

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
