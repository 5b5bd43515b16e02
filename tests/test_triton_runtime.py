"""What moe_ep.triton_runtime patches in Triton's interpreter, checked with the smallest kernel that needs it.

On a GPU the same kernels run compiled, so these tests also hold the compiled path to the same answers.
"""

import pytest
import torch
import triton
import triton.language as tl

import moe_ep  # noqa: F401  (sets TRITON_INTERPRET and patches the interpreter before the kernel below is built)


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
