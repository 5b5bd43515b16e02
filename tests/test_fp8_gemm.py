"""FP8 (block-scaled e4m3, DeepSeek-V3's format) grouped GEMMs, the FP8-output SwiGLU epilogue, the FP8 expert MLP,
FP8 expert weights (quantized here or as a checkpoint ships them) and fused_moe / the layer with FP8 weights.

The GEMMs are compared with the fp32 reference on the dequantized operands (``moe_ep.reference``): the kernel computes
exactly that function up to fp32 summation order (the products of two e4m3 values are exact in fp32; the per-block
scales are applied to fp32 partial sums) and the bf16 output, so the bound is one GEMM's 1e-2. The fused FP8 epilogue
is checked bit for bit: against ``swiglu_fp8_ref`` of the fp32 SwiGLU values the same tiles give when stored as fp32.
Against the unquantized (dense bf16) operands the bound is FP8's rounding instead: e4m3 keeps 3 mantissa bits (2^-4
relative per element at worst, about 2^-5.5 RMS), and x, the weights and the intermediate are each rounded once.
"""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from moe_ep import EpConfig, ExpertWeights, Format, MoEEpConfigError, MoEEpInputError, MoEEpLayer, fused_moe, options
from moe_ep.kernels import expert_mlp, grouped_gemm, plan_grouped_gemm, quantize_nvfp4
from moe_ep.kernels.bridge import permute_rows, route_experts
from moe_ep.kernels.fp8 import Fp8Tensor, dequantize_fp8, quantize_fp8
from moe_ep.kernels.grouped_gemm import config_space
from moe_ep.kernels.grouped_gemm import plan as gemm_plan
from moe_ep.reference import (dequantize_fp8_ref, expert_mlp_fp8_ref, grouped_gemm_ref, moe_reference, quantize_fp8_ref,
                              swiglu_fp8_ref)
from moe_ep.testing import properties as P
from moe_ep.testing.properties import FP8_DENSE_TOL, assert_bits_equal, assert_rel_close
from moe_ep.testing.strategies import Bounds, fp8_gemm_cases, fp8_operand
from moe_ep.triton_runtime import device as kernel_device

FP8_BOUNDS = Bounds(rows=9, k16=10, n16=10, experts=4, top_k=1)  # K, N up to 160: short last scale blocks
MLP_BOUNDS = Bounds(rows=6, k16=10, n16=9, experts=3, top_k=1)
_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.data_too_large])


@pytest.fixture(autouse=True)
def _fresh_plans():
    gemm_plan.clear_cache()
    with options.override(autotune="off", decoded_min_m=config_space.DECODED_MIN_M):  # first configs, untimed
        yield


def _values(shape, scale, gen, dev):
    return (torch.randn(shape, generator=gen) * scale).bfloat16().to(dev)


def _poison_fp8(monkeypatch):
    """torch.empty of e4m3 / fp32 / bf16 tensors filled with NaN (e4m3 0x7F): the rows a kernel leaves untouched
    stay NaN."""
    empty = torch.empty
    kinds = (torch.float8_e4m3fn, torch.float32, torch.bfloat16)

    def poisoned(*a, **k):
        t = empty(*a, **k)
        if k.get("dtype") == torch.float8_e4m3fn:
            return t.view(torch.uint8).fill_(0x7F).view(torch.float8_e4m3fn)
        return t.fill_(float("nan")) if k.get("dtype") in kinds else t
    monkeypatch.setattr(torch, "empty", poisoned)
    return empty


@_ok
@given(fp8_gemm_cases(FP8_BOUNDS))
def test_fp8_grouped_gemm_matches_reference(dev, c):
    """FP8 x FP8, masked and ragged, SwiGLU or a row scale, empty experts, K and N not multiples of 128 (nor of the
    tiles), the configs an FP8 call may take; rows outside the experts' counts never written (poisoned output)."""
    P.check_fp8_grouped_gemm(c, dev)


@pytest.mark.parametrize("layout", ["masked", "ragged"])
@pytest.mark.parametrize("cfg", [dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, SWAP_AB=True),
                                 dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=32, SWAP_AB=False),
                                 dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=128, SWAP_AB=False),
                                 dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, SWAP_AB=False, TMA=True),
                                 dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SWAP_AB=False, TMA=True)],
                         ids=["swapped", "k32", "two-blocks", "tma", "tma-halves"])
