"""NVFP4 quantize / dequantize as Triton kernels, bit-exact with ``moe_ep.reference`` (tests compare the two;
this module does not import it: the global scale is implemented here too, the tensor type and the scale swizzle in
``nvfp4_tensor``).

One program quantizes a ``BLOCK_M x BLOCK_K`` tile: per 16-element block it takes the amax, the E4M3
scale ``e4m3_rne(min(amax / 6 * gs, 448))``, then E2M1 codes of ``x * (gs / s)``, and writes packed
nibbles plus the scale (linear or 128x4-swizzled). Each step rounds like the reference's IEEE fp32 step:
the scale through the RNE fp8 conversion (the interpreter casts through torch, which rounds the same
way), E2M1 by one fp32 add per element (``e2m1_magnitudes``), ``gs / s`` with ``div_rn`` (Triton's
plain ``/`` is an approximate divide on NVIDIA GPUs) and ``amax / 6`` as an fma-corrected multiply
(``div6``). On the GPU, bf16 input is unpacked by a few lines of inline PTX; the interpreter, which runs
no inline asm, takes plain ops that give the same bits.

Bad global scales (0, negative, NaN, Inf) held in a device tensor cannot be checked without a host sync, so
they have a defined result instead: quantizing a row with such a scale writes codes 0 and scale 0, and
dequantizing it gives NaN (the whole row). Python numbers are checked (:class:`MoEEpInputError`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..errors import MoEEpInputError, check, fail
from ..triton_runtime import COMPILED, check_on_kernel_device
from . import autotuning, launch_cache
# the tensor type and the swizzle are part of this module's API too (imported from here throughout)
from .nvfp4_tensor import NVFP4_BLOCK, NvFp4Tensor, swizzle_scales, swizzled_scale_shape, unswizzle_scales  # noqa: F401
_GLOBAL_SCALE_NUMERATOR = 448.0 * 6.0  # E4M3 max x E2M1 max: gs = 2688 / amax puts amax at the top of both
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DTYPE_NAMES = "torch.bfloat16, torch.float16, torch.float32"


@triton.jit
def e4m3_rne(y):
    """fp32 y in [0, 448] -> (its E4M3 value as fp32, its E4M3 byte as uint8), round to nearest even."""
    s8 = y.to(tl.float8e4nv)  # cvt.rn.satfinite: RNE, and y <= 448 never saturates
    return s8.to(tl.float32), s8.to(tl.uint8, bitcast=True)


@triton.jit
def div6(a, FMA: tl.constexpr):
    """fp32 ``a / 6`` rounded to nearest even, for ``a`` a bf16 or fp16 value when ``FMA``.

    Division by a constant as ``q = a * RN(1/6)`` plus one fma correction: checked exhaustively against
    IEEE division for every finite bf16 and fp16 ``a`` (not for fp32 ``a``, and not with the
    interpreter's fma, which rounds twice: those divide).
    """
    if FMA:
        y: tl.constexpr = 0.1666666716337204  # RN(1/6)
        q = a * y
        return tl.fma(tl.fma(q, -6.0, a), y, q)
    else:
        return tl.math.div_rn(a, tl.full(a.shape, 6.0, tl.float32))


@triton.jit
def e2m1_magnitudes(v):
    """fp32 -> magnitudes of the E2M1 codes (ties to even, saturating at 6) in bits 0-2 of a uint32 whose
    bits 3-22 are 0 (bits 23-30 are not cleared: ``pack_nibbles`` drops them).

    One fp32 add does the rounding: with a = min(|v|, 6) in [2^p, 2^(p+1)) (p = 0 below 1), adding
    M = 2^(p+22) + 2p ulps leaves an ulp of 2^(p-1), the E2M1 step there, so the add rounds a to the
    grid (ties to even: 2p is even) and the sum's low mantissa bits are the code (n steps + 2p < 8).
    """
    a = tl.minimum(tl.abs(v), 6.0)
    e = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 127)
    m = (e * 0x800002 + 0x0AFFFF02).to(tl.float32, bitcast=True)  # (e + 22) << 23 plus 2 (e - 127) ulps
    return (a + m).to(tl.uint32, bitcast=True)


@triton.jit
def pack_nibbles(c, base):
    """uint32 [A, B, 8] holding 4-bit values in bits 0-3 and 0 in bits 4-22 (bits 23-31 are ignored), plus
    ``base`` -> uint32 [A, B], element i in nibble i. Shift-adds, no per-element mask: from element 3 on the
    shift pushes bits 23-31 out of the word, and one mask clears them from elements 0-2."""
    A: tl.constexpr = c.shape[0]
    B: tl.constexpr = c.shape[1]
    ev, od = tl.split(tl.reshape(c, [A, B, 4, 2]))  # elements 0 2 4 6 | 1 3 5 7
    e04, e26 = tl.split(tl.reshape(ev, [A, B, 2, 2]))
    o15, o37 = tl.split(tl.reshape(od, [A, B, 2, 2]))
    c0, c4 = tl.split(e04)
    c2, c6 = tl.split(e26)
    c1, c5 = tl.split(o15)
    c3, c7 = tl.split(o37)
    hi = base + (c3 << 12)
    hi = hi + (c4 << 16)
    hi = hi + (c5 << 20)
    hi = hi + (c6 << 24)
    hi = hi + (c7 << 28)
    return ((c0 + (c1 << 4) + (c2 << 8)) & 0xFFF) | hi


@triton.jit
def e2m1_values(codes):
    """E2M1 4-bit codes (any int type) -> fp32 values, built from bits (exact)."""
    c = codes.to(tl.int32)
    m = c & 7
    bits = tl.where(m >= 2, (((m >> 1) + 126) << 23) | ((m & 1) << 22), tl.where(m == 1, 0x3F000000, 0))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def swizzled_offset(m, c, CP):
    """Offset of scale (row m, column c) inside one 128x4-swizzled slice with CP padded columns."""
    return ((m // 128) * (CP // 4) + c // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + c % 4


_INF = tl.constexpr(float("inf"))


@triton.jit
def nan_f32():
    """A quiet fp32 NaN, made from its bits in the kernel: a NaN global constexpr cannot be used, since the JIT's
    check that a kernel's globals are unchanged compares them with ``!=``, and NaN != NaN (Triton 3.6-3.9)."""
    return tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


# row counts only bound masks and index rows (K and the strides set the vector widths): not specialized on
# their divisibility, so varying batch sizes reuse one compiled variant instead of up to 3^4

_ROW_COUNTS = ["R", "M_SRC", "rows_per_gs", "slice_rows", "slice_cp", "K_BUCKET"]


# 8 bf16 (4 words) -> 8 fp32 (low half shifted up, high half masked: one instruction each; the stock
# conversion spends two on the high half) and, in $8, their sign bits at bits 4i + 3 (the code nibbles'
# sign bits): prmt's sign-replicating selectors spread each element's sign over a byte, even elements
# into one word and odd into another, and two masks keep bit 3 / bit 7 of each byte ($9-$15 copy $8)
_BF16_ASM = tl.constexpr("""{
.reg .b32 a, b, e, o;
shl.b32 $0, $16, 16; and.b32 $1, $16, 0xffff0000; shl.b32 $2, $17, 16; and.b32 $3, $17, 0xffff0000;
shl.b32 $4, $18, 16; and.b32 $5, $18, 0xffff0000; shl.b32 $6, $19, 16; and.b32 $7, $19, 0xffff0000;
prmt.b32 a, $16, $17, 0xfbd9; prmt.b32 b, $18, $19, 0xfbd9;
prmt.b32 e, a, b, 0x5410; prmt.b32 o, a, b, 0x7632;
and.b32 e, e, 0x08080808; and.b32 o, o, 0x80808080; or.b32 $8, e, o;
mov.b32 $9, $8; mov.b32 $10, $8; mov.b32 $11, $8; mov.b32 $12, $8; mov.b32 $13, $8; mov.b32 $14, $8; mov.b32 $15, $8;
}""")


@triton.jit
def first(t):
    """[A, B, 8] -> [A, B]: element 0 of the last dim (splits: no data movement)."""
    A: tl.constexpr = t.shape[0]
    B: tl.constexpr = t.shape[1]
    t, _ = tl.split(tl.reshape(t, [A, B, 4, 2]))
    t, _ = tl.split(tl.reshape(t, [A, B, 2, 2]))
    t, _ = tl.split(t)
    return t


@triton.jit
def unpack_signs(x, ASM: tl.constexpr):
    """x [A, B, 8] -> (x as fp32 (exact), uint32 [A, B] with the sign bit of x[..., i] at bit 4i + 3)."""
    if ASM and x.dtype == tl.bfloat16:
        xf, sg = tl.inline_asm_elementwise(_BF16_ASM, "=r," * 16 + "r,r,r,r", [x], dtype=(tl.float32, tl.uint32),
                                           is_pure=True, pack=8)
        return xf, first(sg)
    else:
        xf = x.to(tl.float32)
        return xf, pack_nibbles((xf.to(tl.uint32, bitcast=True) >> 28) & 8, 0)


@triton.autotune(configs=autotuning.nvfp4_configs(), key=["K_BUCKET", "SWIZZLE"])
@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0, "ONE_GS": lambda a: a["rows_per_gs"] >= a["R"]})
@triton.jit(do_not_specialize=_ROW_COUNTS)
def _quantize_kernel(x_ptr, idx_ptr, gs_ptr, q_ptr, s_ptr, R, M_SRC, K, stride_x, rows_per_gs, slice_rows,
                     slice_cp, K_BUCKET, HAS_IDX: tl.constexpr, SWIZZLE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ONE_GS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    NB: tl.constexpr = BLOCK_K // 16
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < R
    sc = pid_k * NB + tl.arange(0, NB)
    if EVEN_K:
        mask = rmask[None, :]
    else:
        mask = rmask[None, :] & (sc[:, None] < K // 16)
    if HAS_IDX:
        src = tl.load(idx_ptr + rows, mask=rmask, other=-1).to(tl.int64)
        # rows of index -1 (or outside x's M_SRC rows: never read) load zeros, so they are written as zeros
        lmask = mask & ((src >= 0) & (src < M_SRC))[None, :]
    else:
        src = tl.minimum(rows, R - 1).to(tl.int64)  # tail rows re-read the last row: their results are not stored
        lmask = mask
    # tiles are [blocks, rows, ...] (blocks first: Triton then puts a warp's lanes along K, which the scale
    # store wants too); each 16-block is loaded as two halves of 8 (one 16-byte vector each) with the same
    # layout, so one thread holds a whole block: amax, rounding and nibble packing stay in its registers
    xp = x_ptr + src[None, :, None] * stride_x + sc[:, None, None] * 16 + tl.arange(0, 8)[None, None, :]
    if EVEN_K and not HAS_IDX:
        x0, sg0 = unpack_signs(tl.load(xp), COMPILED)
        x1, sg1 = unpack_signs(tl.load(xp + 8), COMPILED)
    else:
        x0, sg0 = unpack_signs(tl.load(xp, mask=lmask[:, :, None], other=0.0), COMPILED)
        x1, sg1 = unpack_signs(tl.load(xp + 8, mask=lmask[:, :, None], other=0.0), COMPILED)
    if ONE_GS:  # one global scale for all rows: no per-row division
        gs = tl.load(gs_ptr)
    else:
        gs = tl.load(gs_ptr + rows // rows_per_gs, mask=rmask, other=1.0)[None, :]
    gs_ok = (gs > 0) & (gs < _INF)  # a bad scale (0, < 0, NaN, Inf): codes 0 and scale 0, sign bits too
    sg0 = tl.where(gs_ok, sg0, tl.zeros_like(sg0))
    sg1 = tl.where(gs_ok, sg1, tl.zeros_like(sg1))

    amax = tl.maximum(tl.max(tl.abs(x0), axis=2), tl.max(tl.abs(x1), axis=2))
    y = tl.where(gs_ok, tl.minimum(div6(amax, COMPILED and x_ptr.dtype.element_ty != tl.float32) * gs, 448.0), 0.0)
    s_val, s_byte = e4m3_rne(y)
    inv = tl.where(s_val > 0, tl.math.div_rn(tl.broadcast_to(gs, s_val.shape), tl.where(s_val > 0, s_val, 1.0)), 0.0)
    # code sign = sign of x * inv = sign of x (inv >= +0), so it comes from x's bits; a bad scale's rows get
    # magnitude 0 even where x is NaN (NaN * 0 is NaN, which the GPU's min would round to the top code)
    ok3 = gs_ok if ONE_GS else gs_ok[:, :, None]
    w0 = pack_nibbles(e2m1_magnitudes(tl.where(ok3, x0 * inv[:, :, None], 0.0)), sg0)
    w1 = pack_nibbles(e2m1_magnitudes(tl.where(ok3, x1 * inv[:, :, None], 0.0)), sg1)
    q_off = rows.to(tl.int64)[None, :] * (K // 8) + sc[:, None] * 2
    tl.store(q_ptr.to(tl.pointer_type(tl.uint32)) + q_off[:, :, None] + tl.arange(0, 2)[None, None, :],
             tl.join(w0, w1), mask=mask[:, :, None])
    if SWIZZLE:
        m = rows % slice_rows
        base = (rows // slice_rows).to(tl.int64) * (((slice_rows + 127) // 128) * 128 * slice_cp)
        s_off = base[None, :] + swizzled_offset(m[None, :], sc[:, None], slice_cp)
    else:
        s_off = rows.to(tl.int64)[None, :] * (K // 16) + sc[:, None]
    tl.store(s_ptr + s_off, s_byte, mask=mask)


@triton.autotune(configs=autotuning.nvfp4_configs(), key=["K_BUCKET", "SWIZZLE"])
@triton.jit(do_not_specialize=_ROW_COUNTS)
def _dequantize_kernel(q_ptr, s_ptr, gs_ptr, out_ptr, R, K, rows_per_gs, slice_rows, slice_cp, K_BUCKET,
                       SWIZZLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < R
    NB: tl.constexpr = BLOCK_K // 16
    sc = pid_k * NB + tl.arange(0, NB)
    half3 = sc[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None, None] * (K // 2) + half3,
                mask=rmask[:, None, None] & (half3 < K // 2), other=0).to(tl.int32)
    vals = tl.reshape(tl.join(e2m1_values(q & 0xF), e2m1_values(q >> 4)), [BLOCK_M, NB, 16])
    smask = rmask[:, None] & (sc[None, :] < K // 16)
    if SWIZZLE:
        m = rows % slice_rows
        base = (rows // slice_rows).to(tl.int64) * (((slice_rows + 127) // 128) * 128 * slice_cp)
        s_off = base[:, None] + swizzled_offset(m[:, None], sc[None, :], slice_cp)
    else:
        s_off = rows.to(tl.int64)[:, None] * (K // 16) + sc[None, :]
    s_byte = tl.load(s_ptr + s_off, mask=smask, other=0).to(tl.int32)
    s_val, _ = e4m3_values_of_bytes(s_byte)
    # the byte's exact E4M3 value, as the reference reads it: quantize writes neither, but a scale made
    # elsewhere may carry a sign bit or be NaN (0x7F / 0xFF)
    s_val = tl.where((s_byte & 0x7F) == 0x7F, nan_f32(), tl.where((s_byte & 0x80) != 0, -s_val, s_val))
    gs = tl.load(gs_ptr + rows // rows_per_gs, mask=rmask, other=1.0)
    prod = vals * s_val[:, :, None]
    out = tl.math.div_rn(prod, tl.broadcast_to(gs[:, None, None], prod.shape))
    gs_ok = (gs > 0) & (gs < _INF)  # rows of a bad global scale (0, < 0, NaN, Inf) are NaN
    out = tl.where(gs_ok[:, None, None], out, nan_f32())
    cols3 = sc[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None, None] * K + cols3, out.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None, None] & (cols3 < K))


@triton.jit
def e4m3_values_of_bytes(b):
    """E4M3 bytes (int32, sign ignored: scales are >= 0) -> (fp32 value, the byte)."""
    e = (b >> 3) & 0xF
    m = b & 7
    normal = ((e + 120) << 23) | (m << 20)
    val = tl.where(e > 0, normal.to(tl.float32, bitcast=True), m.to(tl.float32) * 0.001953125)
    return val, b


def nvfp4_global_scale(x: torch.Tensor, per_slice: bool = False) -> torch.Tensor:
    """The default NVFP4 global scale ``2688 / amax(x)`` as float32, on x's device: a 0-dim tensor, or ``[x.shape[0]]``
    (one per ``x[i]``, e.g. per expert of ``[L, N, K]`` weights) with ``per_slice=True``. 1.0 where amax is 0
    (all-zero x, or no elements) or NaN, or where the quotient overflows fp32; 0.0 where amax is Inf (which
    :func:`quantize_nvfp4` then treats as a bad scale). No host sync.
    """
    _check_x(x, "x")
    if not isinstance(per_slice, bool):
        fail("per_slice", per_slice, "True or False")
    per_slice = per_slice and x.dim() > 1
    x = x.detach()
    if x.numel() == 0:
        amax = torch.zeros(x.shape[0] if per_slice else (), dtype=torch.float32, device=x.device)
    else:  # the max of |x| is one of x's values: exact in any dtype
        amax = torch.linalg.vector_norm(x.flatten(1) if per_slice else x, ord=math.inf, dim=1 if per_slice else None)
    amax = amax.float()
    # fp64 division rounded once to fp32 is the correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits): the IEEE
    # fp32 division the reference does, where torch's CUDA tensor / scalar would be a reciprocal multiply
    gs = (_GLOBAL_SCALE_NUMERATOR / amax.double()).float()
    return torch.where((amax > 0) & torch.isfinite(gs), gs, torch.ones_like(gs))


def nvfp4_row_global_scale(x: torch.Tensor) -> torch.Tensor:
    """One NVFP4 global scale per row of ``x [..., K]``: float32 ``x.shape[:-1]``, ``2688 / amax(row)``, so a row's
    codes depend on that row alone. 1.0 where the row is all zero (or the quotient overflows fp32); NaN where the
    row holds NaN or Inf, which :func:`quantize_nvfp4` treats as a bad scale (codes 0, scale 0; NaN when
    dequantized): the row comes out NaN and no other row is touched. No host sync.
    """
    _check_x(x, "x")
    x = x.detach()
    if x.numel() == 0:
        return torch.ones(x.shape[:-1], dtype=torch.float32, device=x.device)
    amax = x.abs().amax(dim=-1).float()  # one of the row's values (exact); NaN propagates, on every device
    gs = (_GLOBAL_SCALE_NUMERATOR / amax.double()).float()  # correctly rounded, as in nvfp4_global_scale
    gs = torch.where((amax > 0) & torch.isfinite(gs), gs, torch.ones_like(gs))
    return torch.where(torch.isfinite(amax), gs, torch.full_like(gs, math.nan))


def _check_x(x, name: str) -> None:
    check(isinstance(x, torch.Tensor), f"type({name})", type(x).__name__, "a torch.Tensor")
    check(x.dtype in _DTYPES, f"{name}.dtype", x.dtype, _DTYPE_NAMES)
    check(x.dim() >= 1, f"{name}.dim()", x.dim(), ">= 1 (last dim K is quantized)")
    check(x.shape[-1] > 0 and x.shape[-1] % NVFP4_BLOCK == 0, f"{name}.shape[-1] (K)", x.shape[-1],
          "a positive multiple of 16 (the NVFP4 block)")
    check_on_kernel_device(x, name)


def _check_flag(v, name: str) -> None:
    if not isinstance(v, bool):
        fail(name, v, "True or False")


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_finite(x: torch.Tensor, name: str) -> None:
    if not _capturing(x) and not bool(torch.isfinite(x).all()):
        raise MoEEpInputError(f"{name} holds NaN or Inf; allowed: finite values (NVFP4 has no NaN/Inf; "
                              "pass check_finite=False to skip this check and get unspecified codes)")


def _global_scale_arg(global_scale, x: torch.Tensor, lead: int, check_finite: bool,
                      per_row: bool = False) -> torch.Tensor:
    if global_scale is None:
        return nvfp4_global_scale(x)
    if isinstance(global_scale, (int, float)) and not isinstance(global_scale, bool):
        check(global_scale > 0 and global_scale != float("inf"), "global_scale", global_scale,
              "a positive finite number")
        return torch.tensor(float(global_scale), dtype=torch.float32, device=x.device)
    check(isinstance(global_scale, torch.Tensor), "type(global_scale)", type(global_scale).__name__,
          "None, a positive float, or a float32 tensor")
    check(global_scale.dtype.is_floating_point, "global_scale.dtype", global_scale.dtype,
          "a floating dtype (float32 preferred)")
    rows_shape = tuple(x.shape[:-1])
    one_per_row = per_row and tuple(global_scale.shape) == rows_shape
    if not one_per_row:
        check(global_scale.numel() in (1, lead) and global_scale.dim() <= 1, "global_scale.shape",
              tuple(global_scale.shape), f"a scalar, [1] or [{lead}] (one per x[i])"
              + (f" or {list(rows_shape)} (one per row)" if per_row else ""))
    check(global_scale.device == x.device, "global_scale.device", str(global_scale.device), str(x.device))
    gs = global_scale.detach().to(torch.float32).reshape(-1 if one_per_row or global_scale.numel() > 1 else ())
    if check_finite and not _capturing(x):
        if not bool(((gs > 0) & torch.isfinite(gs)).all()):
            raise MoEEpInputError(f"global_scale = {gs.tolist()}; allowed: positive finite values")
    return gs.contiguous()


def _scale_layout(shape, swizzle: bool, R: int):
    """(scales tensor to fill, rows per swizzled slice, padded scale columns)."""
    kc = shape[-1] // NVFP4_BLOCK
    if not swizzle:
        return None, 1, 1
    rows = shape[-2] if len(shape) >= 2 else 1
    mp, cp = swizzled_scale_shape(rows, kc)
    n_slices = R // rows if rows else 0
    return (tuple(shape[:-2]), mp * cp, n_slices), rows, cp


def _launch_quantize(x2, idx, gs, R, K, rows_per_gs, out_shape, swizzle):
    dev = x2.device
    data = torch.empty(*out_shape[:-1], K // 2, dtype=torch.uint8, device=dev)
    layout, slice_rows, slice_cp = _scale_layout(out_shape, swizzle, R)
    if swizzle:
        lead, flat, _ = layout
        scales = torch.zeros(*lead, flat, dtype=torch.float8_e4m3fn, device=dev)
    else:
        scales = torch.empty(*out_shape[:-1], K // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=dev)
    if R > 0:
        grid = launch_cache.BlockGrid(R, K, "BLOCK_K")
        autotuning.launch(_quantize_kernel, grid, x2, idx if idx is not None else x2, gs, data,
                          scales.view(torch.uint8), R, x2.shape[0], K, x2.stride(0), rows_per_gs, max(slice_rows, 1),
                          slice_cp, autotuning.size_bucket(K), HAS_IDX=idx is not None, SWIZZLE=swizzle)
    return NvFp4Tensor(data, scales, gs, torch.Size(out_shape), swizzle)


def quantize_nvfp4(x: torch.Tensor, global_scale=None, *, swizzle: bool = False,
                   check_finite: bool = True) -> NvFp4Tensor:
    """Quantize ``x [..., K]`` (bf16/fp16/fp32, K % 16 == 0, on the kernels' device) to NVFP4.

    ``global_scale``: None (computed on the device as ``2688 / amax(x)``, no host sync), a positive
    float, a scalar tensor, a ``[x.shape[0]]`` tensor (one scale per slice ``x[i]``, e.g. per expert;
    see :func:`nvfp4_global_scale`), or an ``x.shape[:-1]`` tensor (one per row, see
    :func:`nvfp4_row_global_scale`). ``swizzle=True`` writes the scales in the 128x4 layout.

    NaN/Inf policy: NVFP4 cannot represent them. With ``check_finite=True`` (default) a non-finite x or
    a global scale tensor holding a value that is not positive and finite raises :class:`MoEEpInputError`
    (this costs one device->host sync; it is skipped while a CUDA graph is being captured). With
    ``check_finite=False`` no check is made: the codes of a block holding NaN/Inf are unspecified (but the
    call never fails), and rows whose global scale is 0, negative, NaN or Inf get codes 0 and scale 0 (their
    dequantization is NaN). A Python number that is not positive and finite always raises.
    """
    _check_x(x, "x")
    _check_flag(swizzle, "swizzle")
    _check_flag(check_finite, "check_finite")
    if check_finite:
        _check_finite(x, "x")
    K = x.shape[-1]
    lead = x.shape[0] if x.dim() > 1 else 1
    gs = _global_scale_arg(global_scale, x, lead, check_finite, per_row=True)
    x2 = x.detach().reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    rows_per_gs = max(R // gs.numel(), 1) if gs.numel() > 1 else max(R, 1)
    return _launch_quantize(x2, None, gs, R, K, rows_per_gs, tuple(x.shape), swizzle)


def quantize_nvfp4_tokens(x: torch.Tensor, static_global_scale: float | None = None) -> NvFp4Tensor:
    """Activations ``x [..., H]`` (bf16/fp16/fp32) -> NVFP4 with one global scale per row (``x.shape[:-1]``), the
    rule the layer quantizes tokens by: a token's codes never depend on the other tokens of its batch.

    ``static_global_scale``: None takes each row's own ``2688 / amax(row)`` (:func:`nvfp4_row_global_scale`);
    a positive finite float (what an NVFP4 checkpoint ships as ``1 / input_scale``) is used for every row, values
    past its range saturating at +-6 * 448 / scale. A row holding NaN or Inf comes out as codes 0 with a NaN
    global scale under the per-row rule, so it is NaN downstream and spreads to no other row (a static scale
    gives such a row unspecified codes). No host sync.
    """
    if static_global_scale is None:
        gs = nvfp4_row_global_scale(x)
    else:
        _check_x(x, "x")
        check(isinstance(static_global_scale, (int, float)) and not isinstance(static_global_scale, bool)
              and 0 < static_global_scale < math.inf, "static_global_scale", static_global_scale,
              "None (one scale per row) or a positive finite float")
        gs = torch.full(x.shape[:-1], float(static_global_scale), dtype=torch.float32, device=x.device)
    return quantize_nvfp4(x, gs, check_finite=False)


def gather_quantize_nvfp4(x: torch.Tensor, row_index: torch.Tensor, global_scale=None, *,
                          swizzle: bool = False, check_finite: bool = True) -> NvFp4Tensor:
    """Quantize the rows ``x[row_index]`` of ``x [M, K]`` into a new ``[len(row_index), K]`` NVFP4 tensor
    in one pass (the bridge's gather + quantize). ``row_index`` int32/int64 ``[N]`` on x's device; an entry of -1
    gives an all-zero row (codes 0, scales 0). ``global_scale`` as in :func:`quantize_nvfp4` but scalar
    only; None computes it from all of x (so it does not depend on which rows are gathered).
    Indices must lie in [-1, M): with ``check_finite`` (default) this is checked (one host sync, skipped under
    CUDA graph capture) and raises :class:`MoEEpInputError`; unchecked, an index outside ``[0, M)`` gives an
    all-zero row like -1 (x is never read out of bounds).
    """
    _check_x(x, "x")
    check(x.dim() == 2, "x.dim()", x.dim(), "2 ([M, K])")
    _check_flag(swizzle, "swizzle")
    _check_flag(check_finite, "check_finite")
    check(isinstance(row_index, torch.Tensor), "type(row_index)", type(row_index).__name__,
          "a 1-D int32/int64 torch.Tensor")
    check(row_index.dim() == 1, "row_index.shape", tuple(row_index.shape), "[N] (1-D)")
    check(row_index.dtype in (torch.int32, torch.int64), "row_index.dtype", row_index.dtype, "int32, int64")
    check(row_index.device == x.device, "row_index.device", str(row_index.device), str(x.device))
    if check_finite:
        _check_finite(x, "x")
        if row_index.numel() and not _capturing(x):
            lo, hi = int(row_index.min()), int(row_index.max())
            check(lo >= -1 and hi < x.shape[0], "row_index range", (lo, hi), f"[-1, {x.shape[0]})")
    gs = _global_scale_arg(global_scale, x, 1, check_finite)
    check(gs.numel() == 1, "global_scale.numel()", gs.numel(), "1 (one scale for the gathered rows)")
    K = x.shape[1]
    x2 = x.detach()
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    R = row_index.shape[0]
    return _launch_quantize(x2, row_index.contiguous(), gs, R, K, max(R, 1), (R, K), swizzle)


def dequantize_nvfp4(q: NvFp4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize an :class:`NvFp4Tensor` to ``dtype`` (bf16/fp16/fp32), ``q.shape``: ``(e2m1(q) * s) / gs`` in fp32.

    The parts are checked against ``q.shape`` first (:meth:`NvFp4Tensor.check`). Rows whose global scale is 0,
    negative, NaN or Inf come out NaN (a device value: checking it would cost a host sync).
    """
    check(isinstance(q, NvFp4Tensor), "type(q)", type(q).__name__, "NvFp4Tensor")
    check(dtype in _DTYPES, "dtype", dtype, _DTYPE_NAMES)
    q.check("q")
    check_on_kernel_device(q.data, "q.data")
    shape = tuple(q.shape)
    K = shape[-1]
    R = math.prod(shape[:-1])
    out = torch.empty(shape, dtype=dtype, device=q.device)
    gs = q.global_scale.reshape(-1).contiguous()
    rows_per_gs = max(R // gs.numel(), 1) if gs.numel() > 1 else max(R, 1)
    _, slice_rows, slice_cp = _scale_layout(shape, q.swizzled, R)
    if R > 0:
        grid = launch_cache.BlockGrid(R, K, "BLOCK_K")
        autotuning.launch(_dequantize_kernel, grid, q.data.contiguous(), q.scales.contiguous().view(torch.uint8), gs,
                          out, R, K, rows_per_gs, max(slice_rows, 1), slice_cp, autotuning.size_bucket(K),
                          SWIZZLE=q.swizzled)
    return out
