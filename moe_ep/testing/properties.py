"""The property of each kernel and of the layer: run it on a case, run the reference, compare.

One check per target, shared by the property tests and ``moe-ep fuzz``: a check takes a case drawn by
:mod:`moe_ep.testing.strategies` and the device, and raises ``AssertionError`` (saying what differs) when the
kernel disagrees with :mod:`moe_ep.reference`. NVFP4 kernels and the bridge's integer outputs are compared bit
for bit; GEMMs, the reduce and the layer by relative Frobenius error ``||out - ref|| / ||ref||`` over the valid
rows, against the bound each one's formats allow (the tolerances below).

:data:`PROPERTIES` names every target with its case strategy and its check (``moe-ep fuzz --targets``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from . import strategies as S

GEMM_TOL = 1e-2
"""One grouped GEMM: the output is bf16 (2^-9 relative rounding) and the MMA inputs are bf16 (NVFP4 values times
E4M3 scales are exact in bf16), compared with the fp32 reference on the same (dequantized) operands."""

MLP_TOL = 2e-2
"""The expert MLP (two GEMMs): GEMM1's intermediate is also rounded to bf16 before GEMM2."""

FP8_DENSE_TOL = 0.12
"""The FP8 expert MLP against the dense one on the unquantized operands: x, the weights and the intermediate are each
rounded to e4m3 once (3 mantissa bits: 2^-4 relative per element at worst, about 2^-5.5 RMS)."""

REDUCE_TOL = 1e-5
"""The weighted unpermute-reduce in fp32: only the order of the fp32 multiply-adds differs."""

GLUON_FP32_TOL = 1e-4
"""The Gluon NVFP4 GEMM with fp32 output: the reference's function up to fp32 summation order and the global scale
applied to the sum rather than to each weight."""

LAYER_TOL = MLP_TOL
"""The layer with bf16 activations against the dense MoE on the same weights: the expert MLP's bound."""

LAYER_NVFP4_TOL = 0.3
"""The layer with NVFP4 activations: the tokens are quantized (about 0.1 relative error each), the dense
reference is not."""


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor, tol: float, what: str) -> None:
    """``out[valid]`` finite and within relative Frobenius error ``tol`` of ``ref[valid]`` (``valid``: a bool mask
    over the leading dims of both)."""
    o, r = out[valid].float().cpu(), ref[valid].float().cpu()
    assert torch.isfinite(o).all(), f"{what}: non-finite output"
    err, norm = (o - r).norm().item(), r.norm().item()
    assert err <= tol * norm + 1e-30, f"{what}: relative error {err / max(norm, 1e-30):.3e} > {tol}"


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The same shape and the same values (float8 scales compared as bytes)."""
    g, w = got.cpu(), want.cpu()
    if g.dtype == torch.float8_e4m3fn:
        g, w = g.view(torch.uint8), w.view(torch.uint8)
    if g.shape != w.shape or not torch.equal(g, w):
        shown = f": {g.tolist()} != {w.tolist()}" if g.numel() <= 16 else ""
        raise AssertionError(f"{what} differ from the reference{shown}")


# --- NVFP4 -------------------------------------------------------------------------------------------------


def _quant_input(c, dev):
    """(x, global scale or None) on the CPU and the same on ``dev``, of a :func:`~.strategies.quant_cases` case."""
    x = S.make_values((c["rows"], c["k"]), c["kind"], getattr(torch, c["dtype"]), c["seed"])
    gs = torch.tensor(370.0) if c["given_scale"] or not x.numel() else None
    return x, gs, x.to(dev), None if gs is None else gs.to(dev)


def check_quantize(c: dict, dev) -> None:
    """``quantize_nvfp4``: global scale, block scales and E2M1 codes bit-exact."""
    from ..kernels import nvfp4
    from ..reference import quantize_nvfp4_ref
    x, gs, xd, gsd = _quant_input(c, dev)
    q = nvfp4.quantize_nvfp4(xd, gsd)
    data, scales, gs_ref = quantize_nvfp4_ref(x, gs)
    assert_bits_equal(q.global_scale, gs_ref, "global scales")
    assert_bits_equal(q.linear_scales(), scales, "block scales")
    assert_bits_equal(q.data, data, "E2M1 codes")


def check_dequantize(c: dict, dev) -> None:
    """``dequantize_nvfp4`` of the kernel's own quantization: bit-exact values."""
    from ..kernels import nvfp4
    from ..reference import dequantize_nvfp4_ref
    _, _, xd, gsd = _quant_input(c, dev)
    q = nvfp4.quantize_nvfp4(xd, gsd)
    out = nvfp4.dequantize_nvfp4(q, torch.float32)
    assert_bits_equal(out, dequantize_nvfp4_ref(q.data.cpu(), q.scales.cpu(), q.global_scale.cpu()),
                      "dequantized values")


def check_gather_quantize(c: dict, dev) -> None:
    """``gather_quantize_nvfp4`` of random rows (-1: a zero row): codes and scales of quantize(gather)."""
    from ..kernels import nvfp4
    from ..reference import quantize_nvfp4_ref
    x, gs, xd, gsd = _quant_input(c, dev)
    g = torch.Generator().manual_seed(c["seed"] + 1)
    rows = torch.randint(-1 if x.shape[0] else 0, max(x.shape[0], 1), (c["gather"] if x.shape[0] else 0,),
                         generator=g)
    if gs is None:
        gs = quantize_nvfp4_ref(x)[2]
        gsd = gs.to(dev)
    q = nvfp4.gather_quantize_nvfp4(xd, rows.to(dev), gsd)
    src = torch.where(rows[:, None] >= 0, x[rows.clamp(min=0)], torch.zeros((), dtype=x.dtype))
    data, scales, _ = quantize_nvfp4_ref(src, gs)
    assert_bits_equal(q.data, data, "E2M1 codes of the gathered rows")
    assert_bits_equal(q.scales, scales, "block scales of the gathered rows")