def test_fused_fp8_epilogue_is_quantize_fp8_of_the_fp32_swiglu(dev, monkeypatch, layout, cfg):
    """GEMM1 with the FP8 output: codes and scales are bit for bit ``swiglu_fp8_ref`` (quantize_fp8's rule) of the
    fp32 SwiGLU values the same tiles store as fp32, I past a 128-block (a short last block), rows past the counts
    (masked) or of no expert (ragged) untouched, an all-zero row (scale 1, codes 0). TMA tiles: ragged only (the
    masked layout runs the same tiles by pointers); 128-row ones compute their columns in two halves."""
    cfg = dict(dict(GROUP_M=1, TMA=False, num_warps=4, num_stages=1), **cfg)
    gen = torch.Generator().manual_seed(11)
    G, M, H, I = 3, 7, 160, 144
    counts = torch.tensor([5, 0, 7], device=dev)
    x3 = _values((G, M, H), 1.0, gen, dev)
    x3[0, 2] = 0  # an all-zero token: its SwiGLU row is 0
    xq, _ = fp8_operand(x3 if layout == "masked" else x3.reshape(-1, H)[:14], 1)
    wq, _ = fp8_operand(_values((G, 2 * I, H), 0.3, gen, dev), 128, gate_up=True)
    if layout == "masked":
        idx, rows = dict(counts=counts), (G, M)
        valid = torch.arange(M, device=dev)[None, :] < counts[:, None]
    else:
        idx, rows = dict(offsets=torch.tensor([0, 5, 5, 12], device=dev)), (14,)
        valid = torch.arange(14, device=dev) < 12  # rows 12, 13: no expert's
    idx["m_hint"] = 64 if cfg["TMA"] else None  # TMA tiles at prefill buckets only
    h32 = torch.full((*rows, I), float("nan"), device=dev)
    grouped_gemm(xq, wq, **idx, swiglu=True, out=h32, config=cfg)
    empty = _poison_fp8(monkeypatch)
    q, plan = grouped_gemm(xq, wq, **idx, swiglu=True, quantize_out=True, config=cfg, return_plan=True)
    monkeypatch.setattr(torch, "empty", empty)
    assert isinstance(q, Fp8Tensor) and q.block_rows == 1 and plan.out_format == "fp8"
    assert plan.tma is (cfg["TMA"] and layout == "ragged")
    assert q.shape == (*rows, I) and q.scales.shape == (*rows, 2)
    rq, rs = swiglu_fp8_ref(h32[valid])
    assert_bits_equal(q.scales[valid], rs, "FP8 epilogue scales")
    assert_bits_equal(q.data[valid].view(torch.uint8), rq.view(torch.uint8), "FP8 epilogue codes")
    assert bool((q.data[~valid].view(torch.uint8) == 0x7F).all()) and bool(q.scales[~valid].isnan().all())
    zero = (0, 2) if layout == "masked" else (2,)
    assert bool((q.scales[zero] == 1).all()) and not bool(q.data[zero].float().any())
    del idx["m_hint"]
    ref = grouped_gemm_ref(dequantize_fp8_ref(xq.data, xq.scales, 1), dequantize_fp8(wq, torch.float32), **idx,
                           swiglu=True)
    assert_rel_close(dequantize_fp8(q, torch.float32), ref, valid, 0.06, "FP8 epilogue values")  # e4m3 rounding


