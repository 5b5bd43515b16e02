"""NVFP4 kernels vs the torch reference: bit-exact codes and scales, round-trip error, bad input."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe_ep import MoEEpInputError
from moe_ep.kernels import (NvFp4Tensor, dequantize_nvfp4, gather_quantize_nvfp4, nvfp4_global_scale,
                            quantize_nvfp4, swizzle_scales, unswizzle_scales)
from moe_ep.reference import (dequantize_nvfp4_ref, e2m1_codes_ref, nvfp4_global_scale_ref, quantize_nvfp4_ref,
                              swizzle_scales_ref, unswizzle_scales_ref)
from moe_ep.testing.strategies import VALUE_KINDS, make_values

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@st.composite
def inputs(draw, max_rows=64, max_k=1024, three_d=True):
    """A random x: shape (1..64 rows, K multiple of 16 up to 1024, sometimes 3-D), and a value kind."""
    k = 16 * draw(st.integers(1, max_k // 16))
    if three_d and draw(st.booleans()):
        shape = (draw(st.integers(1, 4)), draw(st.integers(1, 8)), k)
    else:
        shape = (draw(st.integers(1, max_rows)), k)
    kind = draw(st.sampled_from(VALUE_KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    return make_values(shape, kind, dtype, seed), kind


def assert_same_codes(q: NvFp4Tensor, x, gs):
    data, scales, gs_ref = quantize_nvfp4_ref(x.cpu(), None if gs is None else gs.cpu())
    assert torch.equal(q.global_scale.cpu(), gs_ref), (q.global_scale, gs_ref)
    assert torch.equal(q.linear_scales().cpu().view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(q.data.cpu(), data)


@given(inputs(), st.booleans(), st.booleans())
def test_quantize_bit_exact(dev, case, given_scale, swizzle):
    x, _ = case
    x = x.to(dev)
    gs = torch.tensor(3.7e2, device=dev) if given_scale else None
    q = quantize_nvfp4(x, gs, swizzle=swizzle)
    assert q.shape == x.shape and q.swizzled == swizzle
    assert q.data.shape == (*x.shape[:-1], x.shape[-1] // 2) and q.data.dtype == torch.uint8
    if swizzle:
        assert torch.equal(q.scales.cpu().view(torch.uint8),
                           swizzle_scales_ref(quantize_nvfp4_ref(x.cpu(), None if gs is None else gs.cpu())[1]
                                              .reshape(*x.shape[:-1], -1) if x.dim() > 1 else
                                              quantize_nvfp4_ref(x.cpu())[1][None]).view(torch.uint8))
    assert_same_codes(q, x, gs)


@given(inputs(three_d=False), st.booleans())
def test_dequantize_matches_reference_and_bound(dev, case, swizzle):
    x, kind = case
    x = x.to(dev)
    q = quantize_nvfp4(x, swizzle=swizzle)
    for dtype in DTYPES:
        y = dequantize_nvfp4(q, dtype)
        ref = dequantize_nvfp4_ref(q.data.cpu(), q.linear_scales().cpu(), q.global_scale.cpu(), dtype)
        assert torch.equal(y.cpu(), ref), dtype
    # NVFP4's error: half an e2m1 step at the top of each block, |err| <= amax_block / 6 * 1.0 per element
    # (e4m3 scale rounding adds up to 1/16 relative); on normal data the norm-wise error is about 0.1.
    if kind == "normal" and x.numel() >= 256:
        y = dequantize_nvfp4(q, torch.float32).cpu()
        rel = ((y - x.float().cpu()).norm() / x.float().cpu().norm()).item()
        assert rel < 0.16, rel


@given(inputs(three_d=False))
def test_dequant_error_is_within_half_step_per_block(dev, case):
    x, kind = case
    if kind in ("tiny", "huge"):
        return  # their blocks hit the e4m3 scale's subnormal range / global clamps; covered by bit-exactness
    xf = x.float()
    q = quantize_nvfp4(x.to(dev))
    y = dequantize_nvfp4(q, torch.float32).cpu()
    blocks = xf.reshape(-1, 16)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    # top e2m1 step is 2 (4 -> 6) at scale amax/6, so half a step is amax/6; scale rounding adds 1/16
    bound = amax / 6 * (1 + 1 / 16) + 1e-30
    assert ((y.reshape(-1, 16) - blocks).abs() <= bound).all()


@given(st.integers(1, 40), st.integers(1, 8).map(lambda c: 16 * c), st.integers(1, 3))
def test_gather_quantize_equals_quantize_of_gather(dev, m, k, reps):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, m, (m * reps,), generator=g)
    gs = nvfp4_global_scale_ref(x)
    q = gather_quantize_nvfp4(x.to(dev), idx.to(dev))
    rows = torch.where(idx[:, None] >= 0, x[idx.clamp(min=0)], torch.zeros(()).to(x.dtype))
    data, scales, _ = quantize_nvfp4_ref(rows, gs)
    assert torch.equal(q.data.cpu(), data)
    assert torch.equal(q.scales.cpu().view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(q.global_scale.cpu(), gs)
    assert (q.data[idx.to(dev) < 0] == 0).all() and (q.scales.view(torch.uint8)[idx.to(dev) < 0] == 0).all()


def test_per_slice_global_scale(dev):
    w = torch.randn(3, 40, 64) * torch.tensor([1.0, 100.0, 1e-3])[:, None, None]
    gs = nvfp4_global_scale(w.to(dev), per_slice=True)
    assert gs.shape == (3,) and torch.equal(gs.cpu(), nvfp4_global_scale_ref(w, per_slice=True))
    for swizzle in (False, True):
        q = quantize_nvfp4(w.to(dev), gs, swizzle=swizzle)
        assert_same_codes(q, w, gs)
        y = dequantize_nvfp4(q, torch.float32).cpu()
        for e in range(3):  # each expert keeps its own relative precision
            assert ((y[e] - w[e]).norm() / w[e].norm()) < 0.16


def test_search_off_runs_the_first_config_untimed(dev, monkeypatch):
    from moe_ep import options
    from moe_ep.kernels import launch_cache, nvfp4
    kernel = nvfp4._quantize_kernel
    monkeypatch.setattr(kernel, "cache", {})  # every key new: a search would time configs and fill it
    monkeypatch.setattr(launch_cache, "_KERNELS", {})  # (and on a GPU the launch cache must not answer first)
    x = torch.randn(5, 48 * 16)
    gs = nvfp4_global_scale(x.to(dev))
    with options.override(autotune="off"):
        q = quantize_nvfp4(x.to(dev), gs)
        assert_same_codes(q, x, gs.cpu())
        assert kernel.cache == {}  # nothing was timed
    with options.override(autotune="on"):  # (the interpreter's default is off)
        quantize_nvfp4(x.to(dev), gs)
    assert len(kernel.cache) == 1  # the check above can fail: with the search on, the key is timed


@given(st.integers(1, 300), st.integers(1, 12), st.integers(0, 2))
def test_swizzle_roundtrip(rows, cols, lead):
    shape = (2,) * lead + (rows, cols)
    s = (torch.rand(shape) * 400).to(torch.float8_e4m3fn)
    buf = swizzle_scales(s)
    mp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert buf.shape == (*shape[:-2], mp * cp)
    assert torch.equal(unswizzle_scales(buf, rows, cols).view(torch.uint8), s.view(torch.uint8))
    # padding is zero, and element (m, c) sits where CUTLASS's 128x4 layout puts it
    flat = buf.view(torch.uint8).reshape(-1, mp * cp)[0]
    m, c = rows - 1, cols - 1
    off = ((m // 128) * (cp // 4) + c // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + c % 4
    assert flat[off] == s.view(torch.uint8).reshape(-1, rows, cols)[0, m, c]
    assert int(flat.sum()) == int(s.view(torch.uint8).reshape(-1, rows, cols)[0].sum())


@given(st.integers(0, 300), st.integers(1, 12), st.integers(0, 2))
def test_swizzle_matches_reference(dev, rows, cols, lead):
    """The kernels' module swizzles by index arithmetic, the reference by reshape/permute: same bytes."""
    s = (torch.rand((2,) * lead + (rows, cols)) * 400).to(torch.float8_e4m3fn)
    ref = swizzle_scales_ref(s)
    buf = swizzle_scales(s.to(dev))
    assert torch.equal(buf.cpu().view(torch.uint8), ref.view(torch.uint8))
    if rows:
        assert torch.equal(unswizzle_scales(buf, rows, cols).cpu().view(torch.uint8),
                           unswizzle_scales_ref(ref, rows, cols).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_global_scale_matches_reference_at_the_edges(dev, dtype):
    """amax 0, subnormal (2688 / amax overflows), tiny, huge, the dtype's max, Inf and NaN, per tensor and per slice."""
    fin = torch.finfo(dtype)
    amaxes = [0.0, fin.tiny * 2 ** -3 if dtype != torch.bfloat16 else 1e-39, 1e-30, 1e-4, 1.0, 6.0, 448.0, 3.3e4,
              float(fin.max), math.inf, math.nan]
    x = torch.zeros(len(amaxes), 2, 16)
    x[:, 1, 3] = torch.tensor(amaxes)
    x[:, 0, 5] = -torch.tensor(amaxes) / 3
    x = x.to(dtype)
    got = nvfp4_global_scale(x.to(dev), per_slice=True).cpu()
    ref = nvfp4_global_scale_ref(x, per_slice=True)
    assert got.dtype == torch.float32 and torch.equal(got, ref), (got, ref)
    for i in range(len(amaxes)):
        assert torch.equal(nvfp4_global_scale(x[i].to(dev)).cpu(), nvfp4_global_scale_ref(x[i]))


def test_bad_device_global_scales_match_the_reference(dev):
    """The defined result of scales 0, < 0, NaN, Inf (unchecked): codes 0 and scale 0, dequantized NaN."""
    x = torch.randn(5, 2, 32)
    gs = torch.tensor([300.0, 0.0, -5.0, math.nan, math.inf])
    q = quantize_nvfp4(x.to(dev), gs.to(dev), check_finite=False)
    data, scales, _ = quantize_nvfp4_ref(x, gs)
    assert torch.equal(q.data.cpu(), data) and torch.equal(q.scales.cpu().view(torch.uint8), scales.view(torch.uint8))
    assert not data[1:].any() and not scales[1:].view(torch.uint8).any() and data[0].any()
    y, ref = dequantize_nvfp4(q, torch.float32).cpu(), dequantize_nvfp4_ref(data, scales, gs)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.nan_to_num(), ref.nan_to_num())
    assert y[1:].isnan().all() and not y[0].isnan().any()