STATIC_SCALE = 370.0
"""The static activation global scale the checks use when a case asks for a given scale."""


def check_quantize_tokens(c: dict, dev) -> None:
    """``quantize_nvfp4_tokens`` (one global scale per row, or one static scale) bit-exact with the reference, and
    batch invariant: row 0's codes, scales and global scale do not change when every other row is scaled by 64 (a
    large token, or an Inf one past bf16's range) and row 1 is NaN."""
    from ..kernels import nvfp4
    from ..reference import nvfp4_row_global_scale_ref, quantize_nvfp4_ref
    x = S.make_values((c["rows"], c["k"]), c["kind"], getattr(torch, c["dtype"]), c["seed"])
    static = STATIC_SCALE if c["given_scale"] else None
    q = nvfp4.quantize_nvfp4_tokens(x.to(dev), static)
    gs = nvfp4_row_global_scale_ref(x) if static is None else torch.full(x.shape[:-1], static)
    data, scales, _ = quantize_nvfp4_ref(x, gs)
    assert_bits_equal(q.global_scale, gs, "per-row global scales")
    assert_bits_equal(q.scales, scales, "block scales")
    assert_bits_equal(q.data, data, "E2M1 codes")
    if x.shape[0] < 2:
        return
    company = x * 64
    company[0] = x[0]
    company[1] = float("nan")
    q2 = nvfp4.quantize_nvfp4_tokens(company.to(dev), static)
    for part in ("data", "scales", "global_scale"):
        assert_bits_equal(getattr(q2, part)[0], getattr(q, part)[0],
                          f"row 0's {part} in other company (batch variance)")
    if static is None:  # a NaN token: codes 0 and a NaN scale, so it comes out NaN, not finite
        assert bool(torch.isnan(q2.global_scale[1].cpu())) and not bool(q2.data[1].any()), \
            "NaN token: NaN scale, codes 0"


# --- grouped GEMM ------------------------------------------------------------------------------------------


def check_grouped_gemm(c: dict, dev, m_hint="case") -> int:
    """``grouped_gemm`` of a :func:`~.strategies.gemm_cases` case into a NaN-poisoned output: within
    :data:`GEMM_TOL` on the experts' rows, rows of no expert left unwritten. ``m_hint`` overrides the case's.
    Returns the number of elements of x (0: there was nothing to compute)."""
    from ..kernels import grouped_gemm
    from ..reference import grouped_gemm_ref
    x, idx, valid, rows = S.make_gemm_operands(c, dev)
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    n_out = 2 * c["N"] if c["swiglu"] else c["N"]
    w = S.scaled_values((c["G"], n_out, c["K"]), 0.5, c["zero_frac"], gen).to(dev)
    xk, xr = S.gemm_operand(x, c["x_fmt"])
    wk, wr = S.gemm_operand(w, c["w_fmt"], per_slice=True)
    rs = torch.rand(rows, generator=gen).to(dev) if c["row_scale"] else None
    out = torch.full((*rows, c["N"]), float("nan"), dtype=torch.bfloat16, device=dev)
    got = grouped_gemm(xk, wk, **idx, swiglu=c["swiglu"], row_scale=rs, out=out,
                       m_hint=c["m_hint"] if m_hint == "case" else m_hint)
    assert got is out, "grouped_gemm did not return its out= tensor"
    ref = grouped_gemm_ref(xr, wr, **idx, swiglu=c["swiglu"], row_scale=rs)
    assert_rel_close(out, ref, valid, GEMM_TOL, "grouped_gemm")
    assert torch.isnan(out[~valid].float()).all(), "grouped_gemm wrote rows outside the experts' counts"
    return x.numel()


def check_fp8_grouped_gemm(c: dict, dev) -> None:
    """``grouped_gemm`` of FP8 x FP8 (x per token, w per 128x128 block) on a :func:`~.strategies.fp8_gemm_cases` case,
    its forced config (or the plan's) into a poisoned output: within :data:`GEMM_TOL` of the fp32 reference on the
    dequantized operands (e4m3 products are exact in fp32), rows of no expert left unwritten."""
    from ..kernels import grouped_gemm
    from ..reference import grouped_gemm_ref
    x, idx, valid, rows = S.make_gemm_operands(c, dev)
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    n_out = 2 * c["N"] if c["swiglu"] else c["N"]
    xq, xr = S.fp8_operand(x, 1)
    wq, wr = S.fp8_operand(S.scaled_values((c["G"], n_out, c["K"]), 0.5, c["zero_frac"], gen).to(dev), 128,
                           gate_up=c["swiglu"])
    rs = torch.rand(rows, generator=gen).to(dev) if c["row_scale"] else None
    out = torch.full((*rows, c["N"]), float("nan"), dtype=torch.bfloat16, device=dev)
    got = grouped_gemm(xq, wq, **idx, swiglu=c["swiglu"], row_scale=rs, out=out, m_hint=c["m_hint"],
                       config=c["config"])
    assert got is out, "grouped_gemm did not return its out= tensor"
    assert_rel_close(out, grouped_gemm_ref(xr, wr, **idx, swiglu=c["swiglu"], row_scale=rs), valid, GEMM_TOL,
                     "FP8 grouped_gemm")
    assert torch.isnan(out[~valid].float()).all(), "FP8 grouped_gemm wrote rows outside the experts' counts"


