"""The launch cache (moe_ep.kernels.launch_cache) launches a kept compiled kernel only when everything Triton
specialized it on is the same: its key separates every pair of arguments Triton's own specialization separates."""

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton._C.libtriton import native_specialize_impl

from moe_ep.kernels import launch_cache

INTS = [0, 1, 2, 15, 16, 17, 32, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 32 + 16, 2 ** 63 - 1, 2 ** 63, -1,
        -16, -2 ** 31, -2 ** 31 - 1, -2 ** 31 - 16]


def _triton(v):
    return native_specialize_impl(BaseBackend, v, False, True, True)


@pytest.mark.parametrize("a", INTS)
@pytest.mark.parametrize("b", INTS)
def test_int_key_separates_what_triton_separates(a, b):
    if _triton(a) != _triton(b):
        assert launch_cache._spec(a) != launch_cache._spec(b)


def test_tensor_key_separates_dtype_and_alignment():
    t = torch.zeros(64)
    specs = {launch_cache._spec(x) for x in (t, t[1:], t[4:], t.half(), t.int())}
    assert len(specs) == 5 - 1  # t and t[4:] are both 16-byte aligned fp32: one class, as in Triton
    assert _triton(t) == _triton(t[4:]) and _triton(t) != _triton(t[1:])


def test_other_kinds():
    assert launch_cache._spec(True) != launch_cache._spec(1) != launch_cache._spec(1.0) != launch_cache._spec(None)
    with pytest.raises(TypeError):
        launch_cache._spec(object())


@triton.jit
def _add_kernel(x_ptr, out_ptr, n, c, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + c, mask=m)


@triton.heuristics({"BLOCK": lambda a: 16 if a["n"] < 64 else 64})
@triton.jit
def _add_heuristic_kernel(x_ptr, out_ptr, n, c, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + c, mask=m)


@pytest.mark.parametrize("kernel, kw", [(_add_kernel, {"BLOCK": 32}), (_add_heuristic_kernel, {})])
def test_launches_agree_with_triton_across_keys(dev, kernel, kw):
    """Many calls, alternating between keys (sizes of every int class, misaligned views, dtypes, heuristic values),
    each checked: a kernel kept for one key and launched for another would write the wrong rows or values."""
    base = torch.arange(300, dtype=torch.float32, device=dev)
    for _ in range(2):
        for n in (1, 16, 17, 40, 64, 100):
            for off in (0, 1, 4):
                for dtype in (torch.float32, torch.float16):
                    x = base.to(dtype)[off:off + n]
                    out = torch.full((n + 8,), -7.0, dtype=dtype, device=dev)
                    block = kw.get("BLOCK") or (16 if n < 64 else 64)
                    launch_cache.launch(kernel, (triton.cdiv(n, block),), x, out, n, 2.5, **kw)
                    assert torch.equal(out[:n], x + 2.5), (n, off, dtype)
                    assert bool((out[n:] == -7.0).all()), (n, off, dtype)