def test_nibble_order_and_rounding_pinned(dev):
    # gs = 2688/6 = 448, so a block with amax 6 gets s = 448 (e4m3 0x7E) and x * (gs/s) = x: codes are e2m1(x)
    vals = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -6.0, 0.25, 0.75, 2.5, 5.0]
    x = torch.tensor([vals], dtype=torch.float32)
    q = quantize_nvfp4(x.to(dev))
    # element 2i in the low nibble: (0,0.5)->0x10, (1,1.5)->0x32, (2,3)->0x54, (4,6)->0x76, (-0,-0.5)->0x98,
    # (-1,-6)->0xFA, (0.25 ties to 0, 0.75 ties to 1.0)->0x20, (2.5 ties to 2, 5 ties to 4)->0x64
    assert q.data.cpu().tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xFA, 0x20, 0x64]]
    assert q.scales.cpu().view(torch.uint8).tolist() == [[0x7E]]
    assert q.global_scale.item() == 448.0
    assert dequantize_nvfp4(q, torch.float32).cpu().tolist()[0][:12] == [abs(v) if v == 0 else v for v in vals[:12]]


def test_e2m1_reference_table():
    v = torch.tensor([0.25, 0.26, 0.74, 0.75, 1.25, 1.26, 1.75, 2.5, 2.51, 3.5, 5.0, 5.01, 1e9, -0.0, -1e-9])
    assert e2m1_codes_ref(v).tolist() == [0, 1, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 8, 8]


