"""The sm_100 W4A4 grouped GEMM (``sm100_fp4.py``), proven without a B200:

- it builds what we think: every config of its space, built for sm_100 with the interpreter off, holds the
  block-scaled NVFP4 MMA (``tcgen05.mma ... kind::mxf4nvf4.block_scale``, 16-element blocks, UE4M3 scales in the
  instruction descriptor, the config's M and N) and no other MMA;
- it computes the function: neither Triton's interpreter runs ``dot_scaled`` with e4m3 scales (3.6 has none, 3.9
  reads the bytes as e8m0), so the instruction's contract is written in torch here (:func:`nvfp4_mma_contract`) and
  checked against the reference's dequantization; the operand bytes the kernel hands the instruction are pinned
  against the tensor's own bytes (linear and 128x4-swizzled scales); the kernel's interpreter stand-in for the
  instruction is pinned bit for bit against the contract; and the whole kernel (schedule, masks, global scales,
  SwiGLU, epilogue) runs against the fp32 reference on the dequantized operands.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_ep import MoEEpConfigError, MoEEpInputError
from moe_ep.kernels.grouped_gemm import sm100_fp4
from moe_ep.kernels.nvfp4 import NvFp4Tensor, quantize_nvfp4, swizzle_scales
from moe_ep.reference import dequantize_nvfp4_ref, grouped_gemm_ref
from moe_ep.testing import compile_checks
from moe_ep.testing.strategies import Bounds, gemm_cases, gemm_operand, make_gemm_operands
from moe_ep.triton_runtime import INTERPRETER
from moe_ep.triton_runtime import device as kernel_device

interpreted = pytest.mark.skipif(not INTERPRETER, reason="the sm_100 path's proof without a B200 runs its kernel "
                                 "(emulated MMA) through Triton's interpreter on CPU tensors; a GPU here is no sm_100")

_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.data_too_large])

# --- it builds what we think -------------------------------------------------------------------------------------

BUILD_SCRIPT = r"""
import json, sys
import moe_ep  # TRITON_INTERPRET=0 is set: real JIT functions
import triton
from moe_ep.kernels.grouped_gemm import sm100_fp4
from moe_ep.testing import compile_checks as cc
shard = sys.argv[1]
rows = []
for i, check in enumerate(cc.sm100_fp4()):
    if shard != "all" and i % 2 != int(shard):
        continue
    k = cc.sm100_fp4_build(check)
    c = dict(check[2], num_stages=check[3]["num_stages"])
    rows.append({"config": {n: c[n] for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "num_stages")},
                 "swiglu": c["SWIGLU"], "want": sm100_fp4.mma_shape(c, c["SWIGLU"]),
                 "mmas": cc.block_scaled_fp4_mmas(k.asm["ptx"]),
                 "other_mma": "mma.sync" in k.asm["ptx"] or "wgmma" in k.asm["ptx"], "shared": k.metadata.shared,
                 "smem_est": sm100_fp4.smem_bytes(c, c["SWIGLU"]), "tmem": getattr(k.metadata, "tmem_size", None),
                 "tmem_est": sm100_fp4.tmem_columns(c, c["SWIGLU"])})
print(json.dumps({"triton": triton.__version__, "listed": len(cc.sm100_fp4()), "rows": rows}))
"""


def test_every_sm100_config_builds_the_block_scaled_nvfp4_mma(request):
    """Every config of ``SM100_CONFIGS`` (formats and epilogues rotating over them) builds for sm_100, and its PTX
    holds tcgen05 MMAs that are all the NVFP4 one, with UE4M3 scales and the config's MMA shape, and no other MMA
    (a Triton that decodes to bf16 instead, as 3.9 does for an M of 64, fails here), in the shared memory a B200
    gives one program, within the prune's shared-memory estimate (``smem_bytes``: at most 2% and the slack over the
    build's) and tensor-memory estimate (``tmem_columns``: the build's). ``--compile-shard`` builds half."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    shard = request.config.getoption("compile_shard")
    r = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, shard], env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["listed"] == len(sm100_fp4.SM100_CONFIGS)
    want_rows = res["listed"] if shard == "all" else sum(i % 2 == int(shard) for i in range(res["listed"]))
    assert len(res["rows"]) == want_rows
    for row in res["rows"]:
        m, n = row["want"]
        assert row["mmas"] and not row["other_mma"], row
        assert row["shared"] <= B200["shared_memory_per_block_optin"], row  # launches on a B200
        # the prune's estimates: shared memory at or above the build's, not far above; tensor memory Triton's own
        assert row["shared"] <= row["smem_est"] <= 1.02 * row["shared"] + sm100_fp4.SMEM_SLACK, (res["triton"], row)
        assert row["tmem"] is not None and row["tmem"] <= row["tmem_est"] <= max(row["tmem"], 32), (res["triton"], row)
        for mma in row["mmas"]:
            assert compile_checks.nvfp4_mma_ok(mma), (res["triton"], row)
            assert (mma["idesc"] >> 24 & 31, mma["idesc"] >> 17 & 63) == (m >> 4, n >> 3), (res["triton"], row)
    assert {r["swiglu"] for r in res["rows"]} == {True, False}


