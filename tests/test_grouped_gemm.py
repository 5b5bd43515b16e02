"""Grouped GEMM / expert MLP kernels against the fp32 torch references (moe_ep.reference).

NVFP4 operands are compared against the reference run on their dequantized values (the kernel computes
exactly that function, up to fp32 summation order and the bf16 output). Error bound: relative Frobenius
error ``||out - ref|| / ||ref||``; the output is bf16 (2^-9 relative rounding) and the MMA inputs are bf16
(NVFP4 values times E4M3 scales are exact in bf16), so 1e-2 for one GEMM; the expert MLP also rounds its
intermediate to bf16, so 2e-2.
"""

import importlib
import json
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from moe_ep import MoEEpConfigError, MoEEpInputError, device_facts, options
from moe_ep.kernels import NvFp4Tensor, expert_mlp, grouped_gemm, nvfp4_global_scale, plan_grouped_gemm, quantize_nvfp4
from moe_ep.kernels.grouped_gemm import config_space, schedule, tuned_files
from moe_ep.kernels.grouped_gemm import plan as gemm_plan
from moe_ep.reference import expert_mlp_ref, grouped_gemm_ref
from moe_ep.testing.strategies import Bounds, gemm_cases, gemm_operand, make_gemm_operands
from moe_ep.triton_runtime import device as kernel_device

GEMM_TOL = 1e-2
MLP_TOL = 2e-2
GEMM_BOUNDS = Bounds(rows=9, k16=6, n16=5, experts=6, top_k=1)  # cases: moe_ep.testing.strategies.gemm_cases
MLP_BOUNDS = Bounds(rows=7, k16=4, n16=4, experts=4, top_k=1)