@pytest.mark.parametrize("layout", ["masked", "ragged", "ragged-tma"])
@pytest.mark.parametrize("bm, bn", [(16, 64), (16, 256), (128, 128)],
                         ids=["tile-in-one-block", "tile-over-two-blocks", "128-rows"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["gemm2", "swiglu"])
def test_fp8_gemm_takes_each_columns_weight_block_scale(dev, layout, bm, bn, swiglu):
    """Every output column is scaled by its own 128-row weight blocks' scales (with SwiGLU its gate block's and its
    up block's), whether its column tile lies in one block (one scale per K step, two with SwiGLU, also for tiles
    past the first block) or spans two; N = 272 (a short last block), K = 160 (a short last K block, K steps of 64:
    masked e4m3 loads; TMA: zeros past K), a row scale without SwiGLU; pointer loads and TMA tiles (ragged; 128-row
    SwiGLU ones in two halves of 64 columns).
    Neighbouring blocks' magnitudes are 2^4 apart (gate's and up's too), so a scale of the wrong block is far off."""
    tma = layout == "ragged-tma"
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, SWAP_AB=False, GROUP_M=1, TMA=tma, num_warps=4, num_stages=1)
    gen = torch.Generator().manual_seed(5)
    G, M, K, N = 2, 5, 160, 272
    counts = torch.tensor([5, 3], device=dev)
    x3 = _values((G, M, K), 1.0, gen, dev)
    mag = torch.tensor([1.0, 16.0, 1 / 16])[torch.arange(N) // 128]  # per weight row block
    if swiglu:
        mag = torch.cat([mag, mag.roll(128)])  # up's blocks: gate's magnitudes shifted by one block
    w = _values((G, mag.numel(), K), 0.05, gen, dev).float() * mag[None, :, None].to(dev)  # SiLU's exp stays finite
    wq, wr = fp8_operand(w.bfloat16(), 128, gate_up=swiglu)
    if layout == "masked":
        xq, xr = fp8_operand(x3, 1)
        idx, valid = dict(counts=counts), torch.arange(M, device=dev)[None, :] < counts[:, None]
    else:
        xq, xr = fp8_operand(x3.reshape(-1, K)[:8], 1)
        idx, valid = dict(offsets=torch.tensor([0, 5, 8], device=dev)), torch.ones(8, dtype=torch.bool, device=dev)
    rs = None if swiglu else torch.rand(valid.shape, generator=gen).to(dev)
    out, plan = grouped_gemm(xq, wq, **idx, swiglu=swiglu, row_scale=rs, config=cfg, m_hint=64 if tma else None,
                             return_plan=True)  # (TMA tiles at prefill buckets only)
    assert plan.tma is tma
    ref = grouped_gemm_ref(xr, wr, **idx, swiglu=swiglu, row_scale=rs)
    for b in range(3):  # each block on its own: the small one would hide in the large one's norm
        cols = slice(128 * b, min(128 * (b + 1), N))
        assert_rel_close(out[..., cols], ref[..., cols], valid, P.GEMM_TOL, f"FP8 GEMM, weight block {b}")


@_ok
@given(fp8_gemm_cases(MLP_BOUNDS, mlp=True))
def test_fp8_expert_mlp_matches_reference(dev, c):
    """The FP8 expert MLP (bf16 x quantized per token inside; GEMM1's FP8 output into GEMM2) against its FP8 reference
    on the dequantized weights, and against the dense one on the unquantized operands."""
    P.check_fp8_expert_mlp(c, dev)


@pytest.mark.parametrize("layout", ["masked", "ragged"])
def test_fp8_x_given_or_quantized_inside_is_the_same(dev, layout):
    """x already FP8 (per token) and bf16 x quantized inside the MLP give the same bits; the plans say FP8 through
    (GEMM1's output FP8, whole 128-column blocks; no chain)."""
    gen = torch.Generator().manual_seed(4)
    G, M, H, I = 3, 6, 144, 160
    x = _values((G, M, H), 1.0, gen, dev)
    q13, _ = fp8_operand(_values((G, 2 * I, H), 0.3, gen, dev), 128, gate_up=True)
    q2, _ = fp8_operand(_values((G, H, I), 0.3, gen, dev), 128)
    counts = torch.tensor([4, 0, 6], device=dev)
    if layout == "masked":
        idx, xl = dict(counts=counts), x
        valid = torch.arange(M, device=dev)[None, :] < counts[:, None]
    else:
        idx, xl, valid = dict(offsets=torch.tensor([0, 4, 4, 10], device=dev)), x.reshape(-1, H)[:10], slice(None)
    a, (p1, p2) = expert_mlp(xl, q13, q2, **idx, return_plan=True)
    b = expert_mlp(quantize_fp8(xl, 1), q13, q2, **idx)
    assert torch.equal(a[valid], b[valid])
    assert (p1.x_format, p1.out_format, p2.x_format, p1.chain, p2.chain) == ("fp8", "fp8", "fp8", "none", "none")
    assert p1.config["BLOCK_N"] % 128 == 0


_PREFILL_TILES = {  # (GEMM1, GEMM2) configs of the FP8 prefill tiles: TMA halves / TMA / 128-row pointer loads
    "tma-halves": (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, TMA=True, num_warps=8),
                   dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, TMA=True, num_warps=8)),
    "tma-64": (dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, TMA=True, num_warps=8),
               dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, TMA=True, num_warps=4)),
    "pointer-128": (dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, TMA=False, num_warps=8),
                    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, TMA=False, num_warps=8)),
}


