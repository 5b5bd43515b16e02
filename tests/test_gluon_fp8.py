"""The Gluon FP8 block-scaled grouped GEMM (moe_ep/kernels/grouped_gemm/gluon_fp8.py) against the fp32 reference and
the tl FP8 grouped GEMM.

The GPU cases need sm_90 (wgmma, TMA) and run every variant (``gluon_fp8.VARIANTS``, and GEMM1's
``gluon_fp8.SWIGLU_VARIANTS``) as its own test, so that one failing variant does not hide the others. The reference multiplies the dequantized operands (``dequantize_fp8_ref``)
in fp32: the kernel computes that function up to the summation order (the products of two e4m3 values are exact in
fp32), the tensor core's FP8 accumulation within one 128-wide K block and the bf16 output: 1e-2 relative, the bound
tests/test_fp8_gemm.py holds the tl FP8 GEMM to. Against the tl FP8 GEMM on the same operands the bound is the sum of
the two kernels' bounds, 2e-2 (each is within 1e-2 of the same fp32 result). GEMM1 (SwiGLU, FP8 out) is held to
``swiglu_fp8_ref`` of the reference's fp32 SwiGLU values and to the tl FP8 GEMM1's output, each by
``properties.assert_fp8_rows_close``: both sides quantize by one rule, so a code differs (by one step where normal)
only where the fp32 sums' order puts its value across a rounding boundary; dequantized values within 2e-2 relative
norm, scales within 1e-2 each, at least 75% of the codes identical (``properties.GLUON_FP8_*`` say why; the
comparison itself is checked on CPU: it passes sums a hair apart and fails a wrong rounding rule or scale). The bad-input tables and the no-GPU errors run
anywhere (the argument checks come before any launch; the device checks last).
"""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from moe_ep import MoEEpConfigError, MoEEpInputError
from moe_ep.kernels.fp8 import Fp8Tensor
from moe_ep.kernels.grouped_gemm import gluon_fp8
from moe_ep.reference import quantize_fp8_ref, swiglu_fp8_ref
from moe_ep.testing.properties import assert_fp8_rows_close, check_gluon_fp8_gemm, check_gluon_fp8_swiglu_gemm
from moe_ep.testing.strategies import gluon_fp8_cases

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is built for sm_90 (Hopper)")
VARIANTS = list(gluon_fp8.VARIANTS)
SWIGLU_VARIANTS = list(gluon_fp8.SWIGLU_VARIANTS)
CUDA = torch.device("cuda")


def _truncated(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """e4m3 codes ``q`` (round to nearest) of ``v`` turned into truncation's: one step toward zero where rounding went
    away from it (e4m3's magnitudes are ordered as its low 7 bits)."""
    b = q.view(torch.uint8).clone()
    away = (q.float().abs() > v.abs()) & (b & 0x7F > 0)
    return torch.where(away, b - 1, b).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("rows, cols", [(64, 256), (3, 8)])
def test_fp8_rows_comparison_passes_near_sums_and_fails_a_wrong_rule(rows, cols):
    """``assert_fp8_rows_close`` (how GEMM1's FP8 output is compared on the GPU): the quantization of sums 1e-4 apart
    passes; truncation instead of rounding, and a scale twice too large (the codes then half), fail."""
    h = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 3
    q_ref, s_ref = swiglu_fp8_ref(h)
    q, s = swiglu_fp8_ref(h * (1 + 1e-4 * torch.randn(rows, cols, generator=torch.Generator().manual_seed(7))))
    assert_fp8_rows_close(q, s, q_ref, s_ref, "sums 1e-4 apart")
    v = h / s_ref.repeat_interleave(128, dim=1)[:, :cols]
    with pytest.raises(AssertionError):  # (its values move by half a step on average: the norm bound sees it too)
        assert_fp8_rows_close(_truncated(q_ref, v), s_ref, q_ref, s_ref, "truncated")
    with pytest.raises(AssertionError, match="scale"):
        half = (q_ref.float() / 2).to(torch.float8_e4m3fn)
        assert_fp8_rows_close(half, s_ref * 2, q_ref, s_ref, "scale doubled")


@pytest.mark.gpu
@hopper_only
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], deadline=None)
@pytest.mark.parametrize("variant", VARIANTS)
@given(c=gluon_fp8_cases())
def test_gluon_fp8_matches_reference_and_tl(variant, c):
    check_gluon_fp8_gemm(dict(c, variant=variant), CUDA)  # every variant its own test, whichever the case drew


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("N,K,rows", [(7168, 2048, 128), (4096, 7168, 128), (7168, 2048, 1024)],
                         ids=["dsv3-gemm2", "gemm1-sized", "dsv3-gemm2-1024"])
