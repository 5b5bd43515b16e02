"""The Gluon FP8 block-scaled grouped GEMM (moe_ep/kernels/grouped_gemm/gluon_fp8.py) against the fp32 reference and
the tl FP8 grouped GEMM.

The GPU cases need sm_90 (wgmma, TMA) and run every variant (``gluon_fp8.VARIANTS``, and GEMM1's
``gluon_fp8.SWIGLU_VARIANTS``) as its own test, so that one failing variant does not hide the others. The reference
multiplies the dequantized operands (``dequantize_fp8_ref``) in fp32: the kernel computes that function up to the
summation order (the products of two e4m3 values are exact in fp32), the tensor core's FP8 accumulation within one
128-wide K block and the bf16 output: 1e-2 relative, the bound tests/test_fp8_gemm.py holds the tl FP8 GEMM to. Against
the tl FP8 GEMM on the same operands the bound is the sum of the two kernels' bounds, 2e-2 (each is within 1e-2 of the
same fp32 result). GEMM1 (SwiGLU, FP8 out) is held to ``swiglu_fp8_ref`` of the reference's fp32 SwiGLU values and to
the tl FP8 GEMM1's output, each by ``properties.assert_fp8_rows_close``: both sides quantize by one rule, so a code
differs (by one step where normal) only where the fp32 sums' order puts its value across a rounding boundary;
dequantized values within 2e-2 relative norm, scales within 1e-2 each past what the sums' error may move their block's
amax by, at least 75% of the codes identical (``properties.GLUON_FP8_*`` say why; the comparison itself is checked on
CPU: it passes sums a hair apart and fails a wrong rounding rule or scale). The bad-input tables and the no-GPU errors
run anywhere (the argument checks come before any launch; the device checks last).
"""

import re

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

from moe_ep import MoEEpConfigError, MoEEpInputError
from moe_ep import device_facts, options
from moe_ep.kernels import expert_mlp, plan_grouped_gemm
from moe_ep.kernels.fp8 import Fp8Tensor, quantize_fp8
from moe_ep.kernels.grouped_gemm import gluon_fp8
from moe_ep.kernels.grouped_gemm import plan as gemm_plan
from moe_ep.reference import quantize_fp8_ref, swiglu_fp8_ref
from moe_ep.testing.properties import (assert_fp8_rows_close, check_gluon_fp8_gemm, check_gluon_fp8_swiglu_gemm,
                                      fp8_gemm1_sums, gluon_fp8_problem, swiglu_amax_error)
from moe_ep.testing.strategies import gluon_fp8_cases
from moe_ep.triton_runtime import device as kernel_device

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is built for sm_90 (Hopper)")
VARIANTS = list(gluon_fp8.VARIANTS)
SWIGLU_VARIANTS = list(gluon_fp8.SWIGLU_VARIANTS)
CUDA = torch.device("cuda")
NEGATIVE_GATE_AMAX = dict(G=2, K=512, N=8, counts=[0, 1], lead=0, pad=0, row_scale=False, scale=300.0, zero_frac=0.0,
                          variant="single", swiglu=True, seed=0)
"""A GEMM1 case whose one row block's amax is the SwiGLU value of a gate sum of -8.4 over products of magnitude 4.3e3
in all: the H200's scale was 1.3e-2 off the reference's there (``properties.FP8_MMA_SUM_EPS``)."""


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


def _swiglu_with_sum_errors(c: dict, rel: float):
    """The reference's FP8 GEMM1 output of a case with every gate and up sum moved by ``rel`` of its products'
    magnitudes (away from zero: the sign the H200 showed), and the reference's own, quantized alike."""
    x8, w8, offsets, (lo, hi), _, h = gluon_fp8_problem(c, "cpu")
    sums, magnitudes = fp8_gemm1_sums(x8, w8, offsets, lo, hi)
    moved = sums + rel * sums.sign() * magnitudes
    gate, up = moved.chunk(2, dim=-1)
    return swiglu_fp8_ref(torch.nn.functional.silu(gate) * up), swiglu_fp8_ref(h), \
        swiglu_amax_error(x8, w8, offsets, lo, hi)