_IDESC_E4M3 = 136316032  # M 128, N 128, UE4M3 (Triton 3.6 and 3.9 build it for the 128 x 128 tile)


@pytest.mark.parametrize("op, idesc, ok", [
    ("tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X", _IDESC_E4M3, True),  # Triton 3.6
    ("tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16", _IDESC_E4M3, True),  # Triton 3.9
    ("tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16", _IDESC_E4M3 | 1 << 23, False),  # UE8M0 scales
    ("tcgen05.mma.cta_group::1.kind::mxf4.block_scale.block32", _IDESC_E4M3, False),  # MXFP4: e8m0 per 32
    ("tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::2X", _IDESC_E4M3, False),  # 32-blocks
    ("tcgen05.mma.cta_group::1.kind::f16", _IDESC_E4M3, False),  # decoded to bf16
    ("tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16", None, False),  # descriptor not a constant
])
def test_nvfp4_mma_recognised_from_ptx(op, idesc, ok):
    """The PTX reader the build check relies on: it finds the opcode and its descriptor constant, and accepts only
    FP4 x FP4 with 16-element UE4M3 blocks."""
    mov = f"\tmov.b32 \t%r198, {idesc};\n" if idesc is not None else "\tld.param.b32 %r198, [p];\n"
    ptx = mov + f"\t@%p9 {op} [ %r491 + 0 ], %rd104, %rd105, %r198, [ %r199 + 0 ], [ %r200 + 0 ], %p14;\n"
    mmas = compile_checks.block_scaled_fp4_mmas(ptx)
    assert mmas == [{"op": op, "idesc": idesc}]
    assert compile_checks.nvfp4_mma_ok(mmas[0]) is ok


# --- it computes the function ------------------------------------------------------------------------------------

def nvfp4_mma_contract(a_codes, a_scales, b_codes, b_scales) -> torch.Tensor:
    """What ``tcgen05.mma .kind::mxf4nvf4.block_scale.block16`` computes, in torch: ``A [M, K/2]`` and ``B [N, K/2]``
    uint8, two E2M1 codes a byte along K (element 2i in the low nibble), ``a_scales [M, K/16]``, ``b_scales [N, K/16]``
    float8_e4m3fn, one per 16 consecutive K elements; ``sum_k A[m,k] sa[m,k//16] B[n,k] sb[n,k//16]`` -> fp32
    ``[M, N]`` (summed in fp64: every product is exact)."""
    def values(codes, scales):
        c = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2).to(torch.int64)
        mag = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)[c & 7]
        v = torch.where(c >= 8, -mag, mag)
        return v * scales.double().repeat_interleave(16, dim=-1)
    return (values(a_codes, a_scales) @ values(b_codes, b_scales).T).float()


