"""The bridge kernels build for H200 (sm_90) and B200 (sm_100): triton.compile in a process without the
interpreter (no GPU needed)."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from moe_ep.kernels.bridge import _compile_checks
arch = int(sys.argv[1])
for fn, sig, const in _compile_checks():
    triton.compile(ASTSource(fn, signature=sig, constexprs=const), target=GPUTarget("cuda", arch, 32))
print("compiled", len(_compile_checks()))
"""


@pytest.mark.parametrize("arch", [90, 100])
def test_bridge_kernels_compile(arch):
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(arch)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
