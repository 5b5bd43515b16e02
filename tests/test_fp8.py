"""FP8 block-scaled quantize / dequantize (moe_ep.kernels.fp8) bit-exact against the reference: random shapes with
tails, every value kind, every finite bf16 value, block amax on the e4m3 rounding boundaries, all-zero blocks, bad
inputs."""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe_ep import MoEEpInputError
from moe_ep.kernels.fp8 import Fp8Tensor, dequantize_fp8, quantize_fp8
from moe_ep.reference import dequantize_fp8_ref, quantize_fp8_ref
from moe_ep.testing.properties import assert_bits_equal
from moe_ep.testing.strategies import VALUE_KINDS, make_values


def _check(x, block_rows, dev):
    q = quantize_fp8(x.to(dev), block_rows)
    rq, rs = quantize_fp8_ref(x, block_rows)
    assert_bits_equal(q.scales, rs, "FP8 block scales")
    assert_bits_equal(q.data.view(torch.uint8), rq.view(torch.uint8), "FP8 codes")
    assert_bits_equal(dequantize_fp8(q, torch.float32), dequantize_fp8_ref(rq, rs, block_rows), "dequantized values")
    return q


@given(st.integers(1, 2), st.integers(0, 9), st.integers(1, 20).map(lambda c: 16 * c), st.sampled_from([1, 128]),
       st.sampled_from(VALUE_KINDS), st.sampled_from(["bfloat16", "float16", "float32"]), st.integers(0, 2 ** 31 - 1))
def test_matches_the_reference(dev, lead, rows, k, block_rows, kind, dtype, seed):
    rows = rows if block_rows == 1 else rows * 20  # weights: row blocks of 128 with tails
    x = make_values((lead * rows, k), kind, getattr(torch, dtype), seed).reshape(lead, rows, k)
    _check(x, block_rows, dev)


def test_every_finite_bf16_value(dev):
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = bits[torch.isfinite(bits)]
    n = vals.numel() // 128 * 128
    x = vals[:n].reshape(-1, 128)
    x[:, 0] = 448.0  # every row's amax 448: scale 1, so each value meets the e4m3 grid itself
    _check(x, 1, dev)
    _check(vals[:n].reshape(-1, 128), 1, dev)  # and in blocks of whatever amax they have


@pytest.mark.parametrize("amax", [448.0, 448.0 * 2 ** -9, 464.0, 1e-38, 3e38, 0.0])
def test_block_amax_on_the_boundaries(dev, amax):
    """Scales at and around e4m3's grid: the amax element itself must come out +-448 (saturating, never NaN)."""
    x = torch.linspace(-1, 1, 3 * 200, dtype=torch.float32).reshape(3, 200) * (amax / 2)
    x[:, 7] = amax
    x[1, 9] = -amax
    q = _check(x, 1, dev)
    if amax:
        assert bool((q.data.float()[:, 7] == 448.0).all())
    else:
        assert bool((q.scales == 1.0).all()) and not bool(q.data.float().any())


def test_all_zero_block_has_scale_one_and_codes_zero(dev):
    x = torch.zeros(130, 300)
    x[:, 256:] = 1.0
    q = _check(x, 128, dev)
    assert torch.equal(q.scales.cpu(), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]) / 448 * torch.tensor([448, 448, 1]))
    assert not bool(q.data[:, :256].float().any())