def check_fp8_expert_mlp(c: dict, dev) -> None:
    """``expert_mlp`` with FP8 weights of a ``fp8_gemm_cases(mlp=True)`` case (bf16 x, quantized per token inside;
    GEMM1's FP8 output into GEMM2) into a poisoned output: within :data:`MLP_TOL` of ``expert_mlp_fp8_ref`` on the
    dequantized operands and within :data:`FP8_DENSE_TOL` of the dense MLP on the unquantized ones, rows of no
    expert left unwritten."""
    from ..kernels import expert_mlp
    from ..reference import dequantize_fp8_ref, expert_mlp_fp8_ref, expert_mlp_ref, quantize_fp8_ref
    H, I = c["K"], c["N"]
    x, idx, valid, rows = S.make_gemm_operands(c, dev)
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    w13, w2 = (S.scaled_values(shape, 0.3, 0.0, gen).to(dev) for shape in ((c["G"], 2 * I, H), (c["G"], H, I)))
    q13, r13 = S.fp8_operand(w13, 128, gate_up=True)
    q2, r2 = S.fp8_operand(w2, 128)
    rs = torch.rand(rows, generator=gen).to(dev) if c["row_scale"] else None
    out = torch.full((*rows, H), float("nan"), dtype=torch.bfloat16, device=dev)
    expert_mlp(x, q13, q2, **idx, row_scale=rs, out=out, m_hint=c["m_hint"])
    xr = dequantize_fp8_ref(*quantize_fp8_ref(x, 1), 1)
    assert_rel_close(out, expert_mlp_fp8_ref(xr, r13, r2, **idx, row_scale=rs), valid, MLP_TOL, "FP8 expert_mlp")
    assert_rel_close(out, expert_mlp_ref(x, w13, w2, **idx, row_scale=rs), valid, FP8_DENSE_TOL,
                     "FP8 expert_mlp against the unquantized operands")
    assert torch.isnan(out[~valid].float()).all(), "FP8 expert_mlp wrote rows outside the experts' counts"


def check_expert_mlp(c: dict, dev) -> None:
    """``expert_mlp`` (GEMM1 + SwiGLU, GEMM2) of a ``gemm_cases(mlp=True)`` case (K = H, N = I) into a poisoned
    output: within :data:`MLP_TOL` on the experts' rows, rows of no expert left unwritten."""
    from ..kernels import expert_mlp
    from ..reference import expert_mlp_ref
    H, I = c["K"], c["N"]
    x, idx, valid, rows = S.make_gemm_operands(c, dev)
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    w13k, w13r = S.gemm_operand(S.scaled_values((c["G"], 2 * I, H), 0.3, 0.0, gen).to(dev), c["w_fmt"],
                                per_slice=True)
    w2k, w2r = S.gemm_operand(S.scaled_values((c["G"], H, I), 0.3, 0.0, gen).to(dev), c["w_fmt"], per_slice=True)
    xk, xr = S.gemm_operand(x, c["x_fmt"])
    rs = torch.rand(rows, generator=gen).to(dev) if c["row_scale"] else None
    out = torch.full((*rows, H), float("nan"), dtype=torch.bfloat16, device=dev)
    expert_mlp(xk, w13k, w2k, **idx, row_scale=rs, out=out, m_hint=c["m_hint"])
    ref = expert_mlp_ref(xr, w13r, w2r, **idx, row_scale=rs)
    assert_rel_close(out, ref, valid, MLP_TOL, "expert_mlp")
    assert torch.isnan(out[~valid].float()).all(), "expert_mlp wrote rows outside the experts' counts"


def check_gluon_nvfp4_gemm(c: dict, dev) -> None:
    """The Gluon NVFP4-weight grouped GEMM (sm_90a) of a :func:`~.strategies.gluon_nvfp4_cases` case, at the case's
    decode and launch (``LAUNCH_SWEEP``), into a NaN-poisoned output: within :data:`GEMM_TOL` (bf16 output) or
    :data:`GLUON_FP32_TOL` (fp32 output) of the fp32 reference on the dequantized weights, and within the same bound
    of the ``tl`` kernel (``grouped_gemm``, the dispatcher's path for these operands); rows of no expert left
    unwritten."""
    from ..kernels import grouped_gemm
    from ..kernels.grouped_gemm import gluon_nvfp4
    from ..reference import dequantize_nvfp4_ref, grouped_gemm_ref
    x, w, offsets, valid, _ = _nvfp4_weight_problem(c, c["N"], dev)
    rows = x.shape[0]
    out_dtype = getattr(torch, c["out_dtype"])
    stages, maxnreg, overlap = gluon_nvfp4.LAUNCH_SWEEP[c["launch"]]
    out = torch.full((rows, c["N"]), float("nan"), dtype=out_dtype, device=dev)
    got = gluon_nvfp4.gluon_nvfp4_grouped_gemm(x, w, offsets, out_dtype=out_dtype, tokens_per_expert=c["hint"],
                                               out=out, fast_decode=c["fast_decode"], stages=stages,
                                               maxnreg=maxnreg, overlap=overlap)
    assert got is out, "gluon_nvfp4_grouped_gemm did not return its out= tensor"
    tol = GLUON_FP32_TOL if out_dtype == torch.float32 else GEMM_TOL
    ref = grouped_gemm_ref(x.float().cpu(), dequantize_nvfp4_ref(w.data.cpu(), w.scales.cpu(),
                                                                  w.global_scale.cpu()), offsets=offsets.cpu())
    out = out.cpu()
    assert_rel_close(out, ref, valid, tol, "gluon_nvfp4_grouped_gemm")
    tl_out = grouped_gemm(x, w, offsets=offsets).cpu()
    assert_rel_close(out, tl_out, valid, GEMM_TOL, "gluon_nvfp4_grouped_gemm against the tl kernel")
    assert torch.isnan(out[~valid].float()).all(), "gluon_nvfp4_grouped_gemm wrote rows outside the experts' counts"


def gluon_nvfp4_unavailable() -> str | None:
    """Why the Gluon kernel cannot run here (it needs an sm_90 GPU), or None."""
    from ..kernels.grouped_gemm import gluon_nvfp4
    return gluon_nvfp4.unavailable_reason()