@pytest.mark.parametrize("tiles", list(_PREFILL_TILES))
def test_fp8_expert_mlp_prefill_tiles_match_reference(dev, tmp_path, monkeypatch, tiles):
    """The FP8 expert MLP at a prefill bucket with each kind of prefill tile taken from a tuned file (ragged, the
    layout TMA runs in): GEMM1's FP8 output goes into GEMM2 as it is (e4m3 codes + scales, by TMA where the config
    says so) and the result is the FP8 reference's; the plans say the tiles ran."""
    import json

    from moe_ep import device_facts
    monkeypatch.setattr(device_facts, "tma_supported", lambda: True)  # (on the CPU: the interpreter runs TMA too)
    gen = torch.Generator().manual_seed(11)
    G, H, I = 2, 256, 128
    offsets = torch.tensor([0, 130, 200], dtype=torch.int32, device=dev)
    x = _values((200, H), 1.0, gen, dev)
    w13, w2 = _values((G, 2 * I, H), 0.3, gen, dev), _values((G, H, I), 0.3, gen, dev)
    (q13, r13), (q2, r2) = fp8_operand(w13, 128, gate_up=True), fp8_operand(w2, 128)
    m = 512
    bucket = str(config_space.m_bucket(m))
    rest = dict(SWAP_AB=False, GROUP_M=8, num_stages=2)
    c1, c2 = ({**rest, **c} for c in _PREFILL_TILES[tiles])
    table = {config_space.shape_class(I, H, False, True, True, True): {bucket: c1},
             config_space.shape_class(H, I, False, False, True): {bucket: c2}}
    (tmp_path / f"{device_facts.device_name()}.json").write_text(json.dumps(table))
    gemm_plan.clear_cache()
    with options.override(config_dir=str(tmp_path), gluon_fp8_min_m="off"):  # (the tl kernel's tiles: no Gluon)
        out, (p1, p2) = expert_mlp(x, q13, q2, offsets=offsets, m_hint=m, return_plan=True)
    gemm_plan.clear_cache()
    assert (p1.config_source, p2.config_source) == ("tuned-file", "tuned-file")
    assert (p1.config["TMA"], p2.config["TMA"]) == (c1["TMA"], c2["TMA"]) and (p1.tma, p2.tma) == (c1["TMA"], c2["TMA"])
    xr = dequantize_fp8_ref(*quantize_fp8_ref(x, 1), 1)
    ref = expert_mlp_fp8_ref(xr, r13, r2, offsets=offsets)
    assert_rel_close(out, ref, slice(None), P.MLP_TOL, f"FP8 expert_mlp, {tiles} tiles")


def test_fp8_takes_its_own_configs_and_keys():
    """FP8 shape classes have tuned-file keys of their own and prune to configs that obey the FP8 rules (K steps in
    one scale block, whole 128-column blocks for the FP8 output); the FP8-only configs stay out of the bf16 classes,
    whose first configs do not change."""
    fp8_key = config_space.shape_class(2048, 7168, False, True, fp8=True, fp8_out=True)
    assert fp8_key == "n2048_k7168_xfp8_wfp8_swiglu_outfp8"
    assert config_space.shape_class(2048, 7168, False, True) == "n2048_k7168_xbf16_wbf16_swiglu"
    space = config_space.grouped_gemm_configs()
    only = {config_space._config_key(c) for c in config_space.fp8_only_configs()}
    for m in (8, 64, 512):
        args = {"M_BUCKET": m, "N": 2048, "K": 7168, "G": 32}
        fp8 = config_space.prune_grouped_gemm_configs(space, args, SWIGLU=True, FP8=True, FP8_OUT=True)
        assert fp8 and all(config_space.fp8_rule_broken(c.kwargs, True) is None and not c.kwargs["TMA"] for c in fp8)
        bf16 = config_space.prune_grouped_gemm_configs(space, args, SWIGLU=True)
        assert not any(config_space._config_key(c) in only for c in bf16)


def test_tuned_file_bf16_config_is_not_used_for_fp8(dev, tmp_path):
    """A tuned file with the bf16 shape class only: FP8 calls of that shape do not take its config; under their own
    key they do (and a config breaking the FP8 rules there is a named configuration error)."""
    import json

    from moe_ep import device_facts
    G, K, N = 2, 64, 128
    xq, _ = fp8_operand(torch.randn(G, 4, K).bfloat16().to(dev), 1)
    wq, _ = fp8_operand(torch.randn(G, 2 * N, K).bfloat16().to(dev), 128, gate_up=True)
    cnt = torch.tensor([4, 1], device=dev)
    odd = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 32, "SWAP_AB": False, "GROUP_M": 1, "num_warps": 2,
           "num_stages": 1}
    path = tmp_path / f"{device_facts.device_name()}.json"
    for table, source in (({config_space.shape_class(N, K, False, True): {"8": odd}}, "first-config"),
                          ({config_space.shape_class(N, K, False, True, True, True): {"8": odd}}, "tuned-file")):
        path.write_text(json.dumps(table))
        gemm_plan.clear_cache()
        with options.override(config_dir=str(tmp_path)):
            plan = plan_grouped_gemm(xq, wq, counts=cnt, swiglu=True, quantize_out=True)
        assert plan.config_source == source
    path.write_text(json.dumps({config_space.shape_class(N, K, False, True, True, True): {"8": dict(odd, BLOCK_N=64)}}))
    gemm_plan.clear_cache()
    with options.override(config_dir=str(tmp_path)), pytest.raises(MoEEpConfigError, match="BLOCK_N = 64"):
        grouped_gemm(xq, wq, counts=cnt, swiglu=True, quantize_out=True)