launcher = importlib.import_module("moe_ep.kernels.grouped_gemm.launcher")
kernels = importlib.import_module("moe_ep.kernels.grouped_gemm.kernels")
chain = importlib.import_module("moe_ep.kernels.grouped_gemm.chain")
_fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                              HealthCheck.data_too_large])


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Every test starts without cached plans: several change the rules plans are made by (monkeypatch)."""
    gemm_plan.clear_cache()


@pytest.fixture(autouse=True)
def _bounded_autotune():
    """On a GPU, search at most 3 configs per shape class: the tests check results, not speed. The decoded-copy bucket
    is the default one, whatever the caller's environment says. The search is on (the interpreter's default is off):
    these tests check the autotuned path too."""
    with options.override(autotune=True, autotune_quick=True, decoded_min_m=config_space.DECODED_MIN_M):
        yield


def _values(shape, scale, zero_frac, gen, dev):
    v = torch.randn(shape, generator=gen) * scale
    if zero_frac:
        v = v * (torch.rand(shape, generator=gen) >= zero_frac)
    return v.to(torch.bfloat16).to(dev)


def _assert_close(out, ref, valid, tol):
    o, r = out[valid].float(), ref[valid].float()
    assert torch.isfinite(o).all()
    err = (o - r).norm().item()
    assert err <= tol * r.norm().item() + 1e-30, f"rel err {err / max(r.norm().item(), 1e-30):.3e} > {tol}"
    assert torch.isnan(out[~valid].float()).all(), "rows outside the experts' counts were written"


def _check_gemm(dev, c, m_hint, config=None):
    """Runs case c against the reference; the plan launched (None when there were no rows)."""
    gen = torch.Generator().manual_seed(c["seed"])
    G, K, N = c["G"], c["K"], c["N"]
    x, idx, valid, rows = make_gemm_operands(c, dev)
    w = _values((G, 2 * N if c["swiglu"] else N, K), 0.5, c["zero_frac"], gen, dev)
    xk, xr = gemm_operand(x, c["x_fmt"])
    wk, wr = gemm_operand(w, c["w_fmt"], per_slice=True)
    rs = torch.rand(rows, generator=gen).to(dev) if c["row_scale"] else None
    out = torch.full((*rows, N), float("nan"), dtype=torch.bfloat16, device=dev)  # poisoned
    got, plan = grouped_gemm(xk, wk, **idx, swiglu=c["swiglu"], row_scale=rs, out=out, m_hint=m_hint, config=config,
                             return_plan=True)
    assert got is out
    ref = grouped_gemm_ref(xr, wr, **idx, swiglu=c["swiglu"], row_scale=rs)
    _assert_close(out, ref, valid, GEMM_TOL)
    return plan if x.numel() else None


@_fixture_ok
@given(gemm_cases(GEMM_BOUNDS))
def test_grouped_gemm_matches_reference(dev, c):
    _check_gemm(dev, c, c["m_hint"])


_TMA = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "SWAP_AB": False, "GROUP_M": 2, "TMA": True, "num_warps": 4,
        "num_stages": 1}


@_fixture_ok
@given(gemm_cases(GEMM_BOUNDS))
def test_tma_config_matches_reference(dev, c):
    """A TMA config (persistent grid, tensor-descriptor tiles), ragged bf16 operands: tiles past an expert's rows,
    empty experts, rows of no expert, N and K past the tiles, poisoned rows."""
    plan = _check_gemm(dev, dict(c, x_fmt="bf16", w_fmt="bf16", ragged=True), 64, _TMA)  # prefill bucket (decode:
    if plan is None:  # no TMA); no rows: nothing launched
        return
    assert plan.config["TMA"] is plan.tma is device_facts.tma_supported()
    assert plan.config_source == "forced" and plan.persistent is plan.tma


@_fixture_ok
@given(gemm_cases(GEMM_BOUNDS))
def test_decoded_nvfp4_operands_match_reference(dev, c):
    """At a prefill bucket NVFP4 weights are decoded once into a bf16 copy too (x always is), then bf16 tiles (TMA
    where the layout allows) with the global scales on the fp32 sums."""
    plan = _check_gemm(dev, c, config_space.DECODED_MIN_M)
    if plan is not None:
        assert plan.decoded == (c["x_fmt"] != "bf16", c["w_fmt"] == "nvfp4")


@pytest.mark.parametrize("layout", ["masked", "ragged"])
@pytest.mark.parametrize("x_fmt", ["bf16", "nvfp4", "nvfp4_rows"])
def test_decoded_nvfp4_same_bits_as_decoding_in_the_loop(dev, layout, x_fmt):
    """The decoded weight copy holds exactly the values the K loop decodes (fp4_decode.decode_nvfp4), up to a power of
    two that the global scale takes back: with the same tiles the two paths give the same bits. Below the bucket the K
    loop decodes the weights; NVFP4 x is decoded to a copy at every size."""
    cfg = dict(_TMA, TMA=False, BLOCK_K=64)
    gen = torch.Generator().manual_seed(7)
    G, K, N, M = 3, 128, 40, 24
    counts = torch.tensor([19, 0, 24], device=dev)
    x = torch.randn(G, M, K, generator=gen).bfloat16().to(dev)
    w = (torch.randn(G, 2 * N, K, generator=gen) * 0.2).bfloat16().to(dev)
    wq, wr = gemm_operand(w, "nvfp4", per_slice=True)
    if layout == "masked":
        idx, xl = dict(counts=counts), x
    else:
        idx, xl = dict(offsets=torch.cumsum(torch.cat([counts.new_zeros(1), counts]), 0)), x.view(-1, K)[:43]
    xk, xr = gemm_operand(xl, x_fmt)
    outs = []
    for m_hint in (config_space.DECODED_MIN_M, 64):
        out, plan = grouped_gemm(xk, wq, **idx, swiglu=True, m_hint=m_hint, config=cfg, return_plan=True)
        outs.append(out)
        prefill = m_hint == config_space.DECODED_MIN_M
        assert plan.decoded == (x_fmt != "bf16", prefill)
        assert plan.config == cfg
    valid = (torch.arange(M, device=dev)[None, :] < counts[:, None]) if layout == "masked" else slice(None)
    assert torch.equal(outs[0][valid], outs[1][valid])
    ref = grouped_gemm_ref(xr, wr, **idx, swiglu=True)
    assert (outs[0][valid].float() - ref[valid]).norm() <= GEMM_TOL * ref[valid].norm()


@pytest.mark.parametrize("K", [64, 48])
def test_decode_nvfp4_masked_rows(dev, monkeypatch, K):
    """The masked decode (NVFP4 x before the GEMM) writes e2m1 * s / 256 for exactly the rows within the counts (the
    others stay as they were), with several programs per expert walking its row blocks; the dense decode writes every
    row."""
    from moe_ep.kernels.grouped_gemm.fp4_decode import decode_nvfp4
    from moe_ep.reference import dequantize_nvfp4_ref
    monkeypatch.setattr(device_facts, "sm_count", lambda: 64)  # several programs per expert
    G, M = 3, 80
    counts = torch.tensor([37, 0, 80], dtype=torch.int32, device=dev)
    q = quantize_nvfp4(torch.randn(G, M, K, generator=torch.Generator().manual_seed(3)).bfloat16().to(dev))
    data, scales = q.data, q.scales.view(torch.uint8)
    empty = torch.empty  # the copy is made with torch.empty: poison it to see which rows the kernel writes
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan"))
                        if k.get("dtype") == torch.bfloat16 else empty(*a, **k))
    got = decode_nvfp4(data, scales, (G, M, K), counts)
    want = (dequantize_nvfp4_ref(q.data, q.scales, torch.ones((), device=dev)) / 256).bfloat16()
    dense = decode_nvfp4(data, scales, (G, M, K))
    valid = torch.arange(M, device=dev)[None, :] < counts[:, None]
    assert torch.equal(got[valid], want[valid]) and torch.equal(dense, want)
    assert torch.isnan(got[~valid].float()).all()


def test_decoded_min_m_from_the_environment(dev):
    """$MOE_EP_DECODED_MIN_M moves the bucket from which NVFP4 weights are decoded first, or turns it off; anything
    else is a named configuration error."""
    x = torch.randn(5, 32).bfloat16().to(dev)
    wq, _ = gemm_operand(torch.randn(2, 16, 32).bfloat16().to(dev), "nvfp4", per_slice=True)
    offs = torch.tensor([0, 3, 5], device=dev)
    var = options.ENV["decoded_min_m"]
    for env, m_hint, decoded in (("off", config_space.DECODED_MIN_M, False), ("64", 64, True), ("64", 32, False),
                                 (" ", config_space.DECODED_MIN_M, True), (" OFF ", config_space.DECODED_MIN_M, False)):
        with options.override(autotune="off", decoded_min_m=options.parse({var: env}).decoded_min_m):
            _, plan = grouped_gemm(x, wq, offsets=offs, m_hint=m_hint, return_plan=True)
        assert plan.decoded == (False, decoded), (env, m_hint)
    for bad in ("0", "-8", "lots", "1e3", "\u00b2", "64 tokens"):
        with pytest.raises(MoEEpConfigError, match=var):
            options.parse({var: bad})


def test_tma_config_falls_back_to_pointer_loads(dev):
    """Where TMA cannot run, a TMA config's tiles go through pointer loads: NVFP4 weights, and the masked layout
    (a TMA box would read an expert's padding rows)."""
    x = torch.randn(40, 64).bfloat16().to(dev)
    wq, wr = gemm_operand(torch.randn(2, 48, 64).bfloat16().to(dev), "nvfp4", per_slice=True)
    offs = torch.tensor([0, 25, 40], device=dev)
    out, plan = grouped_gemm(x, wq, offsets=offs, m_hint=64, config=_TMA, return_plan=True)
    assert plan.config == dict(_TMA, TMA=False) and not plan.tma and not plan.tma_possible
    ref = grouped_gemm_ref(x, wr, offsets=offs)
    assert (out.float() - ref).norm() <= GEMM_TOL * ref.norm()
    xm, cnt = x.view(2, 20, 64), torch.tensor([20, 7], device=dev)
    out = torch.full((2, 20, 48), float("nan"), dtype=torch.bfloat16, device=dev)
    _, plan = grouped_gemm(xm, wr.bfloat16(), counts=cnt, out=out, m_hint=64, config=_TMA, return_plan=True)
    assert plan.config == dict(_TMA, TMA=False)
    ref = grouped_gemm_ref(xm, wr.bfloat16(), counts=cnt)
    valid = torch.arange(20, device=dev)[None, :] < cnt[:, None]
    _assert_close(out, ref, valid, GEMM_TOL)


@_fixture_ok
@given(gemm_cases(MLP_BOUNDS, mlp=True))
def test_expert_mlp_matches_reference(dev, c):
    gen = torch.Generator().manual_seed(c["seed"])
    G, H, I = c["G"], c["K"], c["N"]
    x, idx, valid, rows = make_gemm_operands(c, dev)
    w13k, w13r = gemm_operand(_values((G, 2 * I, H), 0.3, 0.0, gen, dev), c["w_fmt"], per_slice=True)
    w2k, w2r = gemm_operand(_values((G, H, I), 0.3, 0.0, gen, dev), c["w_fmt"], per_slice=True)
    xk, xr = gemm_operand(x, c["x_fmt"])
    rs = torch.rand(rows, generator=gen).to(dev) if c["row_scale"] else None
    out = torch.full((*rows, H), float("nan"), dtype=torch.bfloat16, device=dev)
    expert_mlp(xk, w13k, w2k, **idx, row_scale=rs, out=out, m_hint=c["m_hint"])
    ref = expert_mlp_ref(xr, w13r, w2r, **idx, row_scale=rs)
    _assert_close(out, ref, valid, MLP_TOL)


@pytest.mark.parametrize("layout, given_ready", [("masked", False), ("ragged", False), ("ragged", True)])
def test_expert_mlp_chain(dev, monkeypatch, layout, given_ready):
    """Decode-sized calls chain GEMM2 onto GEMM1 (grouped_gemm/chain.py): GEMM1 counts exactly its tiles per expert
    (none for an empty one), GEMM2 is told GEMM1's tiling, and the result has the same bits as with the chain off.
    ``given_ready``: the caller's zeroed counters (``chain_ready``, as the bridge's route gives them) are the ones
    counted in."""
    links = []
    monkeypatch.setattr(launcher, "Link", lambda *a, **k: links.append(chain.Link(*a, **k)) or links[-1])
    gen = torch.Generator().manual_seed(3)
    G, H, I, M = 3, 64, 48, 8
    x = torch.randn(G * M, H, generator=gen).bfloat16().to(dev)
    w13 = (torch.randn(G, 2 * I, H, generator=gen) * 0.2).bfloat16().to(dev)
    w2 = (torch.randn(G, H, I, generator=gen) * 0.2).bfloat16().to(dev)
    rows = torch.tensor([5, 0, 8], device=dev)
    idx = dict(counts=rows) if layout == "masked" else dict(offsets=torch.tensor([0, 5, 5, 13], device=dev))
    xl = x.view(G, M, H) if layout == "masked" else x[:13]
    with options.override(autotune="off"):  # one launch per GEMM (a config search runs GEMM1 once per config)
        ready = torch.zeros(G, dtype=torch.int32, device=dev) if given_ready else None
        chained, plans = expert_mlp(xl, w13, w2, **idx, return_plan=True, chain_ready=ready)
        assert [p.chain for p in plans] == ["counts", "waits"]
        first, second = links
        assert (first.ready is ready) is given_ready
        bm, nt = second.wait
        assert (first.ready.cpu() == (rows.cpu() + bm - 1) // bm * nt).all()
        assert second.ready is first.ready
        assert torch.equal(first.launched[0].reshape(xl.shape), xl)  # GEMM1's operands, held until GEMM2 is enqueued
        with options.override(gemm_chain="off"):
            plain, plans = expert_mlp(xl, w13, w2, **idx, return_plan=True)
    assert len(links) == 2  # off: no links made
    assert [p.chain for p in plans] == ["none", "none"]
    valid = (torch.arange(M, device=dev)[None, :] < rows[:, None]) if layout == "masked" else slice(None)
    assert torch.equal(chained[valid], plain[valid])


@pytest.mark.parametrize("w_fmt, x_fmt, m_hint", [("bf16", "bf16", 8), ("nvfp4", "bf16", 8), ("bf16", "nvfp4", 200),
                                                   ("nvfp4", "nvfp4", 200)])
def test_masked_persistent_grid_matches_one_program_per_tile(dev, monkeypatch, w_fmt, x_fmt, m_hint):
    """A masked layout whose row capacity far exceeds its counts walks its tiles with a persistent grid: the same
    tiles as one program per tile slot, so the same bits, and rows past the counts untouched either way (bf16 weights
    at decode sizes also run the GEMM1 -> GEMM2 chain; m_hint 200 takes unswapped tiles)."""
    monkeypatch.setattr(config_space, "persistent_programs", lambda meta, swiglu: 2)  # several tiles per program
    gen = torch.Generator().manual_seed(5)
    G, H, I, M = 3, 128, 48, 64
    counts = torch.tensor([17, 0, 50], device=dev)
    x, xr = gemm_operand(torch.randn(G, M, H, generator=gen).bfloat16().to(dev), x_fmt)
    w13, r13 = gemm_operand((torch.randn(G, 2 * I, H, generator=gen) * 0.2).bfloat16().to(dev), w_fmt, per_slice=True)
    w2, r2 = gemm_operand((torch.randn(G, H, I, generator=gen) * 0.2).bfloat16().to(dev), w_fmt, per_slice=True)
    ref = expert_mlp_ref(xr, r13, r2, counts=counts)
    valid = torch.arange(M, device=dev)[None, :] < counts[:, None]
    outs = []
    for persistent in (True, False):
        consulted = []
        monkeypatch.setattr(schedule, "persistent_grid", lambda a, p=persistent, c=consulted: c.append(p) or p)
        gemm_plan.clear_cache()  # plans are cached per call signature; this test changes the rule they come from
        out = torch.full((G, M, H), float("nan"), dtype=torch.bfloat16, device=dev)
        with options.override(autotune="off"):
            _, plans = expert_mlp(x, w13, w2, counts=counts, out=out, m_hint=m_hint, return_plan=True)
        assert all(p.persistent is persistent and p.config_source == "first-config" for p in plans)
        _assert_close(out, ref, valid, MLP_TOL)
        assert consulted, "the plan and the launch ask the persistent-grid rule"
        outs.append(out)
    assert torch.equal(outs[0][valid], outs[1][valid])


_SPACE = [config_space.config_dict(c) for c in config_space.grouped_gemm_configs()]
# (weights, x, swiglu (else a row scale), layout, persistent grid): each flag both ways over the four cases
_SPACE_CASES = [("nvfp4", "nvfp4_rows", True, "masked", True), ("bf16", "bf16", False, "ragged", False),
                ("nvfp4", "bf16", False, "masked", False), ("bf16", "nvfp4", True, "ragged", False)]


@pytest.mark.parametrize("i", range(len(_SPACE)), ids=[f"config{i}" for i in range(len(_SPACE))])
def test_every_config_of_the_space_matches_reference(dev, monkeypatch, i):
    """Each config the autotuner or a tuned file may pick (the whole space on a GPU, the interpreter's on the CPU),
    forced, against the reference: odd N and K, an empty expert, masked rows never written, NVFP4 operands, both grids.
    A case too large for this GPU's shared memory is left out."""
    cfg = _SPACE[i]
    G, M, K, N = (5, 160, 576, 200) if dev.type == "cuda" else (3, 40, 96, 40)
    counts = torch.tensor([37, 0, M, 3, 90][:G], device=dev).clamp(max=M)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    valid = torch.arange(M, device=dev)[None, :] < counts[:, None]
    gen = torch.Generator().manual_seed(i)
    x3 = torch.randn(G, M, K, generator=gen).bfloat16().to(dev)
    ran = 0
    for w_fmt, x_fmt, swiglu, layout, persistent in _SPACE_CASES:
        monkeypatch.setattr(schedule, "persistent_grid", lambda a, p=persistent: p)
        monkeypatch.setattr(config_space, "persistent_programs", lambda meta, sw: 3)  # several tiles per program
        w, wr = gemm_operand((torch.randn(G, 2 * N if swiglu else N, K, generator=gen) * 0.1).bfloat16().to(dev), w_fmt,
                             per_slice=True)
        x = x3 if layout == "masked" else x3[valid]
        xk, xr = gemm_operand(x, x_fmt)
        rs = None if swiglu else torch.rand(x.shape[:-1], generator=gen).to(dev)
        idx = dict(counts=counts) if layout == "masked" else dict(offsets=offsets)
        out = torch.full((*x.shape[:-1], N), float("nan"), dtype=torch.bfloat16, device=dev)
        try:
            grouped_gemm(xk, w, **idx, swiglu=swiglu, row_scale=rs, out=out, m_hint=64, config=cfg)
        except Exception as e:  # noqa: BLE001  (bf16 weight tiles are 4x NVFP4's: some configs fit NVFP4 only; the
            if type(e).__name__ == "OutOfResources" or "bytes of shared memory" in str(e):  # plan's check says so
                continue
            raise
        ref = grouped_gemm_ref(xr, wr, **idx, swiglu=swiglu, row_scale=rs)
        _assert_close(out, ref, valid if layout == "masked" else torch.ones(len(x), dtype=torch.bool, device=dev),
                      GEMM_TOL)
        ran += 1
    if not ran:
        pytest.skip(f"{cfg} does not fit this GPU's shared memory")


def test_masked_rows_never_written_without_out(dev, monkeypatch):
    """Without out=, rows past the counts of a fresh torch.empty output are whatever was there (not zeroed): the
    output is poisoned where torch.empty makes it, and those rows still hold the poison after the call."""
    G, M, K, N = 2, 8, 32, 32
    x = torch.randn(G, M, K).bfloat16().to(dev)
    w = torch.randn(G, N, K).bfloat16().to(dev)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan"))
                        if k.get("dtype") == torch.bfloat16 else empty(*a, **k))
    out = grouped_gemm(x, w, counts=torch.tensor([3, 0], device=dev))
    monkeypatch.setattr(torch, "empty", empty)
    assert torch.isnan(out[0, 3:].float()).all() and torch.isnan(out[1].float()).all()
    ref = grouped_gemm_ref(x, w, counts=torch.tensor([3, 0], device=dev))
    assert out.shape == (G, M, N) and out.dtype == torch.bfloat16
    assert ((out[0, :3].float() - ref[0, :3]).norm() <= GEMM_TOL * ref[0, :3].norm())


@pytest.mark.parametrize("m_hint, swap", [(None, True), (8, True), (200, False)])
def test_decode_shapes_swap_operands(dev, m_hint, swap):
    G, M, K, N = 2, 4, 32, 64
    x = torch.randn(G, M, K).bfloat16().to(dev)
    w = torch.randn(G, N, K).bfloat16().to(dev)
    before = plan_grouped_gemm(x, w, counts=torch.tensor([4, 2], device=dev), m_hint=m_hint)
    assert before.config is None and before.config_source == "autotune"  # picked at the launch
    _, plan = grouped_gemm(x, w, counts=torch.tensor([4, 2], device=dev), m_hint=m_hint, return_plan=True)
    assert plan.config_source == "autotune"
    assert plan.config["SWAP_AB"] is swap


@pytest.mark.parametrize("m, tallest, orders", [(8, 16, {True}), (16, 32, {True}), (32, 64, {True, False}),
                                                (64, 128, {False})])
def test_decode_tiles_take_twice_the_mean_rows(monkeypatch, m, tallest, orders):
    """The GPU space pruned for a DeepSeek-V3 GEMM1: row tiles up to twice the bucket (routed counts spread around
    their mean; a short tile re-reads the expert's weights), in either operand order at 32, not swapped above."""
    monkeypatch.setattr(config_space, "INTERPRETER", False)  # the GPU space and its rules, on any machine
    with options.override(autotune_quick=False):  # the whole pruned list, not the bounded search's 3
        cands = config_space.prune_grouped_gemm_configs(config_space.grouped_gemm_configs(),
                                                        {"M_BUCKET": m, "N": 2048, "K": 7168, "G": 32}, SWIGLU=True,
                                                        W_FP4=False)
    assert max(c.kwargs["BLOCK_M"] for c in cands) == tallest
    assert {c.kwargs["SWAP_AB"] for c in cands} == orders
    assert config_space.m_bucket(m) == m and config_space.m_bucket(1) == 8 and config_space.m_bucket(9) == 16


# (N, K, SwiGLU) of the benchmark models' GEMMs: DeepSeek-V3 EP8, Qwen3-30B-A3B, Mixtral 8x7B
_MODEL_GEMMS = [(2048, 7168, True), (7168, 2048, False), (768, 2048, True), (2048, 768, False), (14336, 4096, True),
                (4096, 14336, False)]


@pytest.mark.parametrize("limit", [232448, 166912, 101376],
                         ids=["227KB-H100-H200-B200", "163KB-A100", "99KB-sm89-sm120"])
def test_prune_keeps_only_tiles_that_fit_shared_memory(monkeypatch, limit):
    """The GPU space pruned for every model GEMM, format and bucket under a GPU's shared-memory limit: something is
    always left (the first-config fallback runs), all of it fits, and the limit is what removed the rest."""
    monkeypatch.setattr(config_space, "INTERPRETER", False)
    with options.override(autotune_quick=False):  # the whole pruned list, not the bounded search's 3
        space, cut = config_space.grouped_gemm_configs(), 0
        for n, k, swiglu in _MODEL_GEMMS:
            for w_fp4 in (False, True):
                for m in (8, 16, 32, 64, 128, 512, 1024):
                    args = ({"M_BUCKET": m, "N": n, "K": k, "G": 32, "TMA_OK": not w_fp4}, )
                    flags = dict(SWIGLU=swiglu, W_FP4=w_fp4)
                    monkeypatch.setattr(device_facts, "smem_limit", lambda: None)
                    unlimited = config_space.prune_grouped_gemm_configs(space, *args, **flags)
                    monkeypatch.setattr(device_facts, "smem_limit", lambda: limit)
                    kept = config_space.prune_grouped_gemm_configs(space, *args, **flags)
                    size = lambda c: config_space.smem_bytes(config_space.config_dict(c), swiglu, w_fp4)  # noqa: E731
                    assert kept and all(size(c) <= limit for c in kept), (n, k, m, w_fp4)
                    assert [c for c in unlimited if size(c) <= limit] == [c for c in kept if c in unlimited]
                    cut += len(unlimited) - len([c for c in kept if c in unlimited])
    assert cut  # the largest tiles of the space do not fit any of these GPUs


def _bad_cases(dev):
    G, M, K, N = 2, 4, 32, 32
    x = torch.zeros(G, M, K, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(G, N, K, dtype=torch.bfloat16, device=dev)
    cnt = torch.tensor([1, 2], dtype=torch.int32, device=dev)
    offs = torch.tensor([0, 1, 3], dtype=torch.int32, device=dev)
    xr = torch.zeros(3, K, dtype=torch.bfloat16, device=dev)
    wq = quantize_nvfp4(w.float() + 1, nvfp4_global_scale(w.float() + 1, per_slice=True))
    xq = quantize_nvfp4(x + 1)
    return [
        ("counts, offsets", lambda: grouped_gemm(x, w, counts=cnt, offsets=offs)),
        ("counts, offsets", lambda: grouped_gemm(x, w)),
        ("x.dtype", lambda: grouped_gemm(x.float(), w, counts=cnt)),
        ("type(x)", lambda: grouped_gemm(x.tolist(), w, counts=cnt)),
        ("x.shape", lambda: grouped_gemm(xr, w, counts=cnt)),
        ("x.shape", lambda: grouped_gemm(x, w, offsets=offs)),
        ("w.dtype", lambda: grouped_gemm(x, w.half(), counts=cnt)),
        ("w.shape", lambda: grouped_gemm(x, w[0], counts=cnt)),
        ("x.shape[-1]", lambda: grouped_gemm(x[..., :16].contiguous(), w, counts=cnt)),
        ("(K)", lambda: grouped_gemm(x[..., :8].contiguous(), w[..., :8].contiguous(), counts=cnt)),
        ("x.shape[0]", lambda: grouped_gemm(x[:1].contiguous(), w, counts=cnt[:1])),
        ("counts.shape", lambda: grouped_gemm(x, w, counts=cnt[:1])),
        ("counts.dtype", lambda: grouped_gemm(x, w, counts=cnt.float())),
        ("offsets.shape", lambda: grouped_gemm(xr, w, offsets=offs[:2])),
        ("offsets.dtype", lambda: grouped_gemm(xr, w, offsets=offs.to(torch.int16))),
        ("(N)", lambda: grouped_gemm(x, w[:, :17].contiguous(), counts=cnt, swiglu=True)),
        ("row_scale.dtype", lambda: grouped_gemm(x, w, counts=cnt, row_scale=torch.ones(G, M, device=dev).double())),
        ("row_scale.shape", lambda: grouped_gemm(x, w, counts=cnt, row_scale=torch.ones(G, M + 1, device=dev))),
        ("row_scale.shape", lambda: grouped_gemm(xr, w, offsets=offs, row_scale=torch.ones(4, device=dev))),
        ("out.shape", lambda: grouped_gemm(x, w, counts=cnt, out=torch.empty(G, M, N + 1, dtype=torch.bfloat16,
                                                                                  device=dev))),
        ("out.dtype", lambda: grouped_gemm(x, w, counts=cnt, out=torch.empty(G, M, N, dtype=torch.float16,
                                                                             device=dev))),
        ("x.swizzled", lambda: grouped_gemm(quantize_nvfp4(x + 1, swizzle=True), w, counts=cnt)),
        ("x.global_scale.shape", lambda: grouped_gemm(
            NvFp4Tensor(xq.data, xq.scales, torch.ones(G, device=dev), xq.shape), w, counts=cnt)),
        ("NvFp4Tensor.global_scale.numel()", lambda: grouped_gemm(
            x, NvFp4Tensor(wq.data, wq.scales, torch.ones(3, device=dev), wq.shape), counts=cnt)),
        ("NvFp4Tensor.data.shape", lambda: grouped_gemm(x, NvFp4Tensor(wq.data[..., :8], wq.scales, wq.global_scale, wq.shape),
                                        counts=cnt)),
        ("NvFp4Tensor.scales.dtype", lambda: grouped_gemm(x, NvFp4Tensor(wq.data, wq.scales.view(torch.uint8), wq.global_scale,
                                                         wq.shape), counts=cnt)),
        ("w2.shape", lambda: expert_mlp(x, torch.zeros(G, 2 * N, K, dtype=torch.bfloat16, device=dev), w[:, :16],
                                        counts=cnt)),
        ("w13.shape", lambda: expert_mlp(x, w[0], w, counts=cnt)),
        ("chain_ready", lambda: expert_mlp(x, w, w[:, :, :N // 2], counts=cnt,
                                           chain_ready=torch.zeros(G, dtype=torch.int64, device=dev))),
        ("chain_ready", lambda: expert_mlp(x, w, w[:, :, :N // 2], counts=cnt,
                                           chain_ready=torch.zeros(G + 1, dtype=torch.int32, device=dev))),
    ]


def test_bad_inputs_raise(dev):
    for what, call in _bad_cases(dev):
        with pytest.raises(MoEEpInputError) as e:
            call()
        assert what in str(e.value), (what, str(e.value))
        assert "allowed" in str(e.value)


def _tuned_file(tmp_path, table):
    """Writes ``table`` as this device's tuned-config file in tmp_path; the options that make the kernels read it."""
    (tmp_path / f"{device_facts.device_name()}.json").write_text(json.dumps(table))
    return options.override(config_dir=str(tmp_path))


_ODD = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SWAP_AB": False, "GROUP_M": 1, "num_warps": 2,
        "num_stages": 1}  # unlike any autotune config, so its use is visible


def test_tuned_config_file_overrides_autotune(dev, tmp_path):
    G, M, K, N = 3, 5, 64, 48
    x = torch.randn(G, M, K).bfloat16().to(dev)
    w = torch.randn(G, 2 * N, K).bfloat16().to(dev)
    cnt = torch.tensor([5, 1, 0], device=dev)
    other = dict(_ODD, BLOCK_N=32)
    with _tuned_file(tmp_path, {config_space.shape_class(N, K, False, True): {"16": _ODD, "256": other}}):
        path = str(tmp_path / f"{device_facts.device_name()}.json")
        assert plan_grouped_gemm(x, w, counts=cnt, swiglu=True).config == dict(_ODD, TMA=False)  # known before
        out, plan = grouped_gemm(x, w, counts=cnt, swiglu=True, return_plan=True)
        assert (plan.config_source, plan.config, plan.decoded, plan.config_file) == (
            "tuned-file", dict(_ODD, TMA=False), (False, False), path)
        ref = grouped_gemm_ref(x, w, counts=cnt, swiglu=True)
        assert (out[0, :5].float() - ref[0, :5]).norm() <= GEMM_TOL * ref[0, :5].norm()
        # nearest bucket; 100 -> 128: nearer 256 than 16 by ratio (16 by difference)
        for m_hint in (200, 100):
            _, plan = grouped_gemm(x, w, counts=cnt, swiglu=True, m_hint=m_hint, return_plan=True)
            assert plan.config == dict(other, TMA=False)
        _, plan = grouped_gemm(x, w[:, :N].contiguous(), counts=cnt, return_plan=True)  # another shape class
        assert plan.config_source == "autotune"


def test_tuned_file_stat_is_kept_briefly_and_dropped_by_invalidate(tmp_path, monkeypatch):
    """The tuned files are stat'ed at most every RESTAT_S per options (a forward asks on every call): a file written
    meanwhile is seen after RESTAT_S, or at once after ``invalidate`` (what ``moe-ep tune`` calls after a write)."""
    now = [1000.0]
    monkeypatch.setattr(tuned_files.time, "monotonic", lambda: now[0])
    path = tmp_path / f"{device_facts.device_name()}.json"
    with options.override(config_dir=str(tmp_path)):
        before = tuned_files.file_versions()
        assert str(path) not in dict(before)
        path.write_text("{}")
        assert tuned_files.file_versions() == before  # within RESTAT_S: the kept stat
        tuned_files.invalidate()
        seen = dict(tuned_files.file_versions())
        assert seen[str(path)] == path.stat().st_mtime
        path.unlink()
        now[0] += tuned_files.RESTAT_S
        assert str(path) not in dict(tuned_files.file_versions())  # past RESTAT_S: stat'ed again
    with options.override(config_dir=str(tmp_path)):  # other options: stat'ed for them
        path.write_text("{}")
        assert str(path) in dict(tuned_files.file_versions())


def test_search_off_launches_the_first_suitable_config_untimed(dev, tmp_path):
    G, K, N = 2, 64, 32
    x = torch.randn(5, K).bfloat16().to(dev)
    w = torch.randn(G, N, K).bfloat16().to(dev)
    offs = torch.tensor([0, 3, 5], device=dev)
    with options.override(config_dir=str(tmp_path), autotune="off"):  # an empty folder: no tuned file here
        out, plan = grouped_gemm(x, w, offsets=offs, return_plan=True)
        want = config_space.first_gemm_config(N, K, 3, G, False, False)  # m: ceil(S / G), the default m_hint
    assert (plan.config_source, plan.config, plan.decoded) == ("first-config", want, (False, False))
    ref = grouped_gemm_ref(x, w, offsets=offs)
    assert (out.float() - ref).norm() <= GEMM_TOL * ref.norm()


@pytest.mark.parametrize("table", [[1, 2], {config_space.shape_class(32, 32, False, False): {"16": {"BLOCK_M": 16}}},
                                   {config_space.shape_class(32, 32, False, False): {"16": dict(_ODD, BLOCK_N=24)}},
                                   {config_space.shape_class(32, 32, False, False): {"16": dict(_ODD, TMA="yes")}}])
def test_bad_tuned_config_file_raises(dev, tmp_path, table):
    x = torch.zeros(1, 2, 32, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(1, 32, 32, dtype=torch.bfloat16, device=dev)
    with _tuned_file(tmp_path, table), pytest.raises(MoEEpConfigError):
        grouped_gemm(x, w, counts=torch.tensor([2], device=dev))


def test_compile_checks_cover_every_variant():
    import triton
    from moe_ep.testing.compile_checks import grouped_gemm as grouped_gemm_checks
    seen = set()
    for fn, sig, const in grouped_gemm_checks():
        assert not isinstance(fn, triton.runtime.autotuner.Autotuner) and hasattr(fn, "arg_names")
        assert set(sig) == set(fn.arg_names)
        assert all(sig[k] == "constexpr" for k in const)
        seen.add(tuple(const[k] for k in ("RAGGED", "X_DECODED", "W_FP4", "SWIGLU", "HAS_RS", "SWAP_AB", "TMA", "FP8",
                                          "FP8_OUT")))
    want = {(r, xd, wf, s, not s, sw, 0, 0, 0)
            for r in (0, 1) for xd in (0, 1) for wf in (0, 1) for s in (0, 1) for sw in (0, 1)}
    want |= {(1, xd, 0, s, not s, 0, 1, 0, 0) for xd in (0, 1) for s in (0, 1)}  # TMA: ragged, bf16 w, not swapped
    # FP8: both layouts, GEMM1 with FP8 or bf16 output, GEMM2; swapped and not; TMA (ragged, not swapped)
    want |= {(r, 0, 0, s, not s, sw, 0, 1, o) for r in (0, 1) for s, o in ((1, 1), (1, 0), (0, 0)) for sw in (0, 1)}
    want |= {(1, 0, 0, s, not s, 0, 1, 1, o) for s, o in ((1, 1), (1, 0), (0, 0))}
    assert {tuple(bool(v) for v in t) for t in seen} == {tuple(bool(v) for v in t) for t in want}


@pytest.mark.parametrize("ragged", [False, True])
def test_nvfp4_rows_with_their_own_global_scales(dev, ragged):
    """Tokens from several ranks keep one global scale per row: rows 1000x apart must each stay accurate."""
    G, M, K, I = 2, 6, 64, 32
    gen = torch.Generator().manual_seed(1)
    scale = torch.tensor([1e-3, 1.0, 1e3])[torch.arange(G * M) % 3].reshape(G, M, 1)
    x = (torch.randn(G, M, K, generator=gen) * scale).bfloat16().to(dev)
    if ragged:
        x = x.reshape(G * M, K)
    xk, xr = gemm_operand(x, "nvfp4_rows")
    assert xk.global_scale.numel() == G * M
    w13 = _values((G, 2 * I, K), 0.3, 0.0, gen, dev)
    w2 = _values((G, K, I), 0.3, 0.0, gen, dev)
    idx = dict(offsets=torch.tensor([0, 5, 12], device=dev)) if ragged else dict(counts=torch.tensor([6, 4], device=dev))
    out = expert_mlp(xk, w13, w2, **idx)
    ref = expert_mlp_ref(xr, w13.float(), w2.float(), **idx)
    rows = out.reshape(-1, K)[: (12 if ragged else None)]
    refs = ref.reshape(-1, K)[: (12 if ragged else None)]
    keep = torch.ones(rows.shape[0], dtype=torch.bool) if ragged else \
        (torch.arange(M)[None, :] < torch.tensor([6, 4])[:, None]).reshape(-1)
    for r in torch.nonzero(keep).flatten().tolist():  # each row relative to its own size
        err = (rows[r].float() - refs[r]).norm() / refs[r].norm()
        assert err < MLP_TOL, (r, err.item())


# ---------------------------------------------------------------------------------------------------------------------
# Bad inputs (issue 18): each case is (name, call, expected). expected is (error type, message fragment), or
# ("safe", valid rows, reference): the call's output, poisoned with NaN before it, must match the reference on the
# valid rows and still hold the poison everywhere else (no row written that belongs to no expert or to another one).
# ---------------------------------------------------------------------------------------------------------------------

def _poisoned(*shape, dev):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=dev)


def _ragged_safe(dev, offsets, owned, S=10, dtype=torch.int64, x_fmt="bf16"):
    """A ragged call with ``offsets`` (whatever they are) whose safe result is expert g owning rows ``owned[g]``."""
    G, K, N = len(offsets) - 1, 32, 16
    gen = torch.Generator().manual_seed(len(offsets) + S)
    x = torch.randn(S, K, generator=gen).bfloat16().to(dev)
    w = (torch.randn(G, N, K, generator=gen) + 3 * torch.arange(G).view(G, 1, 1)).bfloat16().to(dev)  # unlike
    xk, xr = gemm_operand(x, x_fmt)
    fixed = torch.tensor([owned[0][0]] + [hi for _, hi in owned], device=dev)
    valid = torch.zeros(S, dtype=torch.bool, device=dev)
    for lo, hi in owned:
        valid[lo:hi] = True
    out = _poisoned(S, N, dev=dev)
    call = lambda: grouped_gemm(xk, w, offsets=torch.tensor(offsets, dtype=dtype, device=dev), out=out)  # noqa: E731
    return call, ("safe", out, valid, grouped_gemm_ref(xr, w, offsets=fixed))


def _masked_safe(dev, counts, rows, M=6, dtype=torch.int64, x_fmt="bf16", mlp=False):
    """A masked call with ``counts`` whose safe result is expert g computing its first ``rows[g]`` rows."""
    G, K, N = len(counts), 32, 32
    gen = torch.Generator().manual_seed(len(counts) + M)
    x = torch.randn(G, M, K, generator=gen).bfloat16().to(dev)
    w = (torch.randn(G, N, K, generator=gen) * 0.3).bfloat16().to(dev)
    xk, xr = gemm_operand(x, x_fmt)
    cnt = torch.tensor(counts, dtype=dtype, device=dev)
    safe = torch.tensor(rows, device=dev)
    valid = torch.arange(M, device=dev)[None, :] < safe[:, None]
    if mlp:  # w as w13 [G, 2I, H] with I = N / 2 and w2 [G, H, I]
        w2 = (torch.randn(G, K, N // 2, generator=gen) * 0.3).bfloat16().to(dev)
        out = _poisoned(G, M, K, dev=dev)
        call = lambda: expert_mlp(xk, w, w2, counts=cnt, out=out)  # noqa: E731
        return call, ("safe", out, valid, expert_mlp_ref(xr, w, w2, counts=safe))
    out = _poisoned(G, M, N, dev=dev)
    call = lambda: grouped_gemm(xk, w, counts=cnt, out=out)  # noqa: E731
    return call, ("safe", out, valid, grouped_gemm_ref(xr, w, counts=safe))


def _issue18_cases(dev):
    G, M, K, N = 2, 4, 32, 32
    x = torch.zeros(G, M, K, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(G, N, K, dtype=torch.bfloat16, device=dev)
    w13 = torch.zeros(G, 2 * N, K, dtype=torch.bfloat16, device=dev)
    w2 = torch.zeros(G, K, N, dtype=torch.bfloat16, device=dev)
    cnt = torch.tensor([1, 2], dtype=torch.int32, device=dev)
    xr = torch.zeros(3, K, dtype=torch.bfloat16, device=dev)
    big = 2 ** 31 + 5
    err = MoEEpInputError
    return [
        ("m_hint str", lambda: grouped_gemm(x, w, counts=cnt, m_hint="abc"), (err, "m_hint = 'abc'")),
        ("m_hint negative", lambda: grouped_gemm(x, w, counts=cnt, m_hint=-1), (err, "m_hint = -1")),
        ("m_hint zero", lambda: grouped_gemm(x, w, counts=cnt, m_hint=0), (err, "m_hint = 0")),
        ("m_hint bool", lambda: grouped_gemm(x, w, counts=cnt, m_hint=True), (err, "m_hint = True")),
        ("m_hint float", lambda: grouped_gemm(x, w, counts=cnt, m_hint=2.5), (err, "m_hint = 2.5")),
        ("mlp m_hint str", lambda: expert_mlp(x, w13, w2, counts=cnt, m_hint="abc"), (err, "m_hint = 'abc'")),
        ("swiglu str", lambda: grouped_gemm(x, w, counts=cnt, swiglu="yes"), (err, "swiglu = 'yes'")),
        ("swiglu int", lambda: grouped_gemm(x, w, counts=cnt, swiglu=1), (err, "swiglu = 1")),
        ("counts list", lambda: grouped_gemm(x, w, counts=[1, 2]), (err, "type(counts)")),
        ("offsets list", lambda: grouped_gemm(xr, w, offsets=[0, 1, 3]), (err, "type(offsets)")),
        ("w None", lambda: grouped_gemm(x, None, counts=cnt), (err, "type(w)")),
        ("row_scale list", lambda: grouped_gemm(x, w, counts=cnt, row_scale=[1.0] * 8), (err, "row_scale.dtype")),
        ("out list", lambda: grouped_gemm(x, w, counts=cnt, out=[]), (err, "out.dtype")),
        ("mlp no layout", lambda: expert_mlp(x, w13, w2), (err, "(counts, offsets)")),
        ("mlp x list", lambda: expert_mlp(x.tolist(), w13, w2, counts=cnt), (err, "type(x)")),
        # GEMM2's own arguments (its x, GEMM1's output, is not checked again; these are the caller's)
        ("mlp w2 fp32", lambda: expert_mlp(x, w13, w2.float(), counts=cnt), (err, "w.dtype")),
        ("mlp row_scale list", lambda: expert_mlp(x, w13, w2, counts=cnt, row_scale=[1.0] * 8),
         (err, "row_scale.dtype")),
        ("mlp row_scale shape", lambda: expert_mlp(x, w13, w2, counts=cnt, row_scale=torch.ones(G, M + 1, device=dev)),
         (err, "row_scale.shape")),
        ("mlp out shape", lambda: expert_mlp(x, w13, w2, counts=cnt, out=x[:, :, :16]), (err, "out.shape")),
        ("plan m_hint str", lambda: plan_grouped_gemm(x, w, counts=cnt, m_hint="abc"), (err, "m_hint = 'abc'")),
        ("config bad", lambda: grouped_gemm(x, w, counts=cnt, config=dict(_ODD, GROUP_M=0)),
         (MoEEpConfigError, "config.GROUP_M = 0")),
        # offsets going backwards: expert 2 would rewrite rows 3-4 of expert 0 (a race on a GPU); it gets rows 5-8
        ("offsets non-monotone", *_ragged_safe(dev, [0, 5, 3, 8], [(0, 5), (5, 5), (5, 8)])),
        ("offsets past S then back", *_ragged_safe(dev, [0, 12, 4, 10], [(0, 10), (10, 10), (10, 10)])),
        ("offsets negative", *_ragged_safe(dev, [-5, 2, 4], [(0, 2), (2, 4)], dtype=torch.int32)),
        ("offsets start late", *_ragged_safe(dev, [2, 4, 6], [(2, 4), (4, 6)])),
        ("offsets int64 >= 2^31", *_ragged_safe(dev, [0, big, big], [(0, 10), (10, 10)])),
        ("offsets int64 >= 2^31, nvfp4 x", *_ragged_safe(dev, [3, big, big], [(3, 10), (10, 10)], x_fmt="nvfp4")),
        ("counts int64 >= 2^31", *_masked_safe(dev, [big, 2], [6, 2])),
        ("counts past M_max", *_masked_safe(dev, [9, 1], [6, 1], dtype=torch.int32)),
        ("counts negative", *_masked_safe(dev, [-3, 2], [0, 2])),
        ("counts past M_max, nvfp4 x", *_masked_safe(dev, [1, big], [1, 6], x_fmt="nvfp4")),
        ("mlp counts int64 >= 2^31", *_masked_safe(dev, [2, big], [2, 6], mlp=True)),
    ]


_ISSUE18_NAMES = [c[0] for c in _issue18_cases(kernel_device())]  # built where the kernels run


@pytest.mark.parametrize("name", _ISSUE18_NAMES)
def test_bad_inputs_named_error_or_safe_result(dev, name):
    _, call, expected = next(c for c in _issue18_cases(dev) if c[0] == name)
    if expected[0] != "safe":
        exc, fragment = expected
        with pytest.raises(exc) as e:
            call()
        assert fragment in str(e.value) and "allowed" in str(e.value), str(e.value)
        return
    _, out, valid, ref = expected
    got = call()
    assert got is out
    tol = MLP_TOL if out.shape[-1] != ref.shape[-1] or name.startswith("mlp") else GEMM_TOL
    o, r = out[valid].float(), ref[valid].float()
    assert torch.isfinite(o).all() and (o - r).norm() <= tol * r.norm() + 1e-30, name
    assert torch.isnan(out[~valid].float()).all(), f"{name}: rows outside the safe result were written"


# Tuned-file schema (issue 18): (name, a change to a good config, key named in the message)
_SCHEMA_CASES = [
    ("GROUP_M 0", dict(GROUP_M=0), "GROUP_M"), ("num_warps 0", dict(num_warps=0), "num_warps"),
    ("num_warps -4", dict(num_warps=-4), "num_warps"), ("num_warps 3", dict(num_warps=3), "num_warps"),
    ("num_warps str", dict(num_warps="4"), "num_warps"), ("num_warps float", dict(num_warps=4.0), "num_warps"),
    ("num_warps 64", dict(num_warps=64), "num_warps"), ("num_stages 0", dict(num_stages=0), "num_stages"),
    ("num_stages bool", dict(num_stages=True), "num_stages"), ("SWAP_AB str", dict(SWAP_AB="false"), "SWAP_AB"),
    ("SWAP_AB int", dict(SWAP_AB=0), "SWAP_AB"), ("BLOCK_M str", dict(BLOCK_M="64"), "BLOCK_M"),
    ("BLOCK_N float", dict(BLOCK_N=64.0), "BLOCK_N"), ("BLOCK_K bool", dict(BLOCK_K=True), "BLOCK_K"),
    ("BLOCK_K 16", dict(BLOCK_K=16), "BLOCK_K"), ("GROUP_M float", dict(GROUP_M=8.0), "GROUP_M"),
    ("TMA str", dict(TMA="yes"), "TMA"), ("unknown key", dict(BLOCK_Q=16), "BLOCK_Q"),
    ("missing key", dict(num_stages=None), "num_stages"),
]


@pytest.mark.parametrize("name, change, key", _SCHEMA_CASES, ids=[c[0] for c in _SCHEMA_CASES])
def test_tuned_file_schema_rejects(dev, tmp_path, name, change, key):
    cfg = {k: v for k, v in dict(_ODD, **change).items() if v is not None}
    x = torch.zeros(1, 2, 32, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(1, 32, 32, dtype=torch.bfloat16, device=dev)
    shape = config_space.shape_class(32, 32, False, False)
    with _tuned_file(tmp_path, {shape: {"16": _ODD, "1024": cfg}}), pytest.raises(MoEEpConfigError) as e:
        grouped_gemm(x, w, counts=torch.tensor([2], device=dev), m_hint=16)  # another bucket's config: still checked
    msg = str(e.value)
    assert str(tmp_path) in msg and shape in msg and key in msg and "allowed" in msg, msg
    if key in change and change[key] is not None:
        assert repr(change[key]) in msg, msg


def test_tuned_file_config_too_large_for_shared_memory(dev, tmp_path, monkeypatch):
    """Tuned configs are held to the GPU's shared memory as the autotuner's are (a mocked limit on the CPU)."""
    x = torch.zeros(1, 2, 32, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(1, 64, 32, dtype=torch.bfloat16, device=dev)
    big = dict(_ODD, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_stages=4)
    need = config_space.smem_bytes(big, True, False)
    with _tuned_file(tmp_path, {config_space.shape_class(32, 32, False, True): {"16": big}}):
        monkeypatch.setattr(device_facts, "smem_limit", lambda: need - 1)
        with pytest.raises(MoEEpConfigError, match=f"{need} bytes of shared memory; allowed: at most {need - 1}"):
            grouped_gemm(x, w, counts=torch.tensor([2], device=dev), swiglu=True)
        monkeypatch.setattr(device_facts, "smem_limit", lambda: need)  # fits exactly: the same file is fine
        assert plan_grouped_gemm(x, w, counts=torch.tensor([2], device=dev), swiglu=True).config == dict(big, TMA=False)


@pytest.mark.parametrize("bucket", ["abc", "0", "-16", "1.5"])
def test_tuned_file_bad_bucket_key(dev, tmp_path, bucket):
    x = torch.zeros(1, 2, 32, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(1, 32, 32, dtype=torch.bfloat16, device=dev)
    with _tuned_file(tmp_path, {config_space.shape_class(32, 32, False, False): {bucket: _ODD}}), \
            pytest.raises(MoEEpConfigError, match=f"key {bucket!r}; allowed: a positive integer"):
        grouped_gemm(x, w, counts=torch.tensor([2], device=dev))


H200_SMEM = 227 * 1024  # device_facts.smem_limit() on an H200 (sm_90): what its shipped file must fit


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(tuned_files.SHIPPED_DIR) if f.endswith(".json")))
def test_shipped_tuned_files_hold_only_configs_their_shapes_can_run(name):
    # every entry as the loader checks it: its shape class's flags parsed from the key (which must be one the
    # kernels ask for), the FP8 rules for FP8 shapes, and the shared memory of the GPU the file is named after
    table = tuned_files.load_config_file(os.path.join(tuned_files.SHIPPED_DIR, name))
    assert table
    pattern = re.compile(r"n(\d+)_k(\d+)_x(bf16|fp8|nvfp4)_w(bf16|nvfp4|fp8)(_swiglu)?(_outfp8)?")
    for key, by_m in table.items():
        m = pattern.fullmatch(key)
        assert m, key
        n, k, fp8, w_fp4, swiglu, fp8_out = int(m[1]), int(m[2]), m[3] == "fp8", m[4] == "nvfp4", bool(m[5]), bool(m[6])
        sm100 = m[3] == "nvfp4"  # the sm_100 W4A4 kernel's keys
        assert config_space.shape_class(n, k, w_fp4, swiglu, fp8, fp8_out, sm100_fp4=sm100) == key
        for bucket, cfg in by_m.items():
            where = f"{name}[{key}][{bucket}]"
            assert int(bucket) == config_space.m_bucket(int(bucket)), where
            if sm100:
                tuned_files.validate_sm100(cfg, where, swiglu)
            else:
                tuned_files.validate(cfg, where, swiglu, w_fp4, H200_SMEM if "H200" in name else None, fp8=fp8,
                                     fp8_out=fp8_out)


def test_config_caches_stay_bounded():
    """Caches keyed by raw values are bounded: the first config by bucket (not the raw m), file versions by LRU."""
    config_space._first_gemm_config.cache_clear()
    for m in range(1, 300):
        config_space.first_gemm_config(32, 32, m, 2, False, False)
    assert config_space._first_gemm_config.cache_info().currsize == len({config_space.m_bucket(m)
                                                                         for m in range(1, 300)})
    for cached in (config_space._first_gemm_config, tuned_files._load_file, tuned_files._lookup):
        assert cached.cache_info().maxsize is not None


def test_plan_before_and_after_launch(dev):
    """The plan asked for before a launch is the plan launched (decided from sizes alone), autotuned configs aside."""
    x = torch.randn(2, 5, 32).bfloat16().to(dev)
    w = torch.randn(2, 32, 32).bfloat16().to(dev)
    cnt = torch.tensor([5, 2], device=dev)
    with options.override(autotune="off"):
        before = plan_grouped_gemm(x, w, counts=cnt, m_hint=8)
        _, after = grouped_gemm(x, w, counts=cnt, m_hint=8, return_plan=True)
    assert before == after and after.config_source == "first-config" and after.grid >= 1
    assert (after.layout, after.sizes, after.m_bucket, after.chain) == ("masked", (2, 32, 32, 5, 10), 8, "none")
    empty = plan_grouped_gemm(torch.zeros(0, 32, dtype=torch.bfloat16, device=dev), w,
                              offsets=torch.zeros(3, dtype=torch.int32, device=dev))
    assert (empty.config_source, empty.grid, empty.config) == ("no-launch", 0, None)


_GRID_SHAPES = [(False, 4, 1, 16), (False, 8, 700, 64), (False, 64, 4096, 32), (True, 8, 0, 2048), (True, 32, 0, 33),
                (True, 3, 0, 1)]  # (ragged, G, M_max, S): masked grids both ways, ragged ones of many sizes


@pytest.mark.parametrize("i", range(len(_SPACE)), ids=[f"config{i}" for i in range(len(_SPACE))])
def test_launch_takes_what_launch_kernels_heuristics_derive(monkeypatch, i):
    """The launcher launches the bare kernel with EVEN_K, PERSISTENT and the grid from the plan: for every config of
    the space, layouts, sizes, TMA both ways, they are what ``launch_kernel``'s heuristics and the grid function of
    an autotuned launch give (a mismatch would compile and launch another variant than a tuned file's)."""
    monkeypatch.setattr(device_facts, "tma_supported", lambda: True)
    for tma in (False, True):
        cfg = dict(_SPACE[i], TMA=tma)
        for ragged, G, M_max, S in _GRID_SHAPES:
            S = S if ragged else G * M_max
            for N, K, swiglu in ((40, 96, True), (256, 4096, False), (7168, 2048, True)):
                p = gemm_plan._with_config(gemm_plan.GemmPlan(
                    layout="ragged" if ragged else "masked", sizes=(G, N, K, M_max, S), m_bucket=256,
                    x_format="bf16", w_format="bf16", x_decoded=False, w_decoded=False, swiglu=swiglu,
                    row_scale=False, config=None, config_source="forced", config_file=None, tma_possible=tma,
                    tma=None, persistent=None, grid=None), cfg)
                full = dict(cfg, RAGGED=ragged, G=G, M_MAX=M_max, S=S, N=N, K=K, SWIGLU=swiglu)
                for name, fn in kernels.launch_kernel.values.items():
                    full[name] = fn(full)
                assert launcher._config_constexprs(p) == {k: full[k] for k in (*cfg, "EVEN_K", "PERSISTENT")}
                assert p.grid == schedule.grid_size(full, ragged, G, M_max, S, N, swiglu)


@pytest.mark.parametrize("shape, K", [((40, 96), 96), ((3, 24, 64), 64), ((2, 200, 32), 32)])
def test_descriptor_is_from_tensors(dev, shape, K):
    """The launcher's TMA descriptor (built without Triton's per-call checks) is the one ``from_tensor`` builds on
    the ``[rows, K]`` view: address, dtype, shape, strides, box and padding."""
    t = torch.randn(shape).bfloat16().to(dev)
    want = launcher.TensorDescriptor.from_tensor(t.view(-1, K), [16, 32])
    launcher._descriptor(t, K, (16, 32))  # (the first of a box is from_tensor's own)
    got = launcher._descriptor(t, K, (16, 32))
    assert isinstance(got, launcher.TensorDescriptor)
    assert (got.base.data_ptr(), got.base.dtype, tuple(got.shape), tuple(got.strides), got.block_shape,
            got.padding) == (want.base.data_ptr(), want.base.dtype, tuple(want.shape), tuple(want.strides),
                             want.block_shape, want.padding)
    for _ in range(2):  # a box Triton refuses is refused every time
        with pytest.raises(ValueError):
            launcher._descriptor(t, K, (16, 24))


@pytest.mark.parametrize("fact, stand_in", [("sm_count", lambda: 12345), ("smem_limit", lambda: 4096),
                                            ("tma_supported", lambda: False)])
def test_plan_key_follows_replaced_device_facts(monkeypatch, fact, stand_in):
    """The device's plan key is kept between calls, yet a device fact replaced (as tests stand in for a device) is
    seen at once, and the real one again once it is back: plans are never made for a device other than the one
    described."""
    real = device_facts.plan_key()
    assert device_facts.plan_key() is real  # kept: not read again
    at = {"tma_supported": 1, "smem_limit": 2, "sm_count": 3}[fact]
    monkeypatch.setattr(device_facts, fact, stand_in)
    key = device_facts.plan_key()
    assert key[at] == stand_in() and key[:at] + key[at + 1:] == real[:at] + real[at + 1:]
    monkeypatch.undo()
    assert device_facts.plan_key() == real