def _nvfp4_weight_problem(c: dict, w_rows: int, dev):
    """The operands both Gluon NVFP4-weight cases draw, in this order from the case's seed: ragged bf16 x of the case's
    counts and padding rows, NVFP4 weights ``[G, w_rows, K]`` (one global scale, or one per expert), int32 offsets,
    the rows within the experts, and the generator (for what a case draws after)."""
    from ..kernels import nvfp4
    gen = torch.Generator().manual_seed(c["seed"])
    offs = S.offsets_of(c["counts"])
    rows = offs[-1] + c["pad"]
    x = S.scaled_values((rows, c["K"]), c["scale"], c["zero_frac"], gen).to(dev)
    w = S.scaled_values((c["G"], w_rows, c["K"]), 0.5, c["zero_frac"], gen).to(dev)
    w = nvfp4.quantize_nvfp4(w, None if c["one_gs"] else nvfp4.nvfp4_global_scale(w, per_slice=True))
    offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
    return x, w, offsets, torch.arange(rows) < offs[-1], gen


def gluon_nvfp4_prefill_problem(c: dict, dev):
    """A :func:`~.strategies.gluon_nvfp4_prefill_cases` case's operands: bf16 x, NVFP4 weights (w13 of 2N rows with
    ``swiglu``), the layout as keyword arguments (``offsets``, or with ``masked`` the ``counts`` of x ``[G, M_max,
    K]``: the ragged rows of each expert at the start of its block, the block's other rows drawn too; int32), the
    routing weights or None, the rows within the experts, and the fp32 reference on the dequantized weights (SwiGLU of
    it for GEMM1, times the routing weights for GEMM2)."""
    from ..reference import dequantize_nvfp4_ref, grouped_gemm_ref
    x, w, offsets, valid, gen = _nvfp4_weight_problem(c, 2 * c["N"] if c["swiglu"] else c["N"], dev)
    layout = dict(offsets=offsets)
    if c.get("masked"):
        counts = c["counts"]
        m_max = max(counts, default=0) + c["pad"]
        xm = S.scaled_values((c["G"], m_max, c["K"]), c["scale"], c["zero_frac"], gen).to(dev)
        for g, (lo, n) in enumerate(zip(S.offsets_of(counts), counts)):
            xm[g, :n] = x[lo:lo + n]
        x, valid = xm, torch.arange(m_max)[None, :] < torch.tensor(counts)[:, None]
        layout = dict(counts=torch.tensor(counts, dtype=torch.int32, device=dev))
    rs = (torch.rand(tuple(x.shape[:-1]), generator=gen) + 0.5).to(dev) if c["rs"] else None
    ref = grouped_gemm_ref(x.float(), dequantize_nvfp4_ref(w.data, w.scales, w.global_scale), **layout,
                           row_scale=rs, swiglu=c["swiglu"])
    return x, w, layout, rs, valid, ref


def check_gluon_nvfp4_prefill_gemm(c: dict, dev, problem=None) -> None:
    """The Gluon NVFP4-weight prefill GEMM (sm_90a) of a :func:`~.strategies.gluon_nvfp4_prefill_cases` case, GEMM2's
    form or GEMM1's, ragged or masked, at the case's token tile, into a NaN-poisoned bf16 output: within
    :data:`GEMM_TOL` of the fp32 reference on the dequantized weights, and of the ``tl`` kernel on the same operands
    (``grouped_gemm`` with the Gluon path off); rows of no expert left unwritten. ``problem``:
    :func:`gluon_nvfp4_prefill_problem`'s tuple, when the caller made it."""
    from .. import options
    from ..kernels import grouped_gemm
    from ..kernels.grouped_gemm import gluon_nvfp4_prefill as gp
    x, w, layout, rs, valid, ref = gluon_nvfp4_prefill_problem(c, dev) if problem is None else problem
    out = torch.full((*x.shape[:-1], c["N"]), float("nan"), dtype=torch.bfloat16, device=dev)
    if c["swiglu"]:
        got = gp.gluon_nvfp4_prefill_swiglu_grouped_gemm(x, w, **layout, out=out, block_t=c["block_t"])
    else:
        got = gp.gluon_nvfp4_prefill_grouped_gemm(x, w, **layout, row_scale=rs, out=out, block_t=c["block_t"])
    assert got is out, "gluon_nvfp4_prefill did not return its out= tensor"
    assert_rel_close(out, ref, valid, GEMM_TOL, "gluon_nvfp4_prefill")
    with options.override(gluon_nvfp4_min_m="off"):
        tl_out = grouped_gemm(x, w, **layout, row_scale=rs, swiglu=c["swiglu"])
    assert_rel_close(out, tl_out, valid, 2 * GEMM_TOL, "gluon_nvfp4_prefill against the tl kernel")
    assert torch.isnan(out[~valid].float()).all(), "gluon_nvfp4_prefill wrote rows outside the experts' counts"


def gluon_nvfp4_prefill_unavailable() -> str | None:
    """Why the Gluon prefill kernel cannot run here (it needs an sm_90 GPU), or None."""
    from ..kernels.grouped_gemm import gluon_nvfp4_prefill
    return gluon_nvfp4_prefill.unavailable_reason()


GLUON_FP8_TL_TOL = 2 * GEMM_TOL
"""The Gluon FP8 GEMM against the tl FP8 GEMM on the same operands: the sum of the two kernels' bounds (each within
:data:`GEMM_TOL` of the same fp32 result)."""