def _gemm_bad_cases(dev):
    G, M, K, N = 2, 4, 160, 144
    x = torch.randn(G, M, K).bfloat16().to(dev)
    w = torch.randn(G, 2 * N, K).bfloat16().to(dev)
    cnt = torch.tensor([1, 2], device=dev)
    xq, wq = quantize_fp8(x, 1), quantize_fp8(w, 128, gate_up=True)
    plain = quantize_fp8(w, 128)  # gate and up rows in shared blocks: I % 128 != 0 needs gate_up
    w2q = quantize_fp8(torch.randn(G, K, N).bfloat16().to(dev), 128)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SWAP_AB=True, GROUP_M=1, num_warps=4, num_stages=1)
    e, c = MoEEpInputError, MoEEpConfigError
    return [
        ("bf16 x, FP8 w", lambda: grouped_gemm(x, wq, counts=cnt, swiglu=True), e, "(x, w) formats = ('bf16', 'fp8')"),
        ("FP8 x, bf16 w", lambda: grouped_gemm(xq, w, counts=cnt), e, "(x, w) formats = ('fp8', 'bf16')"),
        ("FP8 x, NVFP4 w", lambda: grouped_gemm(xq, quantize_nvfp4(w), counts=cnt), e, "('fp8', 'nvfp4')"),
        ("NVFP4 x, FP8 w", lambda: grouped_gemm(quantize_nvfp4(x), wq, counts=cnt), e, "('nvfp4', 'fp8')"),
        ("x per block", lambda: grouped_gemm(quantize_fp8(x, 128), wq, counts=cnt, swiglu=True), e,
         "x.block_rows = 128"),
        ("w per row", lambda: grouped_gemm(xq, quantize_fp8(w, 1), counts=cnt, swiglu=True), e, "w.block_rows = 1"),
        ("w13 scales plain", lambda: grouped_gemm(xq, plain, counts=cnt, swiglu=True), e, "w.scales.shape = (2, 3, 2)"),
        ("gate_up without swiglu", lambda: grouped_gemm(xq, wq, counts=cnt), e, "w.gate_up = True"),
        ("K mismatch", lambda: grouped_gemm(quantize_fp8(x[..., :144].contiguous(), 1), wq, counts=cnt, swiglu=True),
         e, "x.shape[-1] = 144"),
        ("quantize_out bf16", lambda: grouped_gemm(x, w, counts=cnt, swiglu=True, quantize_out=True), e,
         "quantize_out = True"),
        ("quantize_out no swiglu", lambda: grouped_gemm(xq, plain, counts=cnt, quantize_out=True), e,
         "quantize_out = True"),
        ("quantize_out with out", lambda: grouped_gemm(xq, wq, counts=cnt, swiglu=True, quantize_out=True,
                                                       out=torch.empty(G, M, N, dtype=torch.bfloat16, device=dev)),
         e, "out = 'Tensor'"),
        ("quantize_out str", lambda: grouped_gemm(xq, wq, counts=cnt, swiglu=True, quantize_out="yes"), e,
         "quantize_out = 'yes'"),
        ("config BLOCK_K 256", lambda: grouped_gemm(xq, wq, counts=cnt, swiglu=True, config=dict(cfg, BLOCK_K=256)),
         c, "BLOCK_K = 256"),
        ("config FP8 out BLOCK_N 64", lambda: grouped_gemm(xq, wq, counts=cnt, swiglu=True, quantize_out=True,
                                                           config=cfg), c, "BLOCK_N = 64"),
        ("mlp FP8 w13, bf16 w2", lambda: expert_mlp(xq, wq, torch.randn(G, K, N).bfloat16().to(dev), counts=cnt), e,
         "(type(w13), type(w2)) = ('Fp8Tensor', 'Tensor')"),
        ("mlp bf16 w13, FP8 w2", lambda: expert_mlp(x, w, w2q, counts=cnt), e, "(type(w13), type(w2))"),
        ("mlp NVFP4 x", lambda: expert_mlp(quantize_nvfp4(x), wq, w2q, counts=cnt), e, "('nvfp4', 'fp8')"),
    ]


_GEMM_BAD = [c[0] for c in _gemm_bad_cases(kernel_device())]  # built where the kernels run


@pytest.mark.parametrize("name", _GEMM_BAD)
def test_fp8_gemm_bad_inputs(dev, name):
    _, call, exc, says = next(c for c in _gemm_bad_cases(dev) if c[0] == name)
    with pytest.raises(exc) as e:
        call()
    assert says in str(e.value) and "allowed" in str(e.value), (name, str(e.value))