def test_gluon_fp8_benchmark_shapes(variant, N, K, rows):
    """The benchmark's shapes (DeepSeek-V3 EP8 rank: 32 experts), routed counts around ``rows`` (one expert empty),
    with routing weights: against the fp32 reference (the tl GEMM is compared by the property test)."""
    gen = torch.Generator().manual_seed(3)
    counts = (torch.rand(32, generator=gen) * 2 * rows).long().tolist()
    counts[5] = 0
    c = dict(G=32, N=N, K=K, counts=counts, lead=0, pad=7, row_scale=True, scale=1.0, zero_frac=0.0, seed=1,
             variant=variant)
    check_gluon_fp8_gemm(c, CUDA, against_tl=False)


@pytest.mark.gpu
@hopper_only
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], deadline=None)
@pytest.mark.parametrize("variant", SWIGLU_VARIANTS)
@given(c=gluon_fp8_cases(swiglu=True))
def test_gluon_fp8_swiglu_matches_reference_and_tl(variant, c):
    check_gluon_fp8_swiglu_gemm(dict(c, variant=variant), CUDA)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("variant", SWIGLU_VARIANTS)
@pytest.mark.parametrize("I,K,counts", [
    (200, 272, [0, 130, 1, 0, 64]),  # I and K tails: a short second column tile, a short last K block
    (64, 16, [3, 0, 300]),  # one K block of 16, the second pass all past I
    (384, 1040, [129, 0, 0, 2]),
], ids=["tails", "narrow", "three-blocks"])
def test_gluon_fp8_swiglu_ragged_tails(variant, I, K, counts):
    """Fixed ragged GEMM1 cases, empty experts included, rows of no expert before and after: against the reference
    and the tl FP8 GEMM1."""
    c = dict(G=len(counts), N=I, K=K, counts=counts, lead=2, pad=3, row_scale=False, scale=1.0, zero_frac=0.3,
             seed=4, swiglu=True, variant=variant)
    check_gluon_fp8_swiglu_gemm(c, CUDA)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("variant", SWIGLU_VARIANTS)
@pytest.mark.parametrize("rows", [128, 1024], ids=["dsv3-gemm1", "dsv3-gemm1-1024"])
def test_gluon_fp8_swiglu_benchmark_shapes(variant, rows):
    """The benchmark's GEMM1 shape (DeepSeek-V3 EP8 rank: 32 experts, I 2048, K 7168), routed counts around
    ``rows`` (one expert empty): against the reference (the tl GEMM1 is compared by the tests above)."""
    gen = torch.Generator().manual_seed(5)
    counts = (torch.rand(32, generator=gen) * 2 * rows).long().tolist()
    counts[9] = 0
    c = dict(G=32, N=2048, K=7168, counts=counts, lead=0, pad=5, row_scale=False, scale=1.0, zero_frac=0.0, seed=2,
             swiglu=True, variant=variant)
    check_gluon_fp8_swiglu_gemm(c, CUDA, against_tl=False)


def _w(G, N, K, block_rows=128, gate_up=False):
    shape = (N, K) if G is None else (G, N, K)
    return Fp8Tensor(*quantize_fp8_ref(torch.ones(shape), block_rows, gate_up), block_rows, gate_up)


def _x(M, K):
    return Fp8Tensor(*quantize_fp8_ref(torch.ones(M, K), 1), 1)


def _bad_inputs():
    """(name, arguments for check_gluon_fp8 as a function of a valid set, what the message must name)."""
    return [
        ("K not a multiple of 16", lambda a: dict(a, w=_w(2, 64, 136), x=_x(3, 136)), "w.shape[2] (K)"),
        ("w bf16", lambda a: dict(a, w=torch.zeros(2, 64, 256)), "type(w)"),
        ("w 2-D", lambda a: dict(a, w=_w(None, 64, 256)), "w.shape"),
        ("w per-row scales", lambda a: dict(a, w=_w(2, 64, 256, block_rows=1)), "w.block_rows"),
        ("w gate_up", lambda a: dict(a, w=_w(2, 64, 256, gate_up=True)), "w.gate_up"),
        ("x bf16", lambda a: dict(a, x=torch.zeros(3, 256, dtype=torch.bfloat16)), "type(x)"),
        ("x block scales", lambda a: dict(a, x=Fp8Tensor(*quantize_fp8_ref(torch.ones(3, 256), 128), 128)),
         "x.block_rows"),
        ("x K mismatch", lambda a: dict(a, x=_x(3, 512)), "x.shape"),
        ("offsets int64", lambda a: dict(a, offsets=torch.zeros(3, dtype=torch.int64)), "offsets.dtype"),
        ("offsets length", lambda a: dict(a, offsets=torch.zeros(2, dtype=torch.int32)), "offsets.shape"),
        ("row_scale bf16", lambda a: dict(a, row_scale=torch.ones(3, dtype=torch.bfloat16)), "row_scale.dtype"),
        ("row_scale length", lambda a: dict(a, row_scale=torch.ones(4)), "row_scale.shape"),
        ("unknown variant", lambda a: dict(a, variant="fastest"), "variant"),
        ("no programs", lambda a: dict(a, num_programs=0), "num_programs"),
        ("x on the CPU", lambda a: dict(a), "x.device"),  # valid otherwise: only a CUDA device is refused for
    ]