def _nvfp4_rows(rows, K, seed):
    """NVFP4 rows quantized where the kernels run, their parts brought to the CPU (the contract is torch on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    q = quantize_nvfp4((torch.randn(rows, K, generator=g).bfloat16() * 3).to(kernel_device()), 1.0)
    return NvFp4Tensor(q.data.cpu(), q.scales.cpu(), q.global_scale.cpu(), q.shape)


@given(m=st.integers(1, 5), n=st.integers(1, 5), k16=st.integers(1, 6), seed=st.integers(0, 2 ** 16))
def test_instruction_contract_is_the_product_of_dequantized_operands(m, n, k16, seed):
    """The torch contract of the instruction (codes and 16-block scales) equals the product of the reference's
    dequantized operands (global scale 1)."""
    a, b = _nvfp4_rows(m, 16 * k16, seed), _nvfp4_rows(n, 16 * k16, seed + 1)
    got = nvfp4_mma_contract(a.data, a.scales, b.data, b.scales)
    one = torch.ones(())
    want = dequantize_nvfp4_ref(a.data, a.scales, one).double() @ dequantize_nvfp4_ref(b.data, b.scales, one).double().T
    assert torch.equal(got, want.float())


@triton.jit
def _operand_bytes_kernel(q_ptr, s_ptr, rows_ptr, q_out, s_out, k0, K, K16, SLICE_ROWS, CP, SWIZZLED: tl.constexpr,
                          EVEN_K: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.load(rows_ptr + tl.arange(0, R)).to(tl.int64)
    q, s = sm100_fp4._operands(q_ptr, s_ptr, rows, k0, K, K16, SLICE_ROWS, CP, SWIZZLED, EVEN_K, BLOCK_K)
    tl.store(q_out + tl.arange(0, R)[:, None] * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :], q)
    tl.store(s_out + tl.arange(0, R)[:, None] * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)[None, :],
             s.to(tl.uint8, bitcast=True))


@interpreted
@pytest.mark.parametrize("swizzled", [False, True], ids=["linear", "swizzled"])
@pytest.mark.parametrize("K, block_k, k0", [(256, 128, 128), (96, 128, 0), (160, 128, 128)])
def test_operand_bytes_are_the_tensors_rows(swizzled, K, block_k, k0):
    """The bytes ``_operands`` hands the MMA for weight rows of several experts at one K step are the tensor's codes
    and its linear scales of those rows (the swizzle undone), K past the end zero: the mapping from our layouts to
    the instruction's operands. Rows cross the 32- and 128-row boundaries of the 128x4 layout."""
    G, NW = 2, 160
    w = quantize_nvfp4(torch.randn(G, NW, K, generator=torch.Generator().manual_seed(5)).bfloat16(), 1.0)
    scales = swizzle_scales(w.scales) if swizzled else w.scales
    rows = torch.tensor([0, 1, 31, 32, 127, 128, 159, 160, 161, 200, 255, 256, 300, 319, 33, 97], dtype=torch.int32)
    R = rows.numel()
    q_out = torch.empty(R, block_k // 2, dtype=torch.uint8)
    s_out = torch.empty(R, block_k // 16, dtype=torch.uint8)
    k16 = K // 16
    _operand_bytes_kernel[(1,)](w.data, scales.view(torch.uint8), rows, q_out, s_out, k0, K, k16, NW, -(-k16 // 4) * 4,
                                SWIZZLED=swizzled, EVEN_K=K % block_k == 0, R=R, BLOCK_K=block_k)
    codes = torch.nn.functional.pad(w.data.reshape(G * NW, K // 2), (0, block_k))[rows.long()]
    lin = torch.nn.functional.pad(w.scales.view(torch.uint8).reshape(G * NW, k16), (0, block_k // 16))[rows.long()]
    assert torch.equal(q_out, codes[:, k0 // 2:(k0 + block_k) // 2])
    assert torch.equal(s_out, lin[:, k0 // 16:(k0 + block_k) // 16])


@triton.jit
def _emulated_mma_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    ka = tl.arange(0, BLOCK_K // 2)
    ks = tl.arange(0, BLOCK_K // 16)
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * (BLOCK_K // 2) + ka[None, :])
    b = tl.load(b_ptr + rn[:, None] * (BLOCK_K // 2) + ka[None, :])
    sa = tl.load(sa_ptr + rm[:, None] * (BLOCK_K // 16) + ks[None, :]).to(tl.float8e4nv, bitcast=True)
    sb = tl.load(sb_ptr + rn[:, None] * (BLOCK_K // 16) + ks[None, :]).to(tl.float8e4nv, bitcast=True)
    acc = sm100_fp4._block_scaled_mma(tl.zeros([M, N], tl.float32), a, sa, b, sb, True, BLOCK_K)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc)


@interpreted
@given(seed=st.integers(0, 2 ** 16), block_k=st.sampled_from([64, 128]))
def test_interpreter_stand_in_is_the_instruction_contract(seed, block_k):
    """Under the interpreter the kernel's MMA step (``EMULATE``) computes the contract exactly: a power-of-two scaled
    sum of exact products, so bit for bit (values kept where fp32 sums are exact)."""
    a, b = _nvfp4_rows(16, block_k, seed), _nvfp4_rows(16, block_k, seed + 1)
    out = torch.empty(16, 16)
    _emulated_mma_kernel[(1,)](a.data, a.scales.view(torch.uint8), b.data, b.scales.view(torch.uint8), out, 16, 16,
                               block_k)
    want = nvfp4_mma_contract(a.data, a.scales, b.data, b.scales)
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


@st.composite
def _cases(draw):
    c = draw(gemm_cases(Bounds(rows=9, k16=6, n16=5, experts=4, top_k=1)))
    c.update(x_fmt=draw(st.sampled_from(["nvfp4", "nvfp4_rows"])), w_fmt="nvfp4", swizzle=draw(st.booleans()))
    fits = sm100_fp4.configs_for(c["swiglu"])
    cfg = draw(st.sampled_from(fits))
    c["config"] = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return c


def _swizzled(q: NvFp4Tensor) -> NvFp4Tensor:
    return NvFp4Tensor(q.data, swizzle_scales(q.scales), q.global_scale, q.shape, True)


@pytest.mark.skipif(not (INTERPRETER or sm100_fp4.available()), reason="runs through the interpreter (the MMA's "
                    "stand-in) or on a GPU the sm_100 path runs on (a B200); this GPU is neither")
@_ok
@given(_cases())
def test_sm100_fp4_kernel_matches_reference(c):
    """The kernel (its interpreter stand-in for the MMA on the CPU; the MMA itself on a B200) against the fp32
    reference on the dequantized operands: masked and ragged, empty experts, rows of no expert left unwritten
    (poisoned), N and K past the tiles, SwiGLU, row scale, one or per-row x global scales, per-expert w global scales,
    linear or swizzled scales, every config of the space (drawn)."""
    dev = kernel_device()
    G, K, N = c["G"], c["K"], c["N"]
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    x, idx, valid, rows = make_gemm_operands(c, dev)
    w = (torch.randn(G, 2 * N if c["swiglu"] else N, K, generator=gen) * 0.5).bfloat16().to(dev)
    xk, xr = gemm_operand(x, c["x_fmt"])
    wk, wr = gemm_operand(w, "nvfp4", per_slice=True)
    if c["swizzle"]:
        xk, wk = _swizzled(xk), _swizzled(wk)
    rs = torch.rand(rows, generator=gen).to(dev) if c["row_scale"] else None
    out = torch.full((*rows, N), float("nan"), dtype=torch.bfloat16, device=dev)
    got = sm100_fp4.sm100_fp4_grouped_gemm(xk, wk, **idx, swiglu=c["swiglu"], row_scale=rs, out=out,
                                           config=c["config"])
    assert got is out
    ref = grouped_gemm_ref(xr, wr, **idx, swiglu=c["swiglu"], row_scale=rs)
    o, r = out[valid].float(), ref[valid]
    assert torch.isfinite(o).all()
    assert (o - r).norm() <= 1e-2 * r.norm() + 1e-30, ((o - r).norm() / r.norm(), c)
    assert torch.isnan(out[~valid].float()).all(), "rows of no expert were written"


def test_default_configs_fit():
    """The default config of every token count builds the FP4 MMA (fits), swapped for decode, unswapped for prefill."""
    for swiglu in (False, True):
        for m in (1, 8, 16, 17, 64, 65, 4096):
            cfg = sm100_fp4.default_config(m, swiglu)
            assert sm100_fp4.config_fits(cfg, swiglu) and cfg["SWAP_AB"] is (m <= 64), (m, swiglu, cfg)
            assert cfg["SWAP_AB"] is False or cfg["BLOCK_M"] >= min(m, 16)


def _operands():
    x = quantize_nvfp4(torch.randn(8, 32).bfloat16())
    w = quantize_nvfp4(torch.randn(2, 16, 32).bfloat16())
    return x, w, torch.tensor([0, 3, 8], dtype=torch.int32)


@interpreted
@pytest.mark.parametrize("change, exc, says", [
    (dict(x=torch.zeros(8, 32, dtype=torch.bfloat16)), MoEEpInputError, "type(x)"),
    (dict(w="w"), MoEEpInputError, "type(w)"),
    (dict(offsets=None), MoEEpInputError, "(counts, offsets)"),
    (dict(offsets=torch.tensor([0, 8], dtype=torch.int32)), MoEEpInputError, "offsets"),
    (dict(offsets=torch.tensor([0.0, 3, 8])), MoEEpInputError, "offsets"),
    (dict(swiglu=1), MoEEpInputError, "swiglu"),
    (dict(row_scale=torch.ones(7)), MoEEpInputError, "row_scale"),
    (dict(out=torch.empty(8, 15, dtype=torch.bfloat16)), MoEEpInputError, "out"),
    (dict(config={"BLOCK_M": 64}), MoEEpConfigError, "config"),
    (dict(config=dict(sm100_fp4.default_config(4, False), BLOCK_N=64)), MoEEpConfigError, "config"),  # MMA M 64
])
def test_bad_arguments_are_named(change, exc, says):
    x, w, offs = _operands()
    args = dict(x=x, w=w, offsets=offs, swiglu=False, row_scale=None, out=None, config=None)
    args.update(change)
    x, w = args.pop("x"), args.pop("w")
    with pytest.raises(exc, match=r"^" + __import__("re").escape(says)):
        sm100_fp4.sm100_fp4_grouped_gemm(x, w, **args)


@interpreted
def test_x_and_w_of_other_k_are_refused():
    x, w, offs = _operands()
    x = quantize_nvfp4(torch.randn(8, 48).bfloat16())
    with pytest.raises(MoEEpInputError, match="x.shape"):
        sm100_fp4.sm100_fp4_grouped_gemm(x, w, offsets=offs)


# --- the dispatcher --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("major, interpreted, version, taken", [
    (10, False, "3.6.0", True), (10, False, "3.9.0", True), (10, False, "3.10.0", False), (9, False, "3.6.0", False),
    (12, False, "3.6.0", False), (10, True, "3.6.0", False), (None, False, "3.6.0", False)])
def test_available_only_on_capability_10_under_a_checked_triton(monkeypatch, major, interpreted, version, taken):
    """The path is taken on compute capability 10.x alone (not Hopper, not sm_120 cards), compiled, under a Triton
    whose sm_100 build this file read."""
    from types import SimpleNamespace
    monkeypatch.setattr(sm100_fp4.device_facts, "properties",
                        lambda: None if major is None else SimpleNamespace(major=major, minor=0))
    monkeypatch.setattr(sm100_fp4, "INTERPRETER", interpreted)
    monkeypatch.setattr(sm100_fp4.triton, "__version__", version)
    assert sm100_fp4.available() is taken


def _w4a4_call(swiglu=True):
    g = torch.Generator().manual_seed(11)
    G, K, N = 3, 64, 24
    offs = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    x = torch.randn(10, K, generator=g).bfloat16()
    w = torch.randn(G, 2 * N if swiglu else N, K, generator=g).bfloat16()
    xq, xr = gemm_operand(x, "nvfp4_rows")
    wq, wr = gemm_operand(w, "nvfp4", per_slice=True)
    return xq, xr, wq, wr, offs


@interpreted
def test_plan_reports_the_tl_path_here():
    """Without a capability 10.x GPU (this CPU) W4A4 calls plan and run the tl kernel, as before."""
    from moe_ep.kernels import grouped_gemm, plan_grouped_gemm
    from moe_ep.kernels.grouped_gemm import plan as gemm_plan
    gemm_plan.clear_cache()
    xq, xr, wq, wr, offs = _w4a4_call()
    plan = plan_grouped_gemm(xq, wq, offsets=offs, swiglu=True)
    assert plan.path == "tl" and plan.x_decoded
    _, plan = grouped_gemm(xq, wq, offsets=offs, swiglu=True, return_plan=True)
    assert plan.path == "tl"


@interpreted
@pytest.mark.parametrize("swiglu", [True, False])
def test_dispatcher_runs_the_sm100_path_where_available(monkeypatch, swiglu):
    """Where ``available`` says so (mocked here), a W4A4 ``grouped_gemm`` plans and launches this kernel (its
    interpreter stand-in on the CPU), no decoded copies, and the result is the reference's; bf16 x (W4A16) and bf16
    weights keep the tl path."""
    from moe_ep.kernels import grouped_gemm, plan_grouped_gemm
    from moe_ep.kernels.grouped_gemm import plan as gemm_plan
    monkeypatch.setattr(sm100_fp4, "available", lambda: True)
    gemm_plan.clear_cache()
    try:
        xq, xr, wq, wr, offs = _w4a4_call(swiglu)
        out = torch.full((10, 24), float("nan"), dtype=torch.bfloat16)
        got, plan = grouped_gemm(xq, wq, offsets=offs, swiglu=swiglu, out=out, return_plan=True)
        assert plan.path == "sm100-fp4" and plan.decoded == (False, False)
        assert plan.config == sm100_fp4.default_config(3, swiglu) and plan.grid > 0
        ref = grouped_gemm_ref(xr, wr, offsets=offs, swiglu=swiglu)
        assert (out[:9].float() - ref[:9]).norm() <= 1e-2 * ref[:9].norm()
        assert torch.isnan(out[9].float()).all()
        assert plan_grouped_gemm(xr.bfloat16(), wq, offsets=offs, swiglu=swiglu).path == "tl"
        assert plan_grouped_gemm(xq, wr.bfloat16(), offsets=offs, swiglu=swiglu).path == "tl"
    finally:
        gemm_plan.clear_cache()


# --- tuning is ready -------------------------------------------------------------------------------------------

B200 = dict(name="NVIDIA B200", major=10, minor=0, multi_processor_count=148, shared_memory_per_multiprocessor=233472,
            shared_memory_per_block_optin=232448, total_memory=192 * 2 ** 30)
"""A B200's device properties, as ``torch.cuda.get_device_properties`` gives them (the ones moe-ep reads)."""


@interpreted
@pytest.mark.one_triton
def test_tune_dry_run_on_a_mocked_b200_writes_the_file_its_loader_picks(tmp_path, monkeypatch):
    """With a B200's properties mocked (capability 10.0, 148 SMs, its shared memory, its name), ``moe-ep tune`` runs its
    whole path on the interpreter for a tiny preset and writes ``NVIDIA_B200.json`` (the H200 file's code path: device
    name, buckets, routed counts), which validates, and which the loader picks for a call of that shape on that
    device. bf16 weights: the tl kernel (the W4A4 kernel's tuning: the next test)."""
    from types import SimpleNamespace

    from moe_ep import device_facts, options
    from moe_ep.cli import main
    from moe_ep.kernels import plan_grouped_gemm
    from moe_ep.kernels.grouped_gemm import plan as gemm_plan
    from moe_ep.kernels.grouped_gemm import tuned_files
    from moe_ep.kernels.grouped_gemm.config_space import shape_class
    monkeypatch.setattr(device_facts, "properties", lambda: SimpleNamespace(**B200))
    assert device_facts.device_name() == "NVIDIA_B200" and device_facts.sm_count() == 148
    gemm_plan.clear_cache()
    try:
        with options.override(config_dir=str(tmp_path)):
            assert main(["tune", "--hidden", "64", "--intermediate", "32", "--experts", "2", "--gemms", "gemm1",
                         "--formats", "bf16", "--buckets", "8,64"]) == 0
            path = tmp_path / "NVIDIA_B200.json"
            table = json.loads(path.read_text())
            key = shape_class(32, 64, False, True)
            assert set(table[key]) == {"8", "64"}
            for cfg in table[key].values():
                tuned_files.validate(cfg, "config", True, False, None)
            x = torch.randn(16, 64).bfloat16()
            w = torch.randn(2, 64, 64).bfloat16()
            plan = plan_grouped_gemm(x, w, offsets=torch.tensor([0, 8, 16]), swiglu=True, m_hint=8)
            assert plan.config_source == "tuned-file" and plan.config_file.endswith("NVIDIA_B200.json")
            assert plan.config == table[key]["8"]
    finally:
        gemm_plan.clear_cache()


# --- the space's prune and its tuned-file entries ---------------------------------------------------------------

def _sm100_cfg(swiglu=False, **change):
    """An sm100_fp4 config dict of the space (the 128-token prefill tile), with ``change`` applied."""
    return dict(sm100_fp4.default_config(4096, swiglu), **change)


def test_prune_drops_configs_over_shared_or_tensor_memory(monkeypatch):
    """The prune keeps configs within sm_100's shared memory (``smem_bytes``) and tensor memory (``tmem_columns``):
    a deep pipeline of the widest SwiGLU tile is dropped for its shared memory; with fewer tensor-memory columns
    (patched), the tiles whose accumulator and scales need more are dropped, the others kept."""
    deep = triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=256, SWAP_AB=False, GROUP_M=8), num_warps=8,
                         num_stages=6)
    assert sm100_fp4.config_fits(deep.kwargs, True)
    assert sm100_fp4.smem_bytes(sm100_fp4.config_dict(deep), True) > sm100_fp4.device_facts.SM100_SMEM_PER_BLOCK
    assert sm100_fp4.prune([deep], True) == []
    assert "shared memory" in sm100_fp4.over_limits(sm100_fp4.config_dict(deep), True)
    assert sm100_fp4.prune([deep], True, smem_limit=2 ** 20) == [deep]
    assert len(sm100_fp4.configs_for(False)) == sum(sm100_fp4.config_fits(c.kwargs, False)
                                                    for c in sm100_fp4.SM100_CONFIGS)  # B200: all fit today
    monkeypatch.setattr(sm100_fp4.device_facts, "SM100_TMEM_COLUMNS", 256)
    kept = sm100_fp4.configs_for(False)
    assert kept and all(sm100_fp4.mma_shape(c.kwargs, False)[1] < 256 for c in kept)
    wide = next(c for c in sm100_fp4.SM100_CONFIGS if c.kwargs["BLOCK_N"] == 256)
    assert wide not in kept and "tensor-memory" in sm100_fp4.over_limits(sm100_fp4.config_dict(wide), False)


@pytest.mark.parametrize("m", [1, 8, 16, 32, 64, 128, 1024])
@pytest.mark.parametrize("swiglu", [False, True])
def test_tune_candidates_suit_the_bucket(m, swiglu, monkeypatch):
    """``moe-ep tune``'s W4A4 candidates (GPU rules: the interpreter's cut patched off) are configs of the pruned
    space: swapped token tiles of up to twice the bucket's rows, the unswapped 128-token tile from 64 on."""
    monkeypatch.setattr(sm100_fp4, "INTERPRETER", False)
    cands = sm100_fp4.tune_candidates(m, 7168, 7168, swiglu)
    space = [sm100_fp4.config_dict(c) for c in sm100_fp4.configs_for(swiglu)]
    assert cands and all(c in space for c in cands)
    assert all(c["BLOCK_M"] <= max(2 * m, 16) for c in cands if c["SWAP_AB"])
    assert any(not c["SWAP_AB"] for c in cands) is (m >= 64)
    assert len(sm100_fp4.tune_candidates(m, 7168, 7168, swiglu, quick=True)) <= 3


_BAD_SM100 = [
    ("not an object", [1, 2], r"\[where\] = \[1, 2\]; allowed: an sm100_fp4 config"),
    ("unknown key (a tl config)", dict(_sm100_cfg(), TMA=False), r"\[where\]: keys \['TMA'\]"),
    ("missing key", {k: v for k, v in _sm100_cfg().items() if k != "GROUP_M"}, r"\[where\]\.GROUP_M = missing"),
    ("bad value", _sm100_cfg(BLOCK_M=24), r"\[where\]\.BLOCK_M = 24; allowed: an int, a power of two"),
    ("bad bool", _sm100_cfg(SWAP_AB=0), r"\[where\]\.SWAP_AB = 0; allowed: true or false"),
    ("MMA M not 128", _sm100_cfg(SWAP_AB=True, BLOCK_M=16, BLOCK_N=64), r"MMA \(M, N\) = \(64, 16\)"),
    ("not in the space", _sm100_cfg(num_stages=5), r"not in the space"),
    ("over shared memory", _sm100_cfg(BLOCK_K=256, num_stages=8), r"bytes of shared memory; allowed: at most"),
]


@pytest.mark.parametrize("what, cfg, says", _BAD_SM100, ids=[b[0] for b in _BAD_SM100])
def test_bad_sm100_entries_are_named(what, cfg, says):
    """Each kind of bad sm100 entry raises MoEEpConfigError naming where it is, the key or value, and what is
    allowed."""
    from moe_ep.kernels.grouped_gemm import tuned_files
    with pytest.raises(MoEEpConfigError, match=r"^\[where\]" + says.removeprefix(r"\[where\]")
                       if says.startswith(r"\[where\]") else r"^\[where\] = .*" + says):
        tuned_files.validate_sm100(cfg, "[where]", False)
    good = _sm100_cfg()
    assert tuned_files.validate_sm100(good, "[where]", False) == good


def _w4a4_plan(tmp_path, table, monkeypatch, config=None, swiglu=True):
    """The plan of a W4A4 call with ``sm100_fp4.available`` mocked, tuned file ``table`` for this device."""
    from moe_ep import device_facts, options
    from moe_ep.kernels import plan_grouped_gemm
    from moe_ep.kernels.grouped_gemm import plan as gemm_plan
    monkeypatch.setattr(sm100_fp4, "available", lambda: True)
    (tmp_path / (device_facts.device_name() + ".json")).write_text(json.dumps(table))
    gemm_plan.clear_cache()
    try:
        xq, xr, wq, wr, offs = _w4a4_call(swiglu)
        with options.override(config_dir=str(tmp_path)):
            return plan_grouped_gemm(xq, wq, offsets=offs, swiglu=swiglu, config=config)
    finally:
        gemm_plan.clear_cache()


@interpreted
def test_sm100_plan_takes_forced_then_tuned_then_first_config(tmp_path, monkeypatch):
    """On the sm100 path (mocked) the config is the forced one (an sm100 config), else the tuned file's
    ``..._xnvfp4_wnvfp4_swiglu`` entry, else ``default_config``; the plan says which. A forced config that is no
    sm100 config (a tl one) and a bad entry in the file raise MoEEpConfigError."""
    from moe_ep.kernels.grouped_gemm.config_space import shape_class
    key = shape_class(24, 64, True, True, sm100_fp4=True)
    assert key == "n24_k64_xnvfp4_wnvfp4_swiglu"
    tuned = dict(sm100_fp4.default_config(64, True), BLOCK_K=128)
    assert tuned != sm100_fp4.default_config(3, True)
    p = _w4a4_plan(tmp_path, {key: {"8": tuned}}, monkeypatch)
    assert (p.path, p.config_source, p.config) == ("sm100-fp4", "tuned-file", tuned)
    assert p.config_file.endswith(".json")
    p = _w4a4_plan(tmp_path, {}, monkeypatch)
    assert (p.config_source, p.config) == ("first-config", sm100_fp4.default_config(3, True))
    forced = sm100_fp4.config_dict(sm100_fp4.configs_for(True)[-1])
    p = _w4a4_plan(tmp_path, {key: {"8": tuned}}, monkeypatch, config=forced)
    assert (p.path, p.config_source, p.config) == ("sm100-fp4", "forced", forced)
    tl_cfg = dict(forced, TMA=False)
    with pytest.raises(MoEEpConfigError, match=r"^config: keys \['TMA'\]"):
        _w4a4_plan(tmp_path, {}, monkeypatch, config=tl_cfg)
    with pytest.raises(MoEEpConfigError, match=r"n24_k64_xnvfp4_wnvfp4_swiglu'\]\[8\]\.BLOCK_M = 24"):
        _w4a4_plan(tmp_path, {key: {"8": dict(tuned, BLOCK_M=24)}}, monkeypatch)


@interpreted
@pytest.mark.one_triton
def test_tune_on_a_mocked_b200_tunes_the_w4a4_kernel(tmp_path, monkeypatch):
    """With a B200 mocked (its properties, and ``sm100_fp4.available``), ``moe-ep tune --formats nvfp4`` tunes the
    W4A4 kernel in the same loop as the tl shapes and writes its entries (``n{N}_k{K}_xnvfp4_wnvfp4_swiglu``, each
    bucket) next to the W4A16 ones in ``NVIDIA_B200.json``; they validate, and a W4A4 plan of that shape on that
    device takes the tuned entry."""
    from types import SimpleNamespace

    from moe_ep import device_facts, options
    from moe_ep.cli import main
    from moe_ep.kernels import plan_grouped_gemm
    from moe_ep.kernels.grouped_gemm import plan as gemm_plan
    from moe_ep.kernels.grouped_gemm import tuned_files
    from moe_ep.kernels.grouped_gemm.config_space import shape_class
    monkeypatch.setattr(device_facts, "properties", lambda: SimpleNamespace(**B200))
    monkeypatch.setattr(sm100_fp4, "available", lambda: True)
    gemm_plan.clear_cache()
    try:
        with options.override(config_dir=str(tmp_path)):
            assert main(["tune", "--hidden", "64", "--intermediate", "32", "--experts", "2", "--gemms", "gemm1",
                         "--formats", "nvfp4", "--buckets", "8,64"]) == 0
            table = json.loads((tmp_path / "NVIDIA_B200.json").read_text())
            key = shape_class(32, 64, True, True, sm100_fp4=True)
            assert set(table) == {key, shape_class(32, 64, True, True)}
            assert set(table[key]) == {"8", "64"}
            for b, cfg in table[key].items():
                assert tuned_files.validate_sm100(cfg, f"[{b}]", True) == cfg
            x = quantize_nvfp4(torch.randn(16, 64).bfloat16())
            w = quantize_nvfp4(torch.randn(2, 64, 64).bfloat16())
            for m in (8, 64):
                plan = plan_grouped_gemm(x, w, offsets=torch.tensor([0, 8, 16]), swiglu=True, m_hint=m)
                assert plan.path == "sm100-fp4" and plan.config_source == "tuned-file", plan
                assert plan.config_file.endswith("NVIDIA_B200.json") and plan.config == table[key][str(m)]
    finally:
        gemm_plan.clear_cache()