# --- weights --------------------------------------------------------------------------------------------------------


def _model(L, H, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2 * I, H, generator=g) * H ** -0.5, torch.randn(L, H, I, generator=g) * I ** -0.5


@pytest.mark.parametrize("H, I", [(160, 144), (128, 256)], ids=["I%128!=0", "I%128==0"])
def test_expert_weights_fp8_and_from_fp8_blocks_round_trip(dev, H, I):
    """``ExpertWeights(..., FP8)`` quantizes once (w13 gate and up blocked apart); a checkpoint's tensors of the same
    quantization (gate, up, down and their ``weight_scale_inv``, as pairs or stacked) load to the same bits."""
    w13, w2 = (t.to(dev) for t in _model(2, H, I))
    ew = ExpertWeights(w13, w2, Format.FP8)
    assert ew.format is Format.FP8 and isinstance(ew.w13, Fp8Tensor) and isinstance(ew.w2, Fp8Tensor)
    assert ew.w13.gate_up and ew.w13.block_rows == ew.w2.block_rows == 128
    assert (ew.num_local_experts, ew.hidden_size, ew.intermediate_size) == (2, H, I)
    rq, rs = quantize_fp8_ref(w13, 128, gate_up=True)
    assert_bits_equal(ew.w13.scales, rs, "w13 scales")
    assert_bits_equal(ew.w13.data.view(torch.uint8), rq.view(torch.uint8), "w13 codes")
    d13, _ = ew.dense()
    assert_bits_equal(d13, dequantize_fp8_ref(rq, rs, 128, True), "w13 dequantized")
    gate, up, down = (quantize_fp8(t, 128) for t in (w13[:, :I], w13[:, I:], w2))
    pair = ExpertWeights.from_fp8_blocks((gate.data, up.data), down.data, (gate.scales, up.scales), down.scales)
    stacked = ExpertWeights.from_fp8_blocks(ew.w13.data.cpu(), down.data, ew.w13.scales.cpu(), down.scales,
                                            device=dev)
    for got in (pair, stacked):
        assert got.format is Format.FP8 and got.w13.gate_up and got.device == ew.device
        assert (got.num_local_experts, got.hidden_size, got.intermediate_size) == (2, H, I)
        for a, b in ((got.w13, ew.w13), (got.w2, ew.w2)):
            assert_bits_equal(a.scales, b.scales, "scales")
            assert_bits_equal(a.data.view(torch.uint8), b.data.view(torch.uint8), "codes")
    half = ExpertWeights.from_fp8_blocks(ew.w13.data, down.data, ew.w13.scales, down.scales.bfloat16())
    assert half.w2.scales.dtype == torch.float32  # bf16 scales (some checkpoints) widened exactly
    assert_bits_equal(half.w2.scales, down.scales.bfloat16().float(), "widened scales")


def _load_bad_cases(dev):
    L, H, I = 2, 160, 144
    w13, w2 = (t.to(dev) for t in _model(L, H, I))
    g, u, d = (quantize_fp8(t, 128) for t in (w13[:, :I], w13[:, I:], w2))
    s13 = torch.cat([g.scales, u.scales], 1)
    d13 = torch.cat([g.data, u.data], 1)
    nan = d.data.clone()
    nan.view(torch.uint8)[0, 0, 0] = 0xFF
    inf = d.scales.clone()
    inf[1, 0, 1] = float("inf")
    load = ExpertWeights.from_fp8_blocks
    return [
        ("pair and stacked", lambda: load((g.data, u.data), d.data, s13, d.scales), "(type(w13), type(w13_scale_inv))"),
        ("three parts", lambda: load((g.data, u.data, u.data), d.data, (g.scales, u.scales, u.scales), d.scales),
         "len(w13) = 3"),
        ("bf16 data", lambda: load((g.data.bfloat16(), u.data), d.data, (g.scales, u.scales), d.scales),
         "w13[0].dtype = torch.bfloat16"),
        ("2-D data", lambda: load((g.data[0], u.data[0]), d.data, (g.scales, u.scales), d.scales), "w13[0].shape"),
        ("up shape", lambda: load((g.data, u.data[:, :128]), d.data, (g.scales, u.scales), d.scales),
         "w13[1].shape (up) = (2, 128, 160)"),
        ("gate scales shape", lambda: load((g.data, u.data), d.data, (g.scales[:, :1], u.scales), d.scales),
         "w13_scale_inv[0].shape = (2, 1, 2)"),
        ("scales int", lambda: load((g.data, u.data), d.data, (g.scales.int(), u.scales), d.scales),
         "w13_scale_inv[0].dtype = torch.int32"),
        ("stacked scales plain layout", lambda: load(d13, d.data, quantize_fp8(w13, 128).scales, d.scales),
         "w13_scale_inv.shape = (2, 3, 2)"),
        ("w2 shape", lambda: load(d13, d.data[:, :, :128], s13, d.scales), "w2.shape = (2, 160, 128)"),
        ("w2 scales shape", lambda: load(d13, d.data, s13, d.scales[:, :1]), "w2_scale_inv.shape = (2, 1, 2)"),
        ("w2 scales list", lambda: load(d13, d.data, s13, d.scales.tolist()), "type(w2_scale_inv) = 'list'"),
        ("NaN code", lambda: load(d13, nan, s13, d.scales), "w2 holds NaN codes"),
        ("Inf scale", lambda: load(d13, d.data, s13, inf), "w2_scale_inv holds NaN or Inf"),
        ("odd rows", lambda: load(d13[:, :-1], d.data, s13, d.scales), "w13.shape[1] (2I) = 287"),
        ("I not a multiple of 16", lambda: load(d13[:, 4:-4], d.data[..., :140], fp8_scales(d13[:, 4:-4]),
                                                fp8_scales(d.data[..., :140], False)), "intermediate size I = 140"),
        ("device", lambda: load(d13, d.data, s13, d.scales, device="nowhere"), "device = 'nowhere'"),
    ]