def test_all_zero_and_empty(dev):
    q = quantize_nvfp4(torch.zeros(3, 32, device=dev))
    assert q.global_scale.item() == 1.0 and int(q.data.sum()) == 0 and int(q.scales.view(torch.uint8).sum()) == 0
    e = quantize_nvfp4(torch.zeros(0, 32, device=dev))
    assert e.data.shape == (0, 16) and dequantize_nvfp4(e).shape == (0, 32)


def test_e4m3_scale_subnormals_and_rounding(dev):
    # block amaxes spanning e4m3's subnormal range and its rounding ties, against torch's e4m3 conversion
    gs = torch.tensor(1.0, device=dev)
    amax = torch.tensor([2 ** -10 * 6, 2 ** -9 * 6 * 1.5, 2 ** -7 * 6 * 1.0625, 6 * 1.0625, 6 * 1.1875, 6 * 300.0,
                         6 * 460.0, 6 * 2 ** -6 * 0.99, 6 * 2 ** -6 * 0.9999])
    x = torch.zeros(len(amax), 16)
    x[:, 5] = amax
    x[:, 6] = -amax / 3
    assert_same_codes(quantize_nvfp4(x.to(dev), gs), x, gs)


BAD = [
    (lambda d: quantize_nvfp4(torch.randn(4, 24, device=d)), "x.shape[-1] (K)"),
    (lambda d: quantize_nvfp4(torch.randn(4, 32, device=d).to(torch.int32)), "x.dtype"),
    (lambda d: quantize_nvfp4(torch.randn(4, 32, device=d).double()), "x.dtype"),
    (lambda d: quantize_nvfp4([1.0] * 16), "type(x)"),
    (lambda d: quantize_nvfp4(torch.tensor(1.0, device=d)), "x.dim()"),
    (lambda d: quantize_nvfp4(torch.randn(4, 32, device=d), torch.empty(0, device=d)), "global_scale.shape"),
    (lambda d: quantize_nvfp4(torch.randn(4, 32, device=d), torch.ones(3, device=d)), "global_scale.shape"),
    (lambda d: quantize_nvfp4(torch.randn(4, 32, device=d), -1.0), "global_scale"),
    (lambda d: quantize_nvfp4(torch.randn(4, 32, device=d), math.inf), "global_scale"),
    (lambda d: quantize_nvfp4(torch.randn(4, 32, device=d), torch.tensor(0.0, device=d)), "global_scale"),
    (lambda d: quantize_nvfp4(torch.tensor([[math.nan] * 16], device=d)), "NaN or Inf"),
    (lambda d: quantize_nvfp4(torch.tensor([[math.inf] * 16], device=d)), "NaN or Inf"),
    (lambda d: gather_quantize_nvfp4(torch.randn(4, 32, device=d), torch.tensor([0, 4], device=d)), "row_index range"),
    (lambda d: gather_quantize_nvfp4(torch.randn(4, 32, device=d), torch.tensor([0.0], device=d)), "row_index.dtype"),
    (lambda d: gather_quantize_nvfp4(torch.randn(2, 4, 32, device=d), torch.tensor([0], device=d)), "x.dim()"),
    (lambda d: dequantize_nvfp4(torch.zeros(2, 8, dtype=torch.uint8)), "type(q)"),
    (lambda d: dequantize_nvfp4(quantize_nvfp4(torch.randn(2, 32, device=d)), torch.int8), "dtype"),
]


