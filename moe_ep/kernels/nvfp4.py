"""NVFP4 quantize / dequantize as Triton kernels, bit-exact with ``moe_ep.reference``.

One program quantizes a ``BLOCK_M x BLOCK_K`` tile: per 16-element block it takes the amax, the E4M3
scale ``e4m3_rne(min(amax / 6 * gs, 448))``, then E2M1 codes of ``x * (gs / s)``, and writes packed
nibbles plus the scale (linear or 128x4-swizzled). Rounding to E4M3 and E2M1 is done with integer and
fp32 operations (no fp8 conversion instruction), each an IEEE-exact step the reference also takes, so
the compiled GPU kernel and the interpreter give the same bits. Divisions use ``div_rn`` (Triton's
plain ``/`` is an approximate divide on NVIDIA GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import MoEEpInputError, check
from ..reference import (NVFP4_BLOCK, nvfp4_global_scale_ref, swizzle_scales_ref, swizzled_scale_shape,
                         unswizzle_scales_ref)
from ..triton_runtime import device as kernel_device
from . import tuning

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class NvFp4Tensor:
    """An NVFP4-quantized tensor of logical shape ``shape = [..., K]``.

    - ``data``: uint8 ``[..., K/2]``, element 2i in the low nibble, 2i+1 in the high nibble.
    - ``scales``: float8_e4m3fn, linear ``[..., K/16]``, or, when ``swizzled``, the 128x4 layout
      flattened per slice of ``shape[:-2]``: ``[*shape[:-2], Mp * Cp]`` (rows padded to 128, scale
      columns to 4, padding zero).
    - ``global_scale``: float32, a scalar tensor, ``[shape[0]]`` (one per slice, e.g. per expert), or
      one per row (``shape[:-1]``: received tokens keep their source rank's scale).
    Value of element i: ``e2m1(q_i) * float(s_block) / global_scale``.
    """

    data: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size
    swizzled: bool = False

    @property
    def device(self) -> torch.device:
        return self.data.device

    def linear_scales(self) -> torch.Tensor:
        """The scales in the linear layout ``[..., K/16]`` (a copy when swizzled)."""
        if not self.swizzled:
            return self.scales
        rows = self.shape[-2] if len(self.shape) >= 2 else 1
        lin = unswizzle_scales_ref(self.scales, rows, self.shape[-1] // NVFP4_BLOCK)
        return lin.reshape(*self.shape[:-1], self.shape[-1] // NVFP4_BLOCK)


@triton.jit
def e4m3_rne(y):
    """fp32 y in [0, 448] -> (its E4M3 value as fp32, its E4M3 byte as int32), round to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    # normal range (>= 2^-6): round the fp32 mantissa to 3 bits, ties to even; a carry bumps the exponent
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    byte_n = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
    # subnormal range: adding 2^14 leaves an ulp of 2^-9, so the fp32 add itself rounds to the grid
    vs = (y + 16384.0) - 16384.0
    normal = y >= 0.015625
    val = tl.where(normal, rb.to(tl.float32, bitcast=True), vs)
    byte = tl.where(normal, byte_n, (vs * 512.0).to(tl.int32))
    return val, byte


@triton.jit
def e2m1_codes(v):
    """fp32 -> E2M1 4-bit codes (int32), ties to even, saturating at +-6, sign bit kept (-0 -> 0x8).

    Integer work on the fp32 bits instead of a compare per grid point (this is the kernel's hot loop):
    for |v| >= 1 an E2M1 value is an fp32 with a 1-bit mantissa, so rounding the mantissa to 1 bit (ties
    to even; a carry bumps the exponent) gives (biased exponent, bit), and that pair minus 252 is the code;
    below 1 the codes 0, 1, 2 are rint(2|v|), which adding 2^23 computes in the fp32 add itself.
    """
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    r = mag + 0x1FFFFF + ((mag >> 22) & 1)
    hi = tl.minimum((r >> 22) - 252, 7)
    lo = (tl.abs(v) * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(mag >= 0x3F800000, hi, lo) | ((bits >> 28) & 8)


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


@triton.autotune(configs=tuning.nvfp4_configs(), key=["K_BUCKET", "SWIZZLE"])
@triton.jit
def _quantize_kernel(x_ptr, idx_ptr, gs_ptr, q_ptr, s_ptr, R, K, stride_x, rows_per_gs, slice_rows, slice_cp,
                     K_BUCKET, HAS_IDX: tl.constexpr, SWIZZLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    NB: tl.constexpr = BLOCK_K // 16
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < R
    if HAS_IDX:
        src = tl.load(idx_ptr + rows, mask=rmask, other=-1).to(tl.int64)
        valid = rmask & (src >= 0)
    else:
        src = rows.to(tl.int64)
        valid = rmask
    # load as [rows, blocks, 16] so each 16-block sits in few threads (amax and packing stay in registers)
    sc = pid_k * NB + tl.arange(0, NB)
    cols3 = sc[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    x = tl.load(x_ptr + src[:, None, None] * stride_x + cols3,
                mask=valid[:, None, None] & (cols3 < K), other=0.0).to(tl.float32)
    gs = tl.load(gs_ptr + rows // rows_per_gs, mask=rmask, other=1.0)

    amax = tl.max(tl.abs(x), axis=2)
    y = tl.minimum(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)) * gs[:, None], 448.0)
    s_val, s_byte = e4m3_rne(y)
    gs2 = tl.broadcast_to(gs[:, None], s_val.shape)
    inv = tl.where(s_val > 0, tl.math.div_rn(gs2, tl.where(s_val > 0, s_val, 1.0)), 0.0)
    codes = e2m1_codes(x * inv[:, :, None])
    lo, hi = tl.split(tl.reshape(codes, [BLOCK_M, NB, 8, 2]))
    packed = (lo | (hi << 4)).to(tl.uint8)
    half3 = sc[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    tl.store(q_ptr + rows.to(tl.int64)[:, None, None] * (K // 2) + half3, packed,
             mask=rmask[:, None, None] & (half3 < K // 2))
    smask = rmask[:, None] & (sc[None, :] < K // 16)
    if SWIZZLE:
        m = rows % slice_rows
        base = (rows // slice_rows).to(tl.int64) * (((slice_rows + 127) // 128) * 128 * slice_cp)
        s_off = base[:, None] + swizzled_offset(m[:, None], sc[None, :], slice_cp)
    else:
        s_off = rows.to(tl.int64)[:, None] * (K // 16) + sc[None, :]
    tl.store(s_ptr + s_off, s_byte.to(tl.uint8), mask=smask)


@triton.autotune(configs=tuning.nvfp4_configs(), key=["K_BUCKET", "SWIZZLE"])
@triton.jit
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
    s_val, _ = e4m3_values_of_bytes(tl.load(s_ptr + s_off, mask=smask, other=0).to(tl.int32))
    gs = tl.load(gs_ptr + rows // rows_per_gs, mask=rmask, other=1.0)
    prod = vals * s_val[:, :, None]
    out = tl.math.div_rn(prod, tl.broadcast_to(gs[:, None, None], prod.shape))
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
    """The default NVFP4 global scale ``2688 / amax(x)`` (1.0 for an all-zero x), on x's device.

    ``per_slice=True`` gives one scale per ``x[i]`` (e.g. per expert of ``[L, N, K]`` weights). No host sync.
    """
    _check_x(x, "x")
    return nvfp4_global_scale_ref(x.detach(), per_slice=per_slice and x.dim() > 1)


def _check_x(x, name: str) -> None:
    check(isinstance(x, torch.Tensor), f"type({name})", type(x).__name__, "a torch.Tensor")
    check(x.dtype in _DTYPES, f"{name}.dtype", x.dtype, "torch.bfloat16, torch.float16, torch.float32")
    check(x.dim() >= 1, f"{name}.dim()", x.dim(), ">= 1 (last dim K is quantized)")
    check(x.shape[-1] > 0 and x.shape[-1] % NVFP4_BLOCK == 0, f"{name}.shape[-1] (K)", x.shape[-1],
          "a positive multiple of 16 (the NVFP4 block)")
    dev = kernel_device()
    check(x.device.type == dev.type, f"{name}.device", str(x.device), f"{dev.type} (where the kernels run here)")


def _check_finite(x: torch.Tensor, name: str) -> None:
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and not bool(torch.isfinite(x).all()):
        raise MoEEpInputError(f"{name} holds NaN or Inf; allowed: finite values (NVFP4 has no NaN/Inf; "
                              "pass check_finite=False to skip this check and get unspecified codes)")


def _global_scale_arg(global_scale, x: torch.Tensor, lead: int, check_finite: bool) -> torch.Tensor:
    if global_scale is None:
        return nvfp4_global_scale(x)
    if isinstance(global_scale, (int, float)):
        check(global_scale > 0 and global_scale != float("inf"), "global_scale", global_scale,
              "a positive finite number")
        return torch.tensor(float(global_scale), dtype=torch.float32, device=x.device)
    check(isinstance(global_scale, torch.Tensor), "type(global_scale)", type(global_scale).__name__,
          "None, a float, or a float32 tensor")
    check(global_scale.numel() in (1, lead) and global_scale.dim() <= 1, "global_scale.shape",
          tuple(global_scale.shape), f"a scalar, [1] or [{lead}] (one per x[i])")
    check(global_scale.device == x.device, "global_scale.device", str(global_scale.device), str(x.device))
    gs = global_scale.to(torch.float32).reshape(-1 if global_scale.numel() > 1 else ())
    if check_finite and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
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
        grid = lambda meta: (triton.cdiv(R, meta["BLOCK_M"]), triton.cdiv(K, meta["BLOCK_K"]))  # noqa: E731
        _quantize_kernel[grid](x2, idx if idx is not None else x2, gs, data, scales.view(torch.uint8), R, K,
                               x2.stride(0), rows_per_gs, max(slice_rows, 1), slice_cp, tuning.size_bucket(K),
                               HAS_IDX=idx is not None, SWIZZLE=swizzle)
    return NvFp4Tensor(data, scales, gs, torch.Size(out_shape), swizzle)


def quantize_nvfp4(x: torch.Tensor, global_scale=None, *, swizzle: bool = False,
                   check_finite: bool = True) -> NvFp4Tensor:
    """Quantize ``x [..., K]`` (bf16/fp16/fp32, K % 16 == 0) to NVFP4.

    ``global_scale``: None (computed on the device as ``2688 / amax(x)``, no host sync), a positive
    float, a scalar tensor, or a ``[x.shape[0]]`` tensor (one scale per slice ``x[i]``, e.g. per expert;
    see :func:`nvfp4_global_scale`). ``swizzle=True`` writes the scales in the 128x4 layout.

    NaN/Inf policy: NVFP4 cannot represent them. With ``check_finite=True`` (default) a non-finite x or
    global scale raises :class:`MoEEpInputError` (this costs one device->host sync; it is skipped while
    a CUDA graph is being captured). With ``check_finite=False`` no check is made and the codes of a
    block holding NaN/Inf are unspecified (but the call never fails).
    """
    _check_x(x, "x")
    if check_finite:
        _check_finite(x, "x")
    K = x.shape[-1]
    lead = x.shape[0] if x.dim() > 1 else 1
    gs = _global_scale_arg(global_scale, x, lead, check_finite)
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    rows_per_gs = max(R // lead, 1) if gs.numel() > 1 else max(R, 1)
    return _launch_quantize(x2, None, gs, R, K, rows_per_gs, tuple(x.shape), swizzle)


def gather_quantize_nvfp4(x: torch.Tensor, row_index: torch.Tensor, global_scale=None, *,
                          swizzle: bool = False, check_finite: bool = True) -> NvFp4Tensor:
    """Quantize the rows ``x[row_index]`` of ``x [M, K]`` into a new ``[len(row_index), K]`` NVFP4 tensor
    in one pass (the bridge's gather + quantize). ``row_index`` int32/int64 on x's device; an entry of -1
    gives an all-zero row (codes 0, scales 0). ``global_scale`` as in :func:`quantize_nvfp4` but scalar
    only; None computes it from all of x (so it does not depend on which rows are gathered).
    Indices must lie in [-1, M); with ``check_finite`` (default) this is checked (one host sync).
    """
    _check_x(x, "x")
    check(x.dim() == 2, "x.dim()", x.dim(), "2 ([M, K])")
    check(isinstance(row_index, torch.Tensor) and row_index.dim() == 1, "row_index",
          getattr(row_index, "shape", row_index), "a 1-D int32/int64 tensor")
    check(row_index.dtype in (torch.int32, torch.int64), "row_index.dtype", row_index.dtype, "int32, int64")
    check(row_index.device == x.device, "row_index.device", str(row_index.device), str(x.device))
    if check_finite:
        _check_finite(x, "x")
        if row_index.numel() and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            lo, hi = int(row_index.min()), int(row_index.max())
            check(lo >= -1 and hi < x.shape[0], "row_index range", (lo, hi), f"[-1, {x.shape[0]})")
    gs = _global_scale_arg(global_scale, x, 1, check_finite)
    check(gs.numel() == 1, "global_scale.numel()", gs.numel(), "1 (one scale for the gathered rows)")
    K = x.shape[1]
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    R = row_index.shape[0]
    return _launch_quantize(x2, row_index.contiguous(), gs, R, K, max(R, 1), (R, K), swizzle)


def dequantize_nvfp4(q: NvFp4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize an :class:`NvFp4Tensor` to ``dtype`` (bf16/fp16/fp32): ``(e2m1(q) * s) / gs`` in fp32."""
    check(isinstance(q, NvFp4Tensor), "type(q)", type(q).__name__, "NvFp4Tensor")
    check(dtype in _DTYPES, "dtype", dtype, "torch.bfloat16, torch.float16, torch.float32")
    shape = tuple(q.shape)
    K = shape[-1]
    R = q.data.numel() // (K // 2) if K else 0
    out = torch.empty(shape, dtype=dtype, device=q.device)
    gs = q.global_scale.reshape(-1).float().contiguous()
    check(gs.numel() == 1 or (R % gs.numel() == 0 and gs.numel() <= max(R, 1)), "q.global_scale.numel()",
          gs.numel(), f"1, or a divisor of the {R} rows (one scale per equal run of rows)")
    rows_per_gs = max(R // gs.numel(), 1) if gs.numel() > 1 else max(R, 1)
    _, slice_rows, slice_cp = _scale_layout(shape, q.swizzled, R)
    if R > 0:
        grid = lambda meta: (triton.cdiv(R, meta["BLOCK_M"]), triton.cdiv(K, meta["BLOCK_K"]))  # noqa: E731
        _dequantize_kernel[grid](q.data, q.scales.view(torch.uint8), gs, out, R, K, rows_per_gs,
                                 max(slice_rows, 1), slice_cp, tuning.size_bucket(K), SWIZZLE=q.swizzled)
    return out


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Linear scales ``[..., M, K/16]`` -> the 128x4 swizzled layout (see ``reference.swizzle_scales_ref``)."""
    check(scales.dtype == torch.float8_e4m3fn, "scales.dtype", scales.dtype, "torch.float8_e4m3fn")
    check(scales.dim() >= 2, "scales.dim()", scales.dim(), ">= 2 ([..., M, K/16])")
    return swizzle_scales_ref(scales)


def unswizzle_scales(buf: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`."""
    check(buf.dtype == torch.float8_e4m3fn, "buf.dtype", buf.dtype, "torch.float8_e4m3fn")
    return unswizzle_scales_ref(buf, rows, scale_cols)



def _compile_checks():
    """(kernel, signature, constexprs) per variant, for tests/test_compile.py (sm_90 / sm_100 builds)."""
    checks = []
    for xt in ("bf16", "fp16", "fp32"):
        for has_idx in (False, True):
            for swz in (False, True):
                sig = {"x_ptr": f"*{xt}", "idx_ptr": "*i64" if has_idx else f"*{xt}", "gs_ptr": "*fp32",
                       "q_ptr": "*u8", "s_ptr": "*u8", **{a: "i32" for a in (
                           "R", "K", "stride_x", "rows_per_gs", "slice_rows", "slice_cp", "K_BUCKET")}}
                checks.append((_quantize_kernel.fn, sig, {"HAS_IDX": has_idx, "SWIZZLE": swz, "BLOCK_M": 16,
                                                          "BLOCK_K": 512}))
        for swz in (False, True):
            sig = {"q_ptr": "*u8", "s_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": f"*{xt}",
                   **{a: "i32" for a in ("R", "K", "rows_per_gs", "slice_rows", "slice_cp", "K_BUCKET")}}
            checks.append((_dequantize_kernel.fn, sig, {"SWIZZLE": swz, "BLOCK_M": 16, "BLOCK_K": 512}))
    return checks