def fp8_scales(data, gate_up=True):
    from moe_ep.kernels.fp8 import fp8_scales_shape
    return torch.ones(fp8_scales_shape(data.shape, 128, gate_up), device=data.device)


@pytest.mark.parametrize("name", [c[0] for c in _load_bad_cases(kernel_device())])
def test_from_fp8_blocks_bad_inputs(dev, name):
    _, call, says = next(c for c in _load_bad_cases(dev) if c[0] == name)
    with pytest.raises(MoEEpInputError) as e:
        call()
    assert says in str(e.value) and "allowed" in str(e.value), (name, str(e.value))


def test_fp8_weight_format_by_name(dev):
    w13, w2 = (t.to(dev) for t in _model(1, 32, 16))
    assert ExpertWeights(w13, w2, "fp8").format is Format.FP8
    with pytest.raises(MoEEpConfigError, match=re.escape("weight_format = 'fp4'; allowed: 'bf16', 'nvfp4', 'fp8'")):
        ExpertWeights(w13, w2, "fp4")


# --- compute, fused_moe, the layer ----------------------------------------------------------------------------------


def _moe(dev, E=4, K=2, H=160, I=144, B=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = _model(E, H, I, seed)
    x = torch.randn(B, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])
    idx[1, 1] = -1
    wts = torch.rand(B, K, generator=g)
    return ExpertWeights(w13.to(dev), w2.to(dev), Format.FP8), x, idx, wts


def test_fused_moe_with_fp8_weights(dev):
    """fused_moe with FP8 weights (tokens quantized to FP8 per token here) against the dense MoE on the dequantized
    weights; activation_format 'fp8' is the same; NVFP4 activations are a named error."""
    weights, x, idx, wts = _moe(dev)
    out = fused_moe(x.to(dev), idx.to(dev), wts.to(dev), weights)
    d13, d2 = weights.dense()
    assert_rel_close(out, moe_reference(x, idx, wts, d13.cpu(), d2.cpu()), torch.ones(6, dtype=torch.bool),
                     FP8_DENSE_TOL, "fused_moe FP8")
    assert torch.equal(out, fused_moe(x.to(dev), idx.to(dev), wts.to(dev), weights, activation_format="fp8"))
    with pytest.raises(MoEEpInputError, match="activation_format = 'nvfp4'"):
        fused_moe(x.to(dev), idx.to(dev), wts.to(dev), weights, activation_format="nvfp4")
    bf16 = ExpertWeights(*(t.float() for t in weights.dense()))
    with pytest.raises(MoEEpInputError, match="activation_format = 'fp8'"):
        fused_moe(x.to(dev), idx.to(dev), wts.to(dev), bf16, activation_format="fp8")
    bad = x.clone()
    bad[2, 5] = float("nan")
    with pytest.raises(MoEEpInputError, match=re.escape("hidden_states[2] holds NaN or Inf")):
        fused_moe(bad.to(dev), idx.to(dev), wts.to(dev), weights)