def test_scale_comparison_allows_a_negative_gates_sum_error_and_no_more():
    """GEMM1's scales on the case where the H200's differed by 1.3e-2 (``NEGATIVE_GATE_AMAX``): sums moved by 2^-18 of
    their products' magnitudes (what the H200 showed there) pass with the bound of ``swiglu_amax_error`` and fail
    without it; a scale twice too large still fails with it, and so do sums moved by 4 times ``FP8_MMA_SUM_EPS``."""
    from moe_ep.testing.properties import FP8_MMA_SUM_EPS
    (q, s), (q_ref, s_ref), amax_err = _swiglu_with_sum_errors(NEGATIVE_GATE_AMAX, 2.0 ** -18)
    assert ((s - s_ref).abs() / s_ref).max() > 5e-3  # the block is as ill-conditioned as on the H200
    assert_fp8_rows_close(q, s, q_ref, s_ref, "sums 2^-18 apart", amax_err)
    with pytest.raises(AssertionError, match="scale"):
        assert_fp8_rows_close(q, s, q_ref, s_ref, "sums 2^-18 apart, no bound")
    half = (q_ref.float() / 2).to(torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match="scale"):
        assert_fp8_rows_close(half, s_ref * 2, q_ref, s_ref, "scale doubled", amax_err)
    (q, s), _, _ = _swiglu_with_sum_errors(NEGATIVE_GATE_AMAX, 4 * FP8_MMA_SUM_EPS)
    with pytest.raises(AssertionError):  # (the values' norm already sees it)
        assert_fp8_rows_close(q, s, q_ref, s_ref, "sums 2^-12 apart", amax_err)


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
@pytest.mark.parametrize("N,K,counts", [
    (200, 272, [0, 193, 1, 0, 129, 64, 383]),  # N and K tails; experts a row past or short of a row tile's end
    (8, 16, [3, 0, 5]),  # every expert smaller than one row tile, one K block of 16
    (384, 1040, [192, 0, 0, 130]),  # whole row tiles (three of 64, one and a half of 128), then a short one
    (200, 1536, [0, 193, 1, 0, 129, 64, 383]),  # twelve K blocks
], ids=["tails", "small", "three-blocks", "twelve-blocks"])
def test_gluon_fp8_ragged_tails(variant, N, K, counts):
    """Fixed ragged GEMM2 cases, whatever the property test draws: for each variant's row tile (64 or 128 rows) an
    expert one row past a whole number of tiles (129, 193) and one row short of it (383), experts of one tile or less,
    all of x smaller than one tile (13 rows), empty experts, rows of no expert before and after, with routing weights:
    against the reference and the tl FP8 GEMM."""
    c = dict(G=len(counts), N=N, K=K, counts=counts, lead=2, pad=3, row_scale=True, scale=1.0, zero_frac=0.3, seed=6,
             variant=variant)
    check_gluon_fp8_gemm(c, CUDA)


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
@example(c=NEGATIVE_GATE_AMAX)
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


def _w(G, N, K, block_rows=128, gate_up=False, device="cpu"):
    shape = (N, K) if G is None else (G, N, K)
    return Fp8Tensor(*quantize_fp8_ref(torch.ones(shape, device=device), block_rows, gate_up), block_rows, gate_up)


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


class _KernelStandIn:
    """Takes ``_gluon_fp8_kernel``'s place: records each launch's keyword arguments and its ``o_desc`` argument."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.launches.append(dict(kw, o_desc=args[13]))
        return run


@pytest.fixture
def stand_in(monkeypatch):
    """A :class:`_KernelStandIn` in ``_gluon_fp8_kernel``'s place for the test."""
    kernel = _KernelStandIn()
    monkeypatch.setattr(gluon_fp8, "_gluon_fp8_kernel", kernel)
    return kernel


@pytest.mark.parametrize("n, offset, stored_by_tma", [(24, 0, True), (12, 0, False), (24, 1, False)],
                         ids=["aligned", "24-byte-rows", "base-off-16-bytes"])
