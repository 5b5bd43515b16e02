"""The shared property checks (moe_ep.testing.properties) can fail: each passes on the real kernel and fails on
the same kernel with a planted fault (one code, one value, one count or one padding row off)."""

import pytest
import torch

import moe_ep.layer
from moe_ep import kernels
from moe_ep.kernels import bridge, nvfp4
from moe_ep.kernels.grouped_gemm import gluon_fp8, gluon_nvfp4, gluon_nvfp4_prefill
from moe_ep.testing import properties as P
from moe_ep.transports import torch_dist

QUANT = dict(rows=3, k=32, kind="normal", dtype="bfloat16", given_scale=False, gather=4, seed=1)
GEMM = dict(G=2, K=32, N=16, counts=[3, 2], ragged=True, x_fmt="bf16", w_fmt="bf16", swiglu=False, row_scale=False,
            pad=2, m_hint=None, scale=1.0, zero_frac=0.0, seed=3)
ROUTE = dict(L=3, K=2, M=5, kind="random", group=None, H=16, weighted=True, dtype="int64", seed=4)
FP8_GEMM = dict(GEMM, K=144, N=16, x_fmt="fp8", w_fmt="fp8", config=None)
LAYER = dict(E=2, K=1, H=32, I=16, B=3, layout=("ht", "flat"), wf="bf16", af="bf16", routing="random", seed=5)


def _flip_a_code(f):
    def wrong(*a, **k):
        q = f(*a, **k)
        q.data[..., 0] ^= 1
        return q
    return wrong


def _bump_a_value(f):
    def wrong(*a, **k):
        out = f(*a, **k)
        out.view(-1)[0] += 1.0
        return out
    return wrong


def _write_a_padding_row(f):
    def wrong(*a, **k):
        out = f(*a, **k)
        out.view(-1, out.shape[-1])[-1] = 0  # (the last row: masked, of the last expert's block)
        return out
    return wrong


def _miscount(f):
    def wrong(*a, **k):
        r = f(*a, **k)
        r.counts[0] += 1
        return r
    return wrong


def _flip_an_fp8_code(f):
    def wrong(*a, **k):
        q = f(*a, **k)
        q.data.view(torch.uint8)[..., 0] ^= 1
        return q
    return wrong


def _one_scale_for_the_batch(f):
    return lambda x, *a: nvfp4.nvfp4_global_scale(x).expand(x.shape[:-1]).contiguous()


def _quantize_with_one_batch_scale(f):
    return lambda x, *a: nvfp4.quantize_nvfp4(x, nvfp4.nvfp4_global_scale(x).expand(x.shape[:-1]).contiguous(),
                                              check_finite=False)


def _scale_the_forward(f):
    return lambda self, *a, **k: f(self, *a, **k) * 1.5


FAULTS = [  # (check, case, where the kernel lives, its name there, the fault, what the failure says)
    (P.check_quantize, QUANT, nvfp4, "quantize_nvfp4", _flip_a_code, "E2M1 codes"),
    (P.check_gather_quantize, QUANT, nvfp4, "gather_quantize_nvfp4", _flip_a_code, "E2M1 codes"),
    (P.check_dequantize, QUANT, nvfp4, "dequantize_nvfp4", _bump_a_value, "dequantized values"),
    (P.check_grouped_gemm, GEMM, kernels, "grouped_gemm", _bump_a_value, "relative error"),
    (P.check_grouped_gemm, GEMM, kernels, "grouped_gemm", _write_a_padding_row, "outside the experts' counts"),
    (P.check_expert_mlp, dict(GEMM, swiglu=True), kernels, "expert_mlp", _bump_a_value, "relative error"),
    (P.check_fp8_grouped_gemm, FP8_GEMM, kernels, "grouped_gemm", _bump_a_value, "relative error"),
    (P.check_fp8_grouped_gemm, FP8_GEMM, kernels, "grouped_gemm", _write_a_padding_row, "outside the experts' counts"),
    (P.check_fp8_expert_mlp, dict(FP8_GEMM, swiglu=True, N=144, scale=1e-3), kernels, "expert_mlp", _bump_a_value,
     "relative error"),
    (P.check_route, ROUTE, bridge, "route_experts", _miscount, "route counts differs"),
    (P.check_permute, ROUTE, bridge, "permute_rows", _bump_a_value, "permuted rows"),
    (P.check_unpermute_reduce, ROUTE, bridge, "unpermute_reduce", _bump_a_value, "relative error"),
    (P.check_layer, LAYER, moe_ep.layer.MoEEpLayer, "forward", _scale_the_forward, "relative error"),
    (P.check_quantize_tokens, QUANT, nvfp4, "nvfp4_row_global_scale", _one_scale_for_the_batch, "global scales"),
    (P.check_layer_batch_invariance, LAYER, torch_dist, "quantize_nvfp4_tokens", _quantize_with_one_batch_scale,
     "batch variance"),
    (P.check_dispatch_fp8, LAYER, torch_dist, "quantize_fp8", _flip_an_fp8_code, "FP8 payload codes"),
]