@pytest.mark.parametrize("call,what", BAD, ids=[w for _, w in BAD])
def test_bad_input_raises_named_error(dev, call, what):
    with pytest.raises(MoEEpInputError, match="allowed") as info:
        call(dev)
    assert what in str(info.value)
    assert isinstance(info.value, ValueError)


def test_non_finite_unchecked_never_fails(dev):
    x = torch.randn(2, 32, device=dev)
    x[0, 3] = math.nan
    q = quantize_nvfp4(x, 100.0, check_finite=False)
    assert q.data.shape == (2, 16)
    # the finite block of the second row is unaffected
    data, _, _ = quantize_nvfp4_ref(x[1:].cpu(), torch.tensor(100.0))
    assert torch.equal(q.data[1:].cpu(), data)


def test_dequantize_one_global_scale_per_row_of_a_3d_tensor(dev):
    """Received tokens [L, R*T, H] carry one global scale per row: dequantize must pair them row by row."""
    x = torch.randn(2, 3, 32) * torch.tensor([1e-3, 1.0, 1e3]).repeat(2).reshape(2, 3, 1)
    rows = x.reshape(6, 32).to(dev)
    q2 = quantize_nvfp4(rows, nvfp4_global_scale(rows, per_slice=True))
    q3 = NvFp4Tensor(q2.data.reshape(2, 3, 16), q2.scales.reshape(2, 3, 2), q2.global_scale.reshape(2, 3),
                     torch.Size((2, 3, 32)))
    y3 = dequantize_nvfp4(q3, torch.float32).cpu()
    assert torch.equal(y3.reshape(6, 32), dequantize_nvfp4(q2, torch.float32).cpu())
    ref = dequantize_nvfp4_ref(q3.data.cpu(), q3.scales.cpu(), q3.global_scale.cpu())
    assert torch.equal(y3, ref)
    assert ((y3 - x).norm(dim=-1) / x.norm(dim=-1)).max() < 0.2
