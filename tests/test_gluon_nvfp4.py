"""The Gluon NVFP4-weight grouped GEMM (moe_ep/kernels/grouped_gemm/gluon_nvfp4.py) against the fp32 reference.

The GPU cases need sm_90 (the kernel is built for Hopper: wgmma, TMA); the bad-input table runs anywhere (the checks
come before any launch). The reference multiplies the dequantized weights (``dequantize_nvfp4_ref``) in fp32:
the kernel computes that function up to fp32 summation order and the global scale applied to the sum (1e-4
relative, fp32 output) plus the output rounding (bf16 output: 1e-2, as for the tl kernel's GEMM).
"""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_ep import MoEEpInputError
from moe_ep.kernels import nvfp4_global_scale, quantize_nvfp4
from moe_ep.kernels.grouped_gemm import gluon_nvfp4
from moe_ep.reference import dequantize_nvfp4_ref, grouped_gemm_ref
from moe_ep.testing.strategies import cpu_nvfp4_weights, expert_counts, scaled_values

FP32_TOL = 1e-4
BF16_TOL = 1e-2

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is built for sm_90 (Hopper)")


@st.composite
def gluon_cases(draw):
    """Ragged problems of the decode class and around it: 1-8 experts, K a multiple of 256, N not always a multiple
    of the 64-row tile, up to 80 tokens per expert (past the largest token tile: several chunks), empty experts,
    rows of no expert at the end, fp32 / bf16 output, a token-tile hint that fits or not."""
    G = draw(st.integers(1, 8))
    return dict(G=G, K=256 * draw(st.integers(1, 4)), N=draw(st.sampled_from([8, 64, 100, 192, 320])),
                counts=draw(expert_counts(G, draw(st.sampled_from([1, 8, 16, 64, 80])))), pad=draw(st.integers(0, 3)),
                out_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                hint=draw(st.sampled_from([None, 1, 16, 64])), one_gs=draw(st.booleans()),
                scale=draw(st.sampled_from([1.0, 1e-3, 300.0])), zero_frac=draw(st.sampled_from([0.0, 0.3])),
                seed=draw(st.integers(0, 2**31 - 1)))


def _operands(c, dev):
    gen = torch.Generator().manual_seed(c["seed"])
    G, N, K = c["G"], c["N"], c["K"]
    offs = [0]
    for n in c["counts"]:
        offs.append(offs[-1] + n)
    S = offs[-1] + c["pad"]
    x = scaled_values((S, K), c["scale"], c["zero_frac"], gen).to(dev)
    w = scaled_values((G, N, K), 0.5, c["zero_frac"], gen).to(dev)
    w = quantize_nvfp4(w, None if c["one_gs"] else nvfp4_global_scale(w, per_slice=True))
    return x, w, torch.tensor(offs, dtype=torch.int32, device=dev), offs[-1]


def _problem(c, dev=torch.device("cuda")):
    """The operands and the fp32 reference of case c (made once: at the benchmark's sizes they dominate a check)."""
    x, w, offsets, covered = _operands(c, dev)
    ref = grouped_gemm_ref(x.float(), dequantize_nvfp4_ref(w.data, w.scales, w.global_scale), offsets=offsets)
    return x, w, offsets, covered, ref[:covered]


def _check(c, fast_decode, problem=None, **launch):
    x, w, offsets, covered, r = _problem(c) if problem is None else problem
    out = torch.full((x.shape[0], c["N"]), float("nan"), dtype=c["out_dtype"], device=x.device)  # poisoned
    got = gluon_nvfp4.gluon_nvfp4_grouped_gemm(x, w, offsets, out_dtype=c["out_dtype"], tokens_per_expert=c["hint"],
                                               out=out, fast_decode=fast_decode, **launch)
    assert got is out
    o = out[:covered].float()
    assert torch.isfinite(o).all()
    tol = FP32_TOL if c["out_dtype"] == torch.float32 else BF16_TOL
    err = (o - r).norm().item()
    assert err <= tol * r.norm().item() + 1e-30, f"rel err {err / max(r.norm().item(), 1e-30):.3e} > {tol}"
    assert torch.isnan(out[covered:].float()).all(), "rows of no expert were written"


