"""What moe_ep.triton_runtime patches in Triton's interpreter, checked with the smallest kernel that needs it.

On a GPU the same kernels run compiled, so these tests also hold the compiled path to the same answers.
"""

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import triton
import triton.language as tl

from moe_ep import triton_runtime  # noqa: F401  (patches the interpreter before the kernel below runs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@triton.jit
def _masked_copy(src_ptr, dst_ptr, n, limit, BLOCK: tl.constexpr):
    """dst[i] = src[i] for i < n, only while program_id < limit: a block mask & a scalar comparison (splat)."""
    offs = tl.arange(0, BLOCK)
    ok = tl.program_id(0) < limit
    mask = (offs < n) & ok
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask, other=0.0) + 1.0, mask=mask)


@pytest.mark.parametrize("n, limit", [(0, 1), (5, 1), (16, 1), (5, 0), (16, 0)])
def test_scalar_comparison_splat_into_a_mask(dev, n, limit):
    """Triton 3.9's interpreter refuses a load/store mask that is not bool; a scalar comparison splat into a block
    became int32 there (moe-ep demo died in the chained GEMM2's ``rmask & ready``)."""
    src = torch.arange(16, dtype=torch.float32, device=dev)
    dst = torch.full((16,), -1.0, device=dev)
    _masked_copy[(1,)](src, dst, n, limit, BLOCK=16)
    want = torch.full((16,), -1.0)
    if limit > 0:
        want[:n] = torch.arange(n, dtype=torch.float32) + 1.0
    assert torch.equal(dst.cpu(), want)


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    """``code`` run as a script file in a fresh process (a compiled ``@triton.jit`` needs its source in a file)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "fresh.py")
        with open(script, "w") as f:
            f.write(code)
        return subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=120)


def test_import_moe_ep_is_lazy_and_still_decides_before_triton_is_imported():
    """``import moe_ep`` imports neither torch nor triton; the caller's ``import triton`` after it finds
    TRITON_INTERPRET decided (1 without CUDA), so the caller's own kernels are built for the right mode; every
    public name and a submodule named as an attribute resolve on first use."""
    p = _fresh_python(textwrap.dedent("""
        import os, sys
        import moe_ep
        assert not {"torch", "triton"} & set(sys.modules), sorted(m for m in sys.modules if "torch" in m)
        import triton
        import torch
        want = None if torch.cuda.is_available() else "1"
        assert os.environ.get("TRITON_INTERPRET") == want, os.environ.get("TRITON_INTERPRET")
        from triton.runtime.interpreter import InterpretedFunction
        @triton.jit
        def k(x):
            pass
        assert isinstance(k, InterpretedFunction) == (want == "1"), type(k)
        ns = {}
        exec("from moe_ep import *", ns)
        assert set(moe_ep.__all__) <= set(ns) and set(moe_ep.__all__) <= set(dir(moe_ep))
        assert ns["MoEEpLayer"].__module__ == "moe_ep.layer" and moe_ep.options.reload
        try:
            moe_ep.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("moe_ep.no_such_name resolved")
        print("ok")
    """))
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only decided for without CUDA")
def test_triton_imported_before_moe_ep_is_warned_about():
    p = _fresh_python("import triton, moe_ep, warnings\nwarnings.simplefilter('always')\nmoe_ep.fused_moe")
    assert p.returncode == 0 and "triton was imported before moe_ep" in p.stderr, p.stderr