def test_tma_store_variant_falls_back_to_the_register_store_where_tma_cannot_write(stand_in, n, offset, stored_by_tma):
    """A TMA_STORE variant's launch stores by TMA (a descriptor over out) only where out's base and rows are 16-byte
    aligned; elsewhere it launches the register store (TMA_STORE off, out itself as the unread descriptor argument),
    which writes the same values. Checked on CPU tensors with the kernel stood in for."""
    G, K, M = 2, 128, 4
    x, w = _x(M, K), _w(G, n, K)
    out = torch.empty(M * n + offset, dtype=torch.bfloat16)[offset:].view(M, n)
    assert gluon_fp8.tma_storable(out) == stored_by_tma
    offsets = torch.tensor([0, 2, M], dtype=torch.int32)
    gluon_fp8.launch(x.data, x.scales, w.data, w.scales, offsets, out, x.scales, None, "coop_tma_store", swiglu=False,
                     num_programs=1)
    (kw, ) = stand_in.launches
    assert kw["TMA_STORE"] == stored_by_tma
    assert (kw["o_desc"] is out) != stored_by_tma
    if stored_by_tma:
        assert kw["o_desc"].base is out and list(kw["o_desc"].block_shape) == [gluon_fp8.WG_ROWS, 128]


def test_gemm2_default_is_the_paired_tma_store_only_under_a_triton_it_was_verified_under():
    """GEMM2's default variant is ``coop`` with the TMA store and the paired K steps where that variant passed the GPU
    tests (``DEFAULT_CHECKED_TRITONS``), ``coop`` itself elsewhere."""
    from moe_ep.triton_runtime import triton_minor
    spec = gluon_fp8.VARIANTS[gluon_fp8.DEFAULT_VARIANT]
    checked = triton_minor() in gluon_fp8.DEFAULT_CHECKED_TRITONS
    assert spec.tma_store == spec.paired == checked
    assert spec._replace(tma_store=False, paired=False) == gluon_fp8.VARIANTS["coop"]


def test_gemm1_default_takes_turns_only_under_a_triton_it_was_verified_under():
    """GEMM1's default variant is ``coop`` with the warpgroups' MMAs issued in turn where that variant passed the GPU
    tests (``SWIGLU_DEFAULT_CHECKED_TRITONS``), ``coop`` itself elsewhere."""
    from moe_ep.triton_runtime import triton_minor
    spec = gluon_fp8.SWIGLU_VARIANTS[gluon_fp8.DEFAULT_SWIGLU_VARIANT]
    assert spec.ordered == (triton_minor() in gluon_fp8.SWIGLU_DEFAULT_CHECKED_TRITONS)
    assert spec._replace(ordered=False) == gluon_fp8.SWIGLU_VARIANTS["coop"]


# --- the grouped-GEMM dispatcher's "gluon-fp8" path ------------------------------------------------------------


def _mlp_operands(dev, G=3, H=256, I=128, counts=(140, 0, 131), seed=5):
    """An FP8 expert MLP's operands (x bf16 [S, H] with a padding row past the experts, w13 gate_up and w2 as
    Fp8Tensors with their dequantized references), int32 offsets and routing weights."""
    from moe_ep.testing.strategies import fp8_operand
    gen = torch.Generator().manual_seed(seed)
    S = sum(counts) + 1
    x = torch.randn(S, H, generator=gen).bfloat16().to(dev)
    (q13, r13), (q2, r2) = (fp8_operand((torch.randn(G, 2 * I, H, generator=gen) * 0.1).to(dev), 128, gate_up=True),
                            fp8_operand((torch.randn(G, H, I, generator=gen) * 0.1).to(dev), 128))
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    rs = (torch.rand(S, generator=gen) + 0.5).to(dev)
    return x, q13, r13, q2, r2, offsets, rs