def test_fp8_tokens_are_consumed_as_they_are(dev):
    """Tokens that arrive as an Fp8Tensor (block_rows 1; what an FP8 dispatch hands the compute) give the same bits
    as bf16 tokens quantized by the compute: masked ``[L, M, H]`` and ragged (the bridge gathers FP8 rows and scales
    as they are); FP8 tokens with bf16 weights and NVFP4 activations with FP8 weights are named errors."""
    from moe_ep import compute
    weights, x, idx, wts = _moe(dev)
    xd, idx, wts = x.to(dev), idx.to(dev), wts.to(dev)
    xq = quantize_fp8(xd, 1)
    route = route_experts(idx, 4)
    gathered = permute_rows(xq, route)
    ref = quantize_fp8(permute_rows(xd, route)[: int(route.offsets[-1])], 1)
    n = int(route.offsets[-1])
    assert_bits_equal(gathered.data[:n].view(torch.uint8), ref.data.view(torch.uint8), "gathered codes")
    assert_bits_equal(gathered.scales[:n], ref.scales, "gathered scales")
    a = compute.bridged_mlp(compute.activations(xd, False, None, True), idx, wts, weights)
    b = compute.bridged_mlp(xq, idx, wts, weights)
    assert torch.equal(a, b)
    x3 = xd[:4].reshape(2, 2, -1).repeat(2, 1, 1)
    cnt = torch.tensor([2, 1, 0, 2], device=dev)
    assert torch.equal(expert_mlp(x3, weights.w13, weights.w2, counts=cnt)[cnt[:, None] > torch.arange(2, device=dev)],
                       expert_mlp(quantize_fp8(x3, 1), weights.w13, weights.w2, counts=cnt)[
                           cnt[:, None] > torch.arange(2, device=dev)])
    with pytest.raises(MoEEpInputError, match="FP8 tokens with weights"):
        compute.activations(xq, False, None, False)
    with pytest.raises(MoEEpInputError, match="activation format with FP8 weights = 'nvfp4'"):
        compute.activations(xd, True, None, True)


@pytest.mark.parametrize("alg, lay", [("ll", "expert_major"), ("ll", "rank_major"), ("ht", "flat"),
                                      ("ht", "expert_major")])
def test_layer_with_fp8_weights(dev, alg, lay):
    """The world-1 layer with FP8 weights and bf16 activations (quantized after dispatch) in every layout, against
    the dense MoE; HT FLAT gives fused_moe's bits; FP8 activations (quantized before dispatch) give the same bits."""
    weights, x, idx, wts = _moe(dev)
    cfg = EpConfig(4, 2, 160, 144, 6, alg, lay, weight_format="fp8")
    out = MoEEpLayer(cfg, weights)(x.to(dev), idx.to(dev), wts.to(dev))
    d13, d2 = weights.dense()
    assert_rel_close(out, moe_reference(x, idx, wts, d13.cpu(), d2.cpu()), torch.ones(6, dtype=torch.bool),
                     FP8_DENSE_TOL, f"layer {alg} {lay} FP8")
    if (alg, lay) == ("ht", "flat"):
        assert torch.equal(out, fused_moe(x.to(dev), idx.to(dev), wts.to(dev), weights))
    # FP8 activations: the portable transport quantizes each token before dispatch, the compute takes the codes as
    # they arrive; quantizing is per token, so the bits are those of quantizing after dispatch
    cfg8 = EpConfig(4, 2, 160, 144, 6, alg, lay, weight_format="fp8", activation_format="fp8")
    assert torch.equal(MoEEpLayer(cfg8, weights)(x.to(dev), idx.to(dev), wts.to(dev)), out)


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_fp8_prefill_prune_keeps_both_accumulators_in_registers(monkeypatch, quick):
    """The GPU space pruned for the benchmark models' FP8 prefill GEMMs (GEMM1 with SwiGLU and FP8 output, GEMM2)
    keeps only configs whose sum and promoted K-step product fit the register budget (fp8_registers_ok; past it
    ptxas spills them: tests/test_compile.py), and one is always left (GEMM1's 64 x 128 over two warpgroups)."""
    monkeypatch.setattr(config_space, "INTERPRETER", False)  # the GPU space and its rules, on any machine
    space = config_space.grouped_gemm_configs()
    with options.override(autotune_quick=quick):
        for n, k, swiglu, g in ((2048, 7168, True, 32), (7168, 2048, False, 32), (14336, 4096, True, 8),
                                (4096, 14336, False, 8)):
            for m in (128, 512, 1024):
                kept = config_space.prune_grouped_gemm_configs(space, {"M_BUCKET": m, "N": n, "K": k, "G": g},
                                                               SWIGLU=swiglu, FP8=True, FP8_OUT=swiglu)
                assert kept and all(config_space.fp8_registers_ok(config_space.config_dict(c), swiglu)
                                    for c in kept), (n, k, m, [config_space.config_dict(c) for c in kept])
                if swiglu and m >= 512:
                    assert {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in kept} == {(64, 128, 8)}