@pytest.mark.parametrize("check, case, where, name, fault, says", FAULTS,
                         ids=[f"{c.__name__}-{f.__name__.strip('_')}" for c, _, _, _, f, _ in FAULTS])
def test_check_passes_on_the_kernel_and_fails_on_a_planted_fault(dev, monkeypatch, check, case, where, name, fault,
                                                                  says):
    check(case, dev)
    monkeypatch.setattr(where, name, fault(getattr(where, name)))
    with pytest.raises(AssertionError, match=says):
        check(case, dev)


GLUON = dict(G=2, K=256, N=100, counts=[5, 3], pad=2, out_dtype="float32", hint=None, one_gs=False, scale=1.0,
             zero_frac=0.0, fast_decode=True, launch=0, seed=6)
GLUON_FP8 = dict(G=2, K=272, N=64, counts=[5, 3], lead=0, pad=2, row_scale=True, scale=1.0, zero_frac=0.0,
                 variant="coop", seed=7)
GLUON_FP8_SWIGLU = dict(GLUON_FP8, N=200, row_scale=False, swiglu=True)  # two column tiles, the last one short
# (small values: a planted +1 in one element of its 143 x 200 output is then far past the check's relative bound)
GLUON_PREFILL = dict(G=2, K=192, N=200, swiglu=False, counts=[140, 3], pad=2, one_gs=False, scale=1e-3, zero_frac=0.0,
                     rs=True, block_t=None, seed=8)


def _double_a_scale(f):
    def wrong(*a, **k):
        q = f(*a, **k)
        q.scales.view(-1)[0] *= 2
        return q
    return wrong


def _zero_a_padding_row_of_codes(f):
    def wrong(*a, **k):
        q = f(*a, **k)
        q.data.view(torch.uint8)[-1] = 0
        return q
    return wrong


GPU_FAULTS = [  # the same, for kernels that run only on a GPU of one kind (the Gluon ones: sm_90)
    (P.check_gluon_nvfp4_gemm, GLUON, gluon_nvfp4, "gluon_nvfp4_grouped_gemm", _bump_a_value, "relative error"),
    (P.check_gluon_nvfp4_gemm, dict(GLUON, out_dtype="bfloat16", launch=6), gluon_nvfp4, "gluon_nvfp4_grouped_gemm",
     _write_a_padding_row, "outside the experts' counts"),
    (P.check_gluon_nvfp4_prefill_gemm, GLUON_PREFILL, gluon_nvfp4_prefill, "gluon_nvfp4_prefill_grouped_gemm",
     _bump_a_value, "relative error"),
    (P.check_gluon_nvfp4_prefill_gemm, dict(GLUON_PREFILL, swiglu=True, rs=False, N=64, block_t=256),
     gluon_nvfp4_prefill, "gluon_nvfp4_prefill_swiglu_grouped_gemm", _write_a_padding_row,
     "outside the experts' counts"),
    (P.check_gluon_nvfp4_prefill_gemm, dict(GLUON_PREFILL, masked=True), gluon_nvfp4_prefill,
     "gluon_nvfp4_prefill_grouped_gemm", _write_a_padding_row, "outside the experts' counts"),
    (P.check_gluon_fp8_gemm, GLUON_FP8, gluon_fp8, "gluon_fp8_grouped_gemm", _bump_a_value, "rel err"),
    (P.check_gluon_fp8_gemm, dict(GLUON_FP8, variant="coop_overlap"), gluon_fp8, "gluon_fp8_grouped_gemm",
     _write_a_padding_row, "rows of no expert written"),
    (P.check_gluon_fp8_swiglu_gemm, GLUON_FP8_SWIGLU, gluon_fp8, "gluon_fp8_swiglu_grouped_gemm", _double_a_scale,
     "rel err"),
    (P.check_gluon_fp8_swiglu_gemm, dict(GLUON_FP8_SWIGLU, variant="single"), gluon_fp8,
     "gluon_fp8_swiglu_grouped_gemm", _zero_a_padding_row_of_codes, "rows of no expert written"),
]


@pytest.mark.gpu
@pytest.mark.skipif(bool(P.gluon_nvfp4_unavailable()), reason=str(P.gluon_nvfp4_unavailable()))
@pytest.mark.parametrize("check, case, where, name, fault, says", GPU_FAULTS,
                         ids=[f"{c.__name__}-{f.__name__.strip('_')}" for c, _, _, _, f, _ in GPU_FAULTS])
def test_gpu_check_passes_on_the_kernel_and_fails_on_a_planted_fault(dev, monkeypatch, check, case, where, name,
                                                                      fault, says):
    check(case, dev)
    monkeypatch.setattr(where, name, fault(getattr(where, name)))
    with pytest.raises(AssertionError, match=says):
        check(case, dev)


def test_every_property_has_a_planted_fault():
    assert {c for c, *_ in FAULTS + GPU_FAULTS} == {p.check for p in P.PROPERTIES.values()}