@pytest.mark.parametrize("I", [16, 144, 256])
def test_gate_up_blocks_each_half_apart(dev, I):
    """``gate_up``: a w13's gate and up rows quantized as two tensors (scales: gate's row blocks, then up's), bit for
    bit the reference; the dequantized values put each half back in place; where I % 128 == 0 it is the plain
    layout."""
    x = make_values((2, 2 * I, 144), "normal", torch.bfloat16, I).to(dev)
    x[:, I:] *= 1000  # up rows far larger than gate's: a shared block would flush gate's codes
    q = quantize_fp8(x, 128, gate_up=True)
    rq, rs = quantize_fp8_ref(x.cpu(), 128, gate_up=True)
    assert q.gate_up and q.scales.shape == (2, 2 * -(-I // 128), 2)
    assert_bits_equal(q.scales, rs, "gate_up scales")
    assert_bits_equal(q.data.view(torch.uint8), rq.view(torch.uint8), "gate_up codes")
    assert_bits_equal(dequantize_fp8(q, torch.float32), dequantize_fp8_ref(rq, rs, 128, True), "gate_up values")
    gate = quantize_fp8(x[:, :I], 128)
    assert_bits_equal(q.data[:, :I].view(torch.uint8), gate.data.view(torch.uint8), "gate half")
    if I % 128 == 0:
        plain = quantize_fp8(x, 128)
        assert_bits_equal(q.scales, plain.scales, "the plain layout where I % 128 == 0")


BAD = [
    ("x_1d", lambda d: quantize_fp8(torch.zeros(16).to(d)), "x.dim() = 1"),
    ("x_int", lambda d: quantize_fp8(torch.zeros(2, 16, dtype=torch.int32).to(d)), "x.dtype = torch.int32"),
    ("block_rows_64", lambda d: quantize_fp8(torch.zeros(2, 16).to(d), 64), "block_rows = 64"),
    ("block_rows_true", lambda d: quantize_fp8(torch.zeros(2, 16).to(d), True), "block_rows = True"),
    ("nan", lambda d: quantize_fp8(torch.tensor([[1.0, float("nan")]]).to(d)), "x holds NaN or Inf"),
    ("meta", lambda d: quantize_fp8(torch.zeros(2, 16, device="meta")), "x.device"),
    ("scales_shape", lambda d: Fp8Tensor(torch.zeros(4, 256).to(torch.float8_e4m3fn), torch.ones(4, 1)),
     "Fp8Tensor.scales.shape = (4, 1)"),
    ("scales_dtype", lambda d: Fp8Tensor(torch.zeros(4, 16).to(torch.float8_e4m3fn), torch.ones(4, 1).half()),
     "Fp8Tensor.scales.dtype = torch.float16"),
    ("data_dtype", lambda d: Fp8Tensor(torch.zeros(4, 16), torch.ones(4, 1)), "Fp8Tensor.data.dtype = torch.float32"),
    ("dequant_type", lambda d: dequantize_fp8(torch.zeros(2, 2)), "type(q) = 'Tensor'"),
    ("gate_up odd rows", lambda d: quantize_fp8(torch.zeros(3, 16).to(d), 128, gate_up=True), "x.shape = (3, 16)"),
    ("gate_up int", lambda d: quantize_fp8(torch.zeros(2, 16).to(d), 128, gate_up=1), "gate_up = 1"),
    ("gate_up plain scales", lambda d: Fp8Tensor(torch.zeros(2, 288, 16).to(torch.float8_e4m3fn), torch.ones(2, 3, 1),
                                                 128, True), "Fp8Tensor.scales.shape = (2, 3, 1)"),
    ("gate_up odd data", lambda d: Fp8Tensor(torch.zeros(3, 16).to(torch.float8_e4m3fn), torch.ones(2, 1), 128, True),
     "Fp8Tensor.data.shape = (3, 16)"),
    ("out not fp8", lambda d: quantize_fp8(torch.zeros(2, 16).to(d), out=torch.zeros(2, 16).to(d)), "type(out)"),
    ("out shape", lambda d: quantize_fp8(torch.zeros(2, 16).to(d), out=_out(3, 16, d)), "out (shape, block_rows)"),
    ("out block rows", lambda d: quantize_fp8(torch.zeros(2, 16).to(d), 128, out=_out(2, 16, d)),
     "out (shape, block_rows)"),
    ("out strided", lambda d: quantize_fp8(torch.zeros(2, 16).to(d), out=Fp8Tensor(
        torch.zeros(2, 32).to(torch.float8_e4m3fn).to(d)[:, :16], torch.ones(2, 1).to(d))), "out parts contiguous"),
    ("out gate_up", lambda d: quantize_fp8(torch.zeros(2, 16).to(d), 128, gate_up=True,
                                           out=Fp8Tensor(torch.zeros(2, 16).to(torch.float8_e4m3fn).to(d),
                                                         torch.ones(2, 1).to(d), 128, True)), "out = 'an Fp8Tensor'"),
]


def _out(rows, k, d):
    return Fp8Tensor(torch.zeros(rows, k).to(torch.float8_e4m3fn).to(d), torch.ones(rows, -(-k // 128)).to(d))


@pytest.mark.parametrize("rows, k", [(5, 300), (1, 128), (16, 7168)])
def test_out_is_written_and_returned_bit_for_bit(dev, rows, k):
    """``quantize_fp8(x, out=q)`` writes x's codes and scales into q's (poisoned) parts and returns q: the same bits
    as the allocating call."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k)).bfloat16().to(dev) * 7
    out = Fp8Tensor(torch.full((rows, k), 0x7F, dtype=torch.uint8).to(dev).view(torch.float8_e4m3fn),
                    torch.full((rows, -(-k // 128)), float("nan")).to(dev))
    got = quantize_fp8(x, out=out)
    want = quantize_fp8(x)
    assert got is out
    assert_bits_equal(got.data, want.data, "codes")
    assert_bits_equal(got.scales, want.scales, "scales")


@pytest.mark.parametrize("name, call, says", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(dev, name, call, says):
    with pytest.raises(MoEEpInputError, match=re.escape(says)):
        call(dev)