def _bad_swiglu_inputs():
    """(name, arguments for check_gluon_fp8_swiglu as a function of a valid set, what the message must name)."""
    return [
        ("w bf16", lambda a: dict(a, w13=torch.zeros(2, 128, 256)), "type(w)"),
        ("w odd rows", lambda a: dict(a, w13=_w(2, 65, 256)), "w.shape[1] (2I)"),
        ("w plain scales, I % 128 != 0", lambda a: dict(a, w13=_w(2, 128, 256)), "w.scales.shape"),
        ("w per-row scales", lambda a: dict(a, w13=_w(2, 128, 256, block_rows=1, gate_up=True)), "w.block_rows"),
        ("K not a multiple of 16", lambda a: dict(a, w13=_w(2, 128, 136, gate_up=True), x=_x(3, 136)),
         "w.shape[2] (K)"),
        ("x K mismatch", lambda a: dict(a, x=_x(3, 512)), "x.shape"),
        ("offsets length", lambda a: dict(a, offsets=torch.zeros(4, dtype=torch.int32)), "offsets.shape"),
        ("GEMM2's variant", lambda a: dict(a, variant="coop_overlap"), "variant"),
        ("out bf16", lambda a: dict(a, out=torch.zeros(3, 64, dtype=torch.bfloat16)), "out"),
        ("out of 2I columns", lambda a: dict(a, out=_x(3, 128)), "out"),
        ("x on the CPU", lambda a: dict(a), "x.device"),  # valid otherwise: only a CUDA device is refused for
    ]


@pytest.mark.parametrize("name,make,what", _bad_swiglu_inputs(), ids=[b[0] for b in _bad_swiglu_inputs()])
def test_gluon_fp8_swiglu_bad_inputs_raise_named_errors(name, make, what):
    """GEMM1's launcher: each bad argument raises MoEEpInputError naming it (w13 [2, 128, 256]: I 64, so gate's and
    up's scale blocks apart, ``gate_up``)."""
    args = make(dict(x=_x(3, 256), w13=_w(2, 128, 256, gate_up=True), offsets=torch.zeros(3, dtype=torch.int32)))
    with pytest.raises(MoEEpInputError, match="^" + re.escape(what) + " = "):
        gluon_fp8.check_gluon_fp8_swiglu(**args)


@pytest.mark.parametrize("name,make,what", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_gluon_fp8_bad_inputs_raise_named_errors(name, make, what):
    """Each bad argument raises MoEEpInputError naming it (CPU tensors: every row but the last fails before the
    device check, which comes last)."""
    args = make(dict(x=_x(3, 256), w=_w(2, 64, 256), offsets=torch.zeros(3, dtype=torch.int32)))
    with pytest.raises(MoEEpInputError, match="^" + re.escape(what) + " = "):
        gluon_fp8.check_gluon_fp8(**args)


def test_gluon_fp8_without_hopper_raises_config_error(monkeypatch):
    """Valid arguments on a machine without an sm_90 GPU (or under the interpreter) raise MoEEpConfigError saying
    why, and ``available()`` says False there; on an H100 / H200 without the interpreter it says True."""
    if gluon_fp8.unavailable_reason() is None:
        assert gluon_fp8.available()
        return
    assert not gluon_fp8.available()
    monkeypatch.setattr(gluon_fp8, "check_gluon_fp8", lambda *a, **k: None)  # the CPU tensors pass as valid here
    with pytest.raises(MoEEpConfigError, match="needs an sm_90 GPU"):
        gluon_fp8.gluon_fp8_grouped_gemm(_x(3, 256), _w(2, 64, 256), torch.zeros(3, dtype=torch.int32))


def test_gluon_fp8_swiglu_without_hopper_raises_config_error(monkeypatch):
    """GEMM1's launcher, as GEMM2's: MoEEpConfigError saying why on a machine without an sm_90 GPU."""
    if gluon_fp8.unavailable_reason() is None:
        return
    monkeypatch.setattr(gluon_fp8, "check_gluon_fp8_swiglu", lambda *a, **k: None)
    with pytest.raises(MoEEpConfigError, match="needs an sm_90 GPU"):
        gluon_fp8.gluon_fp8_swiglu_grouped_gemm(_x(3, 256), _w(2, 128, 256, gate_up=True),
                                                torch.zeros(3, dtype=torch.int32))