def gluon_fp8_problem(c: dict, dev):
    """A :func:`~.strategies.gluon_fp8_cases` case's FP8 operands (quantized by the reference), offsets, the covered
    rows ``(lo, hi)``, the row scale (or None) and the fp32 reference of the covered rows on the dequantized
    operands: GEMM2's product, or with ``swiglu`` (GEMM1: w13 ``[G, 2N, K]``, gate's and up's scale blocks apart) the
    fp32 SwiGLU values before their quantization."""
    from ..kernels.fp8 import Fp8Tensor
    from ..reference import dequantize_fp8_ref, grouped_gemm_ref, quantize_fp8_ref
    gen = torch.Generator().manual_seed(c["seed"])
    G, N, K, swiglu = c["G"], c["N"], c["K"], c.get("swiglu", False)
    offs = S.offsets_of(c["counts"], c["lead"])
    M = offs[-1] + c["pad"]
    x = S.scaled_values((M, K), c["scale"], c["zero_frac"], gen).to(dev)
    w = S.scaled_values((G, 2 * N if swiglu else N, K), K ** -0.5, c["zero_frac"], gen).to(dev)
    x8 = Fp8Tensor(*quantize_fp8_ref(x, 1), 1)
    w8 = Fp8Tensor(*quantize_fp8_ref(w, 128, swiglu), 128, swiglu)
    rs = (torch.rand(M, generator=gen) + 0.5).to(dev) if c["row_scale"] else None
    offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
    ref = grouped_gemm_ref(dequantize_fp8_ref(x8.data, x8.scales, 1),
                           dequantize_fp8_ref(w8.data, w8.scales, 128, swiglu), offsets=offsets, swiglu=swiglu,
                           row_scale=rs)
    return x8, w8, offsets, (offs[0], offs[-1]), rs, ref[offs[0]:offs[-1]]


def check_gluon_fp8_gemm(c: dict, dev, problem=None, against_tl: bool = True) -> None:
    """The Gluon FP8 block-scaled grouped GEMM (sm_90a) of a :func:`~.strategies.gluon_fp8_cases` case in its variant,
    into a NaN-poisoned bf16 output: the covered rows finite and within :data:`GEMM_TOL` of the fp32 reference on the
    dequantized operands (the products of two e4m3 values are exact in fp32: the kernel computes that function up
    to the summation order, the tensor core's FP8 accumulation within one 128-wide K block and the bf16 output),
    within :data:`GLUON_FP8_TL_TOL` of the tl FP8 GEMM (``against_tl``), and the rows of no expert left unwritten.
    ``problem``: :func:`gluon_fp8_problem`'s tuple, when the caller made it."""
    from ..kernels.grouped_gemm import gluon_fp8
    x8, w8, offsets, (lo, hi), rs, ref = gluon_fp8_problem(c, dev) if problem is None else problem
    variant = c["variant"]
    out = torch.full((x8.shape[0], c["N"]), float("nan"), dtype=torch.bfloat16, device=x8.device)
    got = gluon_fp8.gluon_fp8_grouped_gemm(x8, w8, offsets, row_scale=rs, out=out, variant=variant)
    assert got is out, "gluon_fp8_grouped_gemm did not return its out= tensor"
    o = out[lo:hi].float()
    assert torch.isfinite(o).all(), f"{variant}: a covered row was not written (or is not finite)"
    err, norm = (o - ref).norm().item(), ref.norm().item()
    assert err <= GEMM_TOL * norm + 1e-30, f"{variant}: rel err {err / max(norm, 1e-30):.3e} > {GEMM_TOL}"
    assert torch.isnan(out[:lo].float()).all() and torch.isnan(out[hi:].float()).all(), \
        f"{variant}: rows of no expert written"
    if against_tl:
        t = _tl_fp8_gemm(x8, w8, offsets, rs, False)[lo:hi].float()
        diff, tn = (o - t).norm().item(), t.norm().item()
        assert diff <= GLUON_FP8_TL_TOL * tn + 1e-30, (
            f"{variant}: rel diff to the tl FP8 GEMM {diff / max(tn, 1e-30):.3e} > {GLUON_FP8_TL_TOL}")


def _tl_fp8_gemm(x8, w8, offsets, rs, swiglu: bool):
    """The tl FP8 grouped GEMM of the same operands in its first config (no tuning run per drawn shape; the
    dispatcher's Gluon path off): GEMM2's bf16 rows, or with ``swiglu`` GEMM1's FP8 output (an Fp8Tensor)."""
    from .. import options
    from ..kernels import grouped_gemm
    from ..kernels.grouped_gemm import plan as gemm_plan
    gemm_plan.clear_cache()
    with options.override(autotune="off", gluon_fp8_min_m="off"):
        out, plan = grouped_gemm(x8, w8, offsets=offsets, row_scale=rs, swiglu=swiglu, quantize_out=swiglu,
                                 return_plan=True)
    assert plan.path == "tl", f"the tl FP8 GEMM was asked for, {plan.path} ran"
    return out


GLUON_FP8_SWIGLU_TOL = GLUON_FP8_TL_TOL
"""The Gluon FP8 GEMM1's dequantized output against that of the reference's quantization of the fp32 SwiGLU values
(``swiglu_fp8_ref``), and against the tl FP8 GEMM1's: both sides are quantized by one rule, so they differ only
where a value's fp32 sums (their order, the tensor core's FP8 accumulation within a 128-wide K block) put it on the
other side of a rounding boundary: one code step (2^-4 to 2^-3 of the value where normal) for a fraction of the
codes about the sums' relative error over the step, a relative norm near 1e-3 where the sums agree to 1e-4; the
bound leaves room for sums ten times further apart."""

GLUON_FP8_SCALE_TOL = 1e-2
"""Its scales (a row block's amax / 448, one IEEE division on both sides) against the other's: relative, each, on
top of what the block's amax may move by with its sums' error (:func:`swiglu_amax_error`). The amax is the block's
largest SwiGLU value, and within a 128-wide K block Hopper's FP8 MMA adds its products with fewer mantissa bits than
fp32 (the reason the K blocks are promoted at all), so where a row's gate or up sum cancels, its relative error grows
past the 1e-4 of a typical sum: 3.8e-3 seen on the H200 (64 rows of one K block, 8 channels a block); the bound
leaves room for about three times that. A scale off by it moves the block's values by as much, within
:data:`GLUON_FP8_SWIGLU_TOL`."""