@pytest.mark.gpu
@hopper_only
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@pytest.mark.parametrize("fast_decode,overlap", [(True, False), (False, False), (True, True)],
                         ids=["ptx-decode", "plain-decode", "ptx-decode-overlap"])
@given(c=gluon_cases())
def test_gluon_nvfp4_matches_reference(fast_decode, overlap, c):
    _check(c, fast_decode, overlap=overlap)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("G,N,K,rows", [(32, 4096, 7168, 16), (32, 7168, 2048, 16), (128, 1536, 2048, 8),
                                        (128, 2048, 768, 8)], ids=["dsv3-gemm1", "dsv3-gemm2", "qwen3-gemm1",
                                                                   "qwen3-gemm2"])
def test_gluon_nvfp4_benchmark_shapes(G, N, K, rows):
    """The benchmark's shapes (DeepSeek-V3 EP8 rank, Qwen3-30B-A3B), balanced counts, bf16 output: both decodes,
    and the ring depths and register budgets the benchmark sweeps."""
    c = dict(G=G, N=N, K=K, counts=[rows] * G, pad=0, out_dtype=torch.bfloat16, hint=None, one_gs=False, scale=1.0,
             zero_frac=0.0, seed=1)
    problem = _problem(c)
    _check(c, False, problem)
    for stages, maxnreg, overlap in gluon_nvfp4.LAUNCH_SWEEP:
        _check(c, True, problem, stages=stages, maxnreg=maxnreg, overlap=overlap)


def _bad_inputs():
    """(name, arguments for check_gluon_nvfp4 as a function of a valid set, what the message must name)."""
    return [
        ("K not a multiple of 256",
         lambda a: dict(a, w=cpu_nvfp4_weights(2, 64, 128), x=torch.zeros(3, 128, dtype=torch.bfloat16)),
         "w.shape[2] (K)"),
        ("w bf16", lambda a: dict(a, w=torch.zeros(2, 64, 256)), "type(w)"),
        ("w 2-D", lambda a: dict(a, w=cpu_nvfp4_weights(None, 64, 256)), "w.shape"),
        ("w swizzled", lambda a: dict(a, w=cpu_nvfp4_weights(2, 64, 256, swizzled=True)), "w.swizzled"),
        ("x fp32", lambda a: dict(a, x=torch.zeros(3, 256)), "x.dtype"),
        ("x K mismatch", lambda a: dict(a, x=torch.zeros(3, 512, dtype=torch.bfloat16)), "x.shape"),
        ("offsets int64", lambda a: dict(a, offsets=torch.zeros(3, dtype=torch.int64)), "offsets.dtype"),
        ("offsets length", lambda a: dict(a, offsets=torch.zeros(2, dtype=torch.int32)), "offsets.shape"),
        ("out fp16", lambda a: dict(a, out_dtype=torch.float16), "out_dtype"),
        ("no stages", lambda a: dict(a, stages=0), "stages"),
        ("too few registers", lambda a: dict(a, maxnreg=16), "maxnreg"),
        ("overlap on one stage", lambda a: dict(a, stages=1, overlap=True), "stages"),
        ("overlap not a bool", lambda a: dict(a, overlap="yes"), "overlap"),
        ("no tokens per expert", lambda a: dict(a, tokens_per_expert=0), "tokens_per_expert"),
        ("fast_decode not a bool", lambda a: dict(a, fast_decode="yes"), "fast_decode"),
        ("x on the CPU", lambda a: dict(a), "x.device"),  # valid otherwise: only a CUDA device is refused for
    ]


@pytest.mark.parametrize("name,make,what", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_gluon_nvfp4_bad_inputs_raise_named_errors(name, make, what):
    """Each bad argument raises MoEEpInputError naming it (the checks come before the device is touched, so this
    runs on a CPU: the CPU tensors fail only the device check, which comes last)."""
    args = make(dict(x=torch.zeros(3, 256, dtype=torch.bfloat16), w=cpu_nvfp4_weights(2, 64, 256),
                     offsets=torch.zeros(3, dtype=torch.int32), out_dtype=torch.bfloat16))
    with pytest.raises(MoEEpInputError, match="^" + re.escape(what) + " = "):
        gluon_nvfp4.check_gluon_nvfp4(**args)