def _plans(x, q13, q2, offsets, **kw):
    """(GEMM1's plan, GEMM2's plan) of an FP8 expert MLP's two calls, planned without launching."""
    x8 = quantize_fp8(x, 1)
    h = Fp8Tensor(torch.zeros(x.shape[0], q13.shape[1] // 2, dtype=torch.float8_e4m3fn, device=x.device),
                  torch.ones(x.shape[0], -(-q13.shape[1] // 256), device=x.device), 1)
    return (plan_grouped_gemm(x8, q13, offsets=offsets, swiglu=True, quantize_out=True, **kw),
            plan_grouped_gemm(h, q2, offsets=offsets, **kw))


@pytest.fixture
def gluon_dispatchable(monkeypatch):
    """The dispatcher sees the Gluon FP8 kernels as verified here (a CPU test of its decisions); plans made before
    and after are dropped."""
    monkeypatch.setattr(gluon_fp8, "dispatchable", lambda: True)
    gemm_plan.clear_cache()
    yield
    gemm_plan.clear_cache()


def test_dispatcher_takes_the_gluon_path_for_ragged_fp8_prefill(gluon_dispatchable):
    """Where ``gluon_fp8.dispatchable``: ragged FP8 calls from ``MOE_EP_GLUON_FP8_MIN_M`` tokens per expert on plan the
    "gluon-fp8" path in both forms (GEMM1 SwiGLU + FP8 out, GEMM2 bf16 out), with the default variant and one program
    per SM; everything else keeps the tl kernel: below the bucket, the option off, masked, GEMM1 with a bf16 output,
    an fp32 output, a forced config, bf16 operands, more experts than the kernel takes."""
    x, q13, _, q2, _, offsets, _ = _mlp_operands(kernel_device())  # (plans check that operands are where kernels run)
    with options.override(gluon_fp8_min_m=128):  # (whatever the default)
        _assert_dispatcher_decisions(x, q13, q2, offsets)


def _assert_dispatcher_decisions(x, q13, q2, offsets):
    """The test above's assertions, under MOE_EP_GLUON_FP8_MIN_M=128."""
    p1, p2 = _plans(x, q13, q2, offsets, m_hint=128)
    assert (p1.path, p2.path) == ("gluon-fp8", "gluon-fp8")
    assert p1.config == {"VARIANT": gluon_fp8.DEFAULT_SWIGLU_VARIANT, "BLOCK_M": 128, "BLOCK_N": 128}
    assert p2.config["VARIANT"] == gluon_fp8.DEFAULT_VARIANT and p2.config_source == "variant"
    assert (p1.out_format, p2.out_format, p1.grid, p1.tma, p1.persistent) == \
        ("fp8", "bf16", device_facts.sm_count(), True, True)
    assert {p.path for p in _plans(x, q13, q2, offsets, m_hint=64)} == {"tl"}  # below the bucket
    with options.override(gluon_fp8_min_m=64):
        assert {p.path for p in _plans(x, q13, q2, offsets, m_hint=64)} == {"gluon-fp8"}
    with options.override(gluon_fp8_min_m="off"):
        assert {p.path for p in _plans(x, q13, q2, offsets, m_hint=4096)} == {"tl"}
    x8 = quantize_fp8(x, 1)
    assert plan_grouped_gemm(x8, q13, offsets=offsets, swiglu=True, m_hint=512).path == "tl"  # bf16 SwiGLU out
    dev = x.device
    w2_form = _w(3, 64, 256, device=dev)  # GEMM2's form over x8 (K 256)
    assert plan_grouped_gemm(x8, w2_form, offsets=offsets, m_hint=512).path == "gluon-fp8"
    fp32 = plan_grouped_gemm(x8, w2_form, offsets=offsets, out=torch.empty(x.shape[0], 64, device=dev),
                             m_hint=512)
    assert (fp32.path, fp32.out_format) == ("tl", "fp32")
    forced = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, SWAP_AB=False, GROUP_M=8, TMA=False, num_warps=4,
                  num_stages=2)
    assert plan_grouped_gemm(x8, q13, offsets=offsets, swiglu=True, quantize_out=True, m_hint=512,
                             config=forced).path == "tl"
    masked = quantize_fp8(x[:270].reshape(3, 90, 256), 1)
    assert plan_grouped_gemm(masked, q13, counts=torch.tensor([5, 0, 7], device=dev), swiglu=True, quantize_out=True,
                             m_hint=512).path == "tl"
    assert plan_grouped_gemm(x, x.new_zeros(3, 64, 256), offsets=offsets, m_hint=512).path == "tl"  # bf16
    many = gluon_fp8.MAX_EXPERTS + 1
    wide = Fp8Tensor(torch.zeros(many, 128, 256, dtype=torch.float8_e4m3fn, device=dev),
                     torch.ones(many, 1, 2, device=dev), 128)
    assert plan_grouped_gemm(x8, wide, offsets=torch.zeros(many + 1, dtype=torch.int32, device=dev),
                             m_hint=512).path == "tl"


def test_dispatcher_keeps_the_tl_path_where_gluon_is_not_verified():
    """Without an sm_90 GPU, or under a Triton outside ``gluon_fp8.CHECKED_TRITONS``, nothing plans the Gluon path."""
    x, q13, _, q2, _, offsets, _ = _mlp_operands(kernel_device())
    gemm_plan.clear_cache()
    want = "gluon-fp8" if gluon_fp8.dispatchable() else "tl"
    with options.override(gluon_fp8_min_m=8):
        assert {p.path for p in _plans(x, q13, q2, offsets, m_hint=1024)} == {want}
    gemm_plan.clear_cache()
    if gluon_fp8.unavailable_reason() is not None:
        assert not gluon_fp8.dispatchable()


def test_dispatchable_needs_a_checked_triton(monkeypatch):
    """``dispatchable`` is ``available`` under a Triton of ``CHECKED_TRITONS`` only."""
    monkeypatch.setattr(gluon_fp8, "available", lambda: True)
    for version, want in (("3.6.0", True), ("3.6.1", True), ("3.8.0", False), ("3.10.1", False)):
        monkeypatch.setattr(gluon_fp8.triton, "__version__", version)
        assert gluon_fp8.dispatchable() is want, version
    monkeypatch.setattr(gluon_fp8.triton, "__version__", "3.9.0")
    assert gluon_fp8.dispatchable() is ("3.9" in gluon_fp8.CHECKED_TRITONS)
    monkeypatch.setattr(gluon_fp8, "available", lambda: False)
    monkeypatch.setattr(gluon_fp8.triton, "__version__", "3.6.0")
    assert not gluon_fp8.dispatchable()


def _reference_launch(calls):
    """A stand-in for ``gluon_fp8.launch`` that records its arguments and writes what the kernel computes, by the
    reference (on the CPU there is no sm_90 GPU): GEMM2's bf16 rows, or GEMM1's SwiGLU values quantized."""
    from moe_ep.reference import dequantize_fp8_ref, grouped_gemm_ref

    def launch(xq, xs, wq, ws, offsets, out, out_scales, row_scale, variant, *, swiglu, num_programs):
        calls.append(dict(offsets=offsets.clone(), variant=variant, swiglu=swiglu, num_programs=num_programs,
                          row_scale=row_scale, out=out, out_scales=out_scales))
        xr = dequantize_fp8_ref(xq, xs, 1)
        wr = dequantize_fp8_ref(wq, ws, 128, swiglu)
        y = grouped_gemm_ref(xr, wr, offsets=offsets, swiglu=swiglu, row_scale=row_scale)
        lo, hi = int(offsets[0]), int(offsets[-1])
        if swiglu:
            q, s = swiglu_fp8_ref(y[lo:hi])
            out[lo:hi], out_scales[lo:hi] = q, s
        else:
            out[lo:hi] = y[lo:hi].to(out.dtype)
    return launch


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_expert_mlp_launches_the_gluon_path_with_its_parts(gluon_dispatchable, monkeypatch, index_dtype):
    """The launcher's "gluon-fp8" branch, with a reference stand-in for the kernel: GEMM1 gets x's codes and scales,
    w13 and the SwiGLU variant and writes FP8 codes + scales, GEMM2 gets exactly those, w2, the routing weights and
    a bf16 output; int64 offsets reach the kernel as int32 clamped to [0, S] first (a value past 2^32 does not wrap
    onto a small one); the result is the FP8 reference's, and the rows of no expert are left as they were."""
    from moe_ep.reference import dequantize_fp8_ref, expert_mlp_fp8_ref, quantize_fp8_ref
    from moe_ep.testing.properties import MLP_TOL, assert_rel_close
    dev = kernel_device()  # (the stand-in computes with torch wherever x is)
    calls = []
    monkeypatch.setattr(gluon_fp8, "launch", _reference_launch(calls))
    x, q13, r13, q2, r2, offsets, rs = _mlp_operands(dev)
    S = x.shape[0]
    offs = offsets.to(index_dtype)
    if index_dtype is torch.int64:  # the last expert's end past 2^32: clamped to S (its truncation would be 1)
        offs[-1] = 2**32 + 1
    out = torch.full((S, x.shape[1]), float("nan"), dtype=torch.bfloat16, device=dev)
    with options.override(gluon_fp8_min_m=128):
        got, (p1, p2) = expert_mlp(x, q13, q2, offsets=offs, row_scale=rs, out=out, m_hint=256, return_plan=True)
    assert got is out and (p1.path, p2.path) == ("gluon-fp8", "gluon-fp8")
    assert [(c["variant"], c["swiglu"], c["num_programs"]) for c in calls] == \
        [(gluon_fp8.DEFAULT_SWIGLU_VARIANT, True, p1.grid), (gluon_fp8.DEFAULT_VARIANT, False, p2.grid)]
    want_offsets = offsets.clone()
    if index_dtype is torch.int64:
        want_offsets[-1] = S
    for c in calls:
        assert c["offsets"].dtype is torch.int32 and torch.equal(c["offsets"], want_offsets)
    assert calls[0]["out"].dtype is torch.float8_e4m3fn and calls[0]["row_scale"] is None
    assert calls[1]["out"] is out and torch.equal(calls[1]["row_scale"], rs)
    end = int(want_offsets[-1])
    xr = dequantize_fp8_ref(*quantize_fp8_ref(x, 1), 1)
    ref = expert_mlp_fp8_ref(xr, r13, r2, offsets=want_offsets, row_scale=rs)
    assert_rel_close(out[:end], ref[:end], slice(None), MLP_TOL, "expert_mlp on the gluon-fp8 path")
    assert torch.isnan(out[end:].float()).all(), "a row of no expert was written"


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_expert_mlp_runs_the_gluon_path_on_hopper(index_dtype, monkeypatch):
    """On the H200: an FP8 expert MLP at a prefill bucket plans and runs the Gluon kernels (both GEMMs), matches the FP8
    reference and the tl path's result on the same operands (``MOE_EP_GLUON_FP8_MIN_M=off``), leaves the rows of no
    expert as they were, and replays bit for bit in a CUDA graph. Under a Triton not in ``CHECKED_TRITONS`` as well:
    this is the test that checks one before it goes on that list."""
    monkeypatch.setattr(gluon_fp8, "dispatchable", gluon_fp8.available)
    from moe_ep.reference import dequantize_fp8_ref, expert_mlp_fp8_ref, quantize_fp8_ref
    from moe_ep.testing.properties import GLUON_FP8_TL_TOL, MLP_TOL, assert_rel_close
    x, q13, r13, q2, r2, offsets, rs = _mlp_operands(CUDA, G=4, H=512, I=384, counts=(300, 0, 129, 77))
    offs = offsets.to(index_dtype)
    S, end = x.shape[0], int(offsets[-1])
    gemm_plan.clear_cache()
    out = torch.full((S, 512), float("nan"), dtype=torch.bfloat16, device=CUDA)
    with options.override(gluon_fp8_min_m=128):  # (whatever the default)
        got, (p1, p2) = expert_mlp(x, q13, q2, offsets=offs, row_scale=rs, out=out, m_hint=128, return_plan=True)
    assert (p1.path, p2.path) == ("gluon-fp8", "gluon-fp8"), (p1, p2)
    xr = dequantize_fp8_ref(*quantize_fp8_ref(x, 1), 1)
    ref = expert_mlp_fp8_ref(xr, r13, r2, offsets=offsets, row_scale=rs)
    assert_rel_close(out[:end], ref[:end], slice(None), MLP_TOL, "gluon-fp8 expert_mlp against the reference")
    assert torch.isnan(out[end:].float()).all(), "a row of no expert was written"
    with options.override(gluon_fp8_min_m="off", autotune="off"):
        tl, (t1, t2) = expert_mlp(x, q13, q2, offsets=offs, row_scale=rs, m_hint=128, return_plan=True)
    assert (t1.path, t2.path) == ("tl", "tl")
    assert_rel_close(out[:end], tl[:end], slice(None), GLUON_FP8_TL_TOL, "gluon-fp8 expert_mlp against the tl path")
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with options.override(gluon_fp8_min_m=128), torch.cuda.graph(graph):
        expert_mlp(x, q13, q2, offsets=offs, row_scale=rs, out=out, m_hint=128)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:end], eager[:end]) and torch.isnan(out[end:].float()).all()
    gemm_plan.clear_cache()