FP8_MMA_SUM_EPS = 2.0 ** -14
"""The error of an FP8 tensor-core sum relative to the sum of its products' magnitudes: Hopper's FP8 MMA keeps about
14 bits while it adds the products of one K block (DeepSeek-V3's report; the reason the K blocks are promoted to
fp32 at all). Where a block's amax is the SwiGLU value of a very negative gate, ``silu(g) ~ g e^g`` turns that
absolute error of g into a relative error of the value: 1.3e-2 seen on the H200 at g = -8.4 over 512 products of
magnitude 4.3e3 in all (an error of g about 2^-18 of that)."""

GLUON_FP8_SAME_CODES = 0.75
"""The fraction of its codes at least identical to the other's: a code crosses a rounding boundary only where its
sums differ by a fraction of a code step (see :data:`GLUON_FP8_SWIGLU_TOL`), yet a block of a few channels has few
codes (one step in a row of 8 is an eighth of them: seen on the H200), while a wrong rounding rule (truncation, no
saturation) changes about half."""


def fp8_gemm1_sums(x8, w8, offsets, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(GEMM1's fp32 sums ``x @ w^T`` of rows ``lo:hi`` on the dequantized FP8 operands, the sums of their products'
    magnitudes ``|x| @ |w|^T``): gate columns then up columns each."""
    from ..reference import dequantize_fp8_ref, grouped_gemm_ref
    # (where the operands are, as gluon_fp8_problem's reference: the benchmark shapes' sums are large)
    x = dequantize_fp8_ref(x8.data, x8.scales, 1)
    w = dequantize_fp8_ref(w8.data, w8.scales, 128, True)
    return (grouped_gemm_ref(x, w, offsets=offsets)[lo:hi],
            grouped_gemm_ref(x.abs(), w.abs(), offsets=offsets)[lo:hi])


def swiglu_amax_error(x8, w8, offsets, lo: int, hi: int) -> torch.Tensor:
    """How far each row block's amax of GEMM1's SwiGLU values (rows ``lo:hi``, ``[R, ceil(I / 128)]``) may move
    when its gate and up sums carry an FP8 MMA's error: ``e = FP8_MMA_SUM_EPS * (|x| @ |w|^T)`` per sum
    (:data:`FP8_MMA_SUM_EPS`), to first order ``|silu'(g)| |u| e_g + |silu(g)| e_u`` per value, and an amax moves by
    at most its block's largest such bound."""
    sums, magnitudes = fp8_gemm1_sums(x8, w8, offsets, lo, hi)
    gate, up = sums.chunk(2, dim=-1)
    e_gate, e_up = (FP8_MMA_SUM_EPS * magnitudes).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    d_silu = sig * (1 + gate * (1 - sig))
    bound = d_silu.abs() * up.abs() * e_gate + torch.nn.functional.silu(gate).abs() * e_up
    R, I = bound.shape
    blocks = -(-I // 128)
    padded = bound.new_zeros(R, blocks * 128)
    padded[:, :I] = bound
    return padded.view(R, blocks, 128).amax(dim=-1).cpu()


def assert_fp8_rows_close(q, s, q_ref, s_ref, what: str, amax_err: torch.Tensor | None = None) -> None:
    """FP8 activations (codes ``[R, I]``, scales ``[R, ceil(I / 128)]``) against others of the same rows: finite
    scales each within :data:`GLUON_FP8_SCALE_TOL` of the other's plus ``amax_err / 448`` (``[R, ceil(I / 128)]``,
    how far each block's amax may move with its sums' error: :func:`swiglu_amax_error`; None: 0), dequantized values
    within :data:`GLUON_FP8_SWIGLU_TOL` relative Frobenius error, at least :data:`GLUON_FP8_SAME_CODES` of the codes
    identical."""
    from ..reference import dequantize_fp8_ref
    q, s, q_ref, s_ref = (t.cpu() for t in (q, s, q_ref, s_ref))
    v, v_ref = dequantize_fp8_ref(q, s, 1), dequantize_fp8_ref(q_ref, s_ref, 1)
    assert torch.isfinite(s).all() and torch.isfinite(v).all(), f"{what}: a covered row was not written (or is NaN)"
    err, norm = (v - v_ref).norm().item(), v_ref.norm().item()
    assert err <= GLUON_FP8_SWIGLU_TOL * norm + 1e-30, \
        f"{what}: rel err {err / max(norm, 1e-30):.3e} > {GLUON_FP8_SWIGLU_TOL}"
    slack = 0.0 if amax_err is None else amax_err.cpu() / 448.0
    worst = ((s - s_ref).abs() - slack).div(s_ref).max().item() if s.numel() else 0.0
    assert worst <= GLUON_FP8_SCALE_TOL, \
        f"{what}: a scale's rel diff past its sums' error {worst:.3e} > {GLUON_FP8_SCALE_TOL}"
    same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item() if q.numel() else 1.0
    assert same >= GLUON_FP8_SAME_CODES, f"{what}: only {same:.3f} of the codes identical (< {GLUON_FP8_SAME_CODES})"


def check_gluon_fp8_swiglu_gemm(c: dict, dev, problem=None, against_tl: bool = True) -> None:
    """The Gluon FP8 GEMM1 (SwiGLU, FP8 out; sm_90a) of a ``gluon_fp8_cases(swiglu=True)`` case in its variant, into
    NaN-poisoned codes and scales: the covered rows against ``swiglu_fp8_ref`` of the fp32 reference's SwiGLU values
    and (``against_tl``) against the tl FP8 GEMM1's output, by :func:`assert_fp8_rows_close`; the rows of no expert
    left unwritten. ``problem``: :func:`gluon_fp8_problem`'s tuple (``swiglu``), when the caller made it."""
    from ..kernels.fp8 import Fp8Tensor, fp8_scales_shape
    from ..kernels.grouped_gemm import gluon_fp8
    from ..reference import swiglu_fp8_ref
    x8, w8, offsets, (lo, hi), _, h = gluon_fp8_problem(c, dev) if problem is None else problem
    variant, M, I = c["variant"], x8.shape[0], c["N"]
    nan_code = torch.full((M, I), 0x7F, dtype=torch.uint8, device=x8.device).view(torch.float8_e4m3fn)
    out = Fp8Tensor(nan_code, torch.full(fp8_scales_shape((M, I), 1), float("nan"), device=x8.device), 1)
    got = gluon_fp8.gluon_fp8_swiglu_grouped_gemm(x8, w8, offsets, out=out, variant=variant)
    assert got is out, "gluon_fp8_swiglu_grouped_gemm did not return its out= Fp8Tensor"
    for part in (out.data.float(), out.scales):
        assert torch.isnan(part[:lo]).all() and torch.isnan(part[hi:]).all(), f"{variant}: rows of no expert written"
    q, s = out.data[lo:hi], out.scales[lo:hi]
    amax_err = swiglu_amax_error(x8, w8, offsets, lo, hi)
    assert_fp8_rows_close(q, s, *swiglu_fp8_ref(h), f"{variant} against the reference", amax_err)
    if against_tl:  # both kernels' sums carry the error
        t = _tl_fp8_gemm(x8, w8, offsets, None, True)
        assert_fp8_rows_close(q, s, t.data[lo:hi], t.scales[lo:hi], f"{variant} against the tl FP8 GEMM1",
                              2 * amax_err)


def gluon_fp8_unavailable() -> str | None:
    """Why the Gluon FP8 kernel cannot run here (it needs an sm_90 GPU), or None."""
    from ..kernels.grouped_gemm import gluon_fp8
    return gluon_fp8.unavailable_reason()


# --- bridge ------------------------------------------------------------------------------------------------


def _route(c, dev):
    from ..kernels import bridge
    idx, valid = S.make_route(c)
    r = bridge.route_experts(idx.to(dev), c["L"], valid_rows=None if valid is None else valid.to(dev),
                             rows_per_group=c["group"])
    return idx, valid, r


def check_route(c: dict, dev) -> None:
    """``route_experts`` of a :func:`~.strategies.route_cases` case: counts, offsets, slots, rows exact."""
    from ..reference import route_experts_ref
    idx, valid, r = _route(c, dev)
    ref = route_experts_ref(idx, c["L"], valid, c["group"])
    for name, got, want in zip(("counts", "offsets", "slot", "row_of_slot"),
                               (r.counts, r.offsets, r.slot, r.row_of_slot), ref):
        assert torch.equal(got.cpu(), want.cpu()), f"route {name} differs: {got.tolist()} != {want.tolist()}"


def check_permute(c: dict, dev) -> None:
    """``permute_rows`` of a route case: the routed rows exact."""
    from ..kernels import bridge
    from ..reference import permute_rows_ref
    _, _, r = _route(c, dev)
    x = torch.randn(c["M"], c["H"], generator=torch.Generator().manual_seed(c["seed"])).to(torch.bfloat16)
    total = int(r.offsets[-1])
    out = bridge.permute_rows(x.to(dev), r)[:total]
    assert_bits_equal(out, permute_rows_ref(x, r.row_of_slot.cpu(), total), "permuted rows")


def check_unpermute_reduce(c: dict, dev) -> None:
    """``unpermute_reduce`` (fp32 out) of a route case, weighted or not: within :data:`REDUCE_TOL`."""
    from ..kernels import bridge
    from ..reference import unpermute_reduce_ref
    _, _, r = _route(c, dev)
    g = torch.Generator().manual_seed(c["seed"])
    y = torch.randn(c["M"] * c["K"], c["H"], generator=g).to(torch.bfloat16)
    w = torch.rand(c["M"], c["K"], generator=g) if c["weighted"] else None
    out = bridge.unpermute_reduce(y.to(dev), r, None if w is None else w.to(dev), out_dtype=torch.float32)
    ref = unpermute_reduce_ref(y, r.slot.cpu(), w)
    assert_rel_close(out, ref, torch.ones(c["M"], dtype=torch.bool), REDUCE_TOL, "unpermute_reduce")


# --- layer -------------------------------------------------------------------------------------------------


def check_layer(c: dict, dev) -> None:
    """``MoEEpLayer`` at world size 1 on a :func:`~.strategies.layer_cases` case against the dense MoE on the same
    (dequantized) weights: the input's shape, within :data:`LAYER_TOL` (:data:`LAYER_NVFP4_TOL` with NVFP4
    activations)."""
    from ..config import EpConfig
    from ..layer import MoEEpLayer
    from ..reference import moe_reference
    from ..weights import ExpertWeights
    x, idx, wts, w13, w2 = S.make_layer_inputs(c)
    alg, lay = c["layout"]
    cfg = EpConfig(c["E"], c["K"], c["H"], c["I"], max(c["B"], 1), algorithm=alg, layout=lay,
                   weight_format=c["wf"], activation_format=c["af"])
    weights = ExpertWeights(w13.to(dev), w2.to(dev), c["wf"])
    out = MoEEpLayer(cfg, weights)(x.to(dev), idx.to(dev), wts.to(dev))
    d13, d2 = weights.dense()
    ref = moe_reference(x, idx, wts, d13.cpu(), d2.cpu())
    assert tuple(out.shape) == tuple(x.shape), f"layer output shape {tuple(out.shape)} != {tuple(x.shape)}"
    tol = LAYER_NVFP4_TOL if c["af"] == "nvfp4" else LAYER_TOL
    assert_rel_close(out, ref, torch.ones(c["B"], dtype=torch.bool), tol, "layer")


def check_layer_batch_invariance(c: dict, dev) -> None:
    """``MoEEpLayer`` with NVFP4 activations (per-token scales, or a static scale when the seed is odd): token 0's
    output is bit for bit the same when the other tokens of its batch change (every other one scaled by 1000,
    token 1 Inf, ``validate=False``); under per-token scales token 1 comes out NaN wherever it has an expert."""
    from ..config import EpConfig
    from ..layer import MoEEpLayer
    from ..weights import ExpertWeights
    c = dict(c, af="nvfp4", H=-(-c["H"] // 32) * 32)
    x, idx, wts, w13, w2 = S.make_layer_inputs(c)
    if c["B"] < 2:
        return
    alg, lay = c["layout"]
    static = STATIC_SCALE if c["seed"] % 2 else None
    cfg = EpConfig(c["E"], c["K"], c["H"], c["I"], c["B"], algorithm=alg, layout=lay, weight_format=c["wf"],
                   activation_format="nvfp4", activation_global_scale=static)
    layer = MoEEpLayer(cfg, ExpertWeights(w13.to(dev), w2.to(dev), c["wf"]), validate=False)
    out = layer(x.to(dev), idx.to(dev), wts.to(dev)).cpu()
    company = x * 1000
    company[0] = x[0]
    company[1] = float("inf")
    out2 = layer(company.to(dev), idx.to(dev), wts.to(dev)).cpu()
    assert_bits_equal(out2[0], out[0], "token 0's output in other company (batch variance)")
    if static is None and bool((idx[1] >= 0).any()):
        assert bool(torch.isnan(out2[1]).all()), "an Inf token with experts comes out NaN (per-token scales)"


def check_dispatch_fp8(c: dict, dev) -> None:
    """The portable transport at world size 1 with FP8 activations on a :func:`~.strategies.layer_cases` case (its
    layout, H and tokens; the formats are FP8's): the dispatched ``Fp8Tensor`` holds, in every valid slot,
    ``quantize_fp8_ref`` (block_rows 1) of the row the bf16 dispatch of the same inputs holds there, bit for bit;
    combine (the toy experts on the payload's value) returns ``[B, H]`` bf16."""
    from ..config import EpConfig
    from ..kernels.fp8 import Fp8Tensor
    from ..reference import quantize_fp8_ref
    from ..transports.torch_dist import TorchDistTransport
    from .toy_transport import toy_compute, valid_rows
    x, idx, wts, _, _ = S.make_layer_inputs(c)
    alg, lay = c["layout"]
    kw = dict(num_experts=c["E"], top_k=c["K"], hidden_size=c["H"], intermediate_size=c["I"],
              max_tokens_per_rank=max(c["B"], 1), algorithm=alg, layout=lay)
    t8 = TorchDistTransport(EpConfig(**kw, weight_format="fp8", activation_format="fp8"), device=dev)
    t16 = TorchDistTransport(EpConfig(**kw), device=dev)
    x, idx, wts = x.to(dev), idx.to(dev), wts.to(dev)
    r8, r16 = t8.dispatch(x, idx, wts), t16.dispatch(x, idx, wts)
    assert isinstance(r8.tokens, Fp8Tensor) and r8.tokens.block_rows == 1, f"FP8 payload {type(r8.tokens)}"
    ok = valid_rows(r16)
    assert torch.equal(ok, valid_rows(r8)), "the FP8 dispatch's valid slots differ from the bf16 dispatch's"
    q, s = quantize_fp8_ref(r16.tokens[ok], 1)
    assert_bits_equal(r8.tokens.data[ok], q, "FP8 payload codes")
    assert_bits_equal(r8.tokens.scales[ok], s, "FP8 payload scales")
    out = t8.combine(toy_compute(r8, t8.config, 0, 1))
    assert tuple(out.shape) == tuple(x.shape) and out.dtype == torch.bfloat16, f"combine {tuple(out.shape)}"


class Property(NamedTuple):
    """A target: the strategy of its cases for given :class:`~.strategies.Bounds`, its check, and (for a kernel
    that runs only on some devices) ``unavailable()``: why it cannot run here, or None where it can."""

    cases: Callable
    check: Callable[[dict, torch.device], object]
    unavailable: Callable[[], str | None] = lambda: None


PROPERTIES = {
    "quantize": Property(S.quant_cases, check_quantize),
    "dequantize": Property(S.quant_cases, check_dequantize),
    "gather_quantize": Property(S.quant_cases, check_gather_quantize),
    "quantize_tokens": Property(S.quant_cases, check_quantize_tokens),
    "grouped_gemm": Property(S.gemm_cases, check_grouped_gemm),
    "expert_mlp": Property(lambda b: S.gemm_cases(b, mlp=True), check_expert_mlp),
    "fp8_grouped_gemm": Property(S.fp8_gemm_cases, check_fp8_grouped_gemm),
    "fp8_expert_mlp": Property(lambda b: S.fp8_gemm_cases(b, mlp=True), check_fp8_expert_mlp),
    "route": Property(S.route_cases, check_route),
    "permute": Property(S.route_cases, check_permute),
    "unpermute_reduce": Property(S.route_cases, check_unpermute_reduce),
    "layer": Property(S.layer_cases, check_layer),
    "layer_batch_invariance": Property(S.layer_cases, check_layer_batch_invariance),
    "dispatch_fp8": Property(S.layer_cases, check_dispatch_fp8),
    "gluon_nvfp4_grouped_gemm": Property(S.gluon_nvfp4_cases, check_gluon_nvfp4_gemm, gluon_nvfp4_unavailable),
    "gluon_nvfp4_prefill_grouped_gemm": Property(S.gluon_nvfp4_prefill_cases, check_gluon_nvfp4_prefill_gemm,
                                                 gluon_nvfp4_prefill_unavailable),
    "gluon_fp8_grouped_gemm": Property(S.gluon_fp8_cases, check_gluon_fp8_gemm, gluon_fp8_unavailable),
    "gluon_fp8_swiglu_grouped_gemm": Property(lambda b: S.gluon_fp8_cases(b, swiglu=True), check_gluon_fp8_swiglu_gemm,
                                              gluon_fp8_unavailable),
}
