"""FP8 block-scaled tensors (DeepSeek-V3's format) and their quantize / dequantize kernels, bit-exact with
``moe_ep.reference`` (``quantize_fp8_ref``; docs/DESIGN.md, FP8).

Element ``float8_e4m3fn`` (largest finite 448); one fp32 scale per block of 128 columns and ``block_rows`` rows:
1 for activations (per token per 128 channels), 128 for weights (per 128x128 block, a checkpoint's
``weight_scale_inv``). Per block ``s = amax / 448`` (1.0 for an all-zero block), ``q = e4m3_rne(x / s)``,
saturating at +-448; the value of ``q`` is ``q * s``. Every step is one IEEE fp32 operation as in the reference:
the divisions with ``div_rn`` (Triton's plain ``/`` is approximate on NVIDIA GPUs), the cast to e4m3 round to
nearest even and saturating (``cvt.rn.satfinite``; the interpreter casts through torch, which rounds the same way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import MoEEpInputError, check, fail
from ..triton_runtime import check_on_kernel_device
from . import host_math, launch_cache

FP8_BLOCK = 128  # columns per scale block
FP8_MAX = 448.0
BLOCK_ROWS = (1, 128)  # activations, weights
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_row_scales(hidden: int) -> int:
    """fp32 scales of one activation row of ``hidden`` channels: one per 128 columns, ``ceil(hidden / 128)``."""
    return host_math.cdiv(hidden, FP8_BLOCK)


def fp8_scales_shape(shape, block_rows: int, gate_up: bool = False) -> tuple:
    """Shape of the fp32 scales of an FP8 tensor of ``shape [..., R, K]``: ``[..., ceil(R / block_rows),
    ceil(K / 128)]``; ``gate_up`` (R = 2I, gate rows then up rows, each half blocked on its own):
    ``[..., 2 * ceil(I / block_rows), ceil(K / 128)]``."""
    *lead, R, K = shape
    rows = 2 * host_math.cdiv(R // 2, block_rows) if gate_up else host_math.cdiv(R, block_rows)
    return (*lead, rows, fp8_row_scales(K))


@dataclass
class Fp8Tensor:
    """An FP8 block-scaled tensor: ``data`` float8_e4m3fn ``[..., R, K]``, ``scales`` float32
    ``fp8_scales_shape(data.shape, block_rows, gate_up)``, ``block_rows`` 1 (activations) or 128 (weights).
    Value of element (r, k): ``float(data[..., r, k]) * scales[..., r // block_rows, k // 128]``.

    ``gate_up`` (an expert MLP's ``w13 [..., 2I, K]``, gate rows then up rows): each half has its own row blocks,
    so no block straddles gate and up when I % block_rows != 0 (a checkpoint ships gate's and up's scales apart):
    up row j (data row I + j) takes scale row ``ceil(I / block_rows) + j // block_rows``. Where I is a multiple of
    block_rows this is the plain layout. The parts are checked against each other when made, and again by every
    launcher that takes one."""

    data: torch.Tensor
    scales: torch.Tensor
    block_rows: int = 1
    gate_up: bool = False

    def __post_init__(self):
        self.check("Fp8Tensor")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def row_parts(self, broadcast_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-row parts (``moe_ep.kernels.row_parts``) of activations (``block_rows`` 1): the codes' bytes uint8
        ``[..., R, K]`` and the scales float32 ``[..., R, ceil(K / 128)]`` (nothing is shared by the rows, so
        ``broadcast_shared`` changes nothing)."""
        if self.block_rows != 1 or self.gate_up:
            fail("Fp8Tensor", f"block_rows={self.block_rows} gate_up={self.gate_up}",
                 "block_rows 1, gate_up False (row parts: one scale per row per 128 columns)")
        return self.data.view(torch.uint8), self.scales

    @staticmethod
    def row_part_specs(hidden: int) -> tuple[tuple[int, torch.dtype], ...]:
        """(width, dtype) of each of :meth:`row_parts` for rows of ``hidden`` channels."""
        return (hidden, torch.uint8), (fp8_row_scales(hidden), torch.float32)

    @classmethod
    def from_row_parts(cls, parts) -> Fp8Tensor:
        """Activations (``block_rows`` 1) from row parts as :meth:`row_parts` gives them, of any rows."""
        data, scales = parts
        return cls(data.view(torch.float8_e4m3fn), scales, 1)

    def with_row_parts(self, parts) -> Fp8Tensor:
        """This format with other rows: :meth:`from_row_parts` (an FP8 activation has no part shared by its rows)."""
        return self.from_row_parts(parts)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def check(self, name: str = "q") -> None:
        """Raise :class:`MoEEpInputError` unless the parts agree (dtypes, shapes, one device; no sync)."""
        d, s = self.data, self.scales
        for part, t, dt in (("data", d, torch.float8_e4m3fn), ("scales", s, torch.float32)):
            if not isinstance(t, torch.Tensor):
                fail(f"type({name}.{part})", type(t).__name__, f"a {dt} torch.Tensor")
            if t.dtype != dt:
                fail(f"{name}.{part}.dtype", t.dtype, str(dt))
        if self.block_rows not in BLOCK_ROWS or isinstance(self.block_rows, bool):
            fail(f"{name}.block_rows", self.block_rows, "1 (activations) or 128 (weights)")
        if d.dim() < 2:
            fail(f"{name}.data.shape", tuple(d.shape), "[..., R, K] (at least 2-D)")
        if self.gate_up is not True and self.gate_up is not False:
            fail(f"{name}.gate_up", self.gate_up, "True or False")
        if self.gate_up and d.shape[-2] % 2:
            fail(f"{name}.data.shape", tuple(d.shape), "[..., 2I, K] (an even number of rows with gate_up)")
        want = fp8_scales_shape(d.shape, self.block_rows, self.gate_up)
        if tuple(s.shape) != want:
            fail(f"{name}.scales.shape", tuple(s.shape), f"{want} (one per {self.block_rows}x128 block of "
                 f"data {tuple(d.shape)})")
        if s.device != d.device:
            fail(f"{name} devices (data, scales)", (str(d.device), str(s.device)), "one device for both")


@triton.jit
def _tile(pid_m, cb, R, K, ROW_BLOCKS, PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program's rows (int64, with their mask) and its 128 columns (with theirs): BLOCK_M rows of all R when
    PER_ROW, else one 128-row block of one slice of R rows (ROW_BLOCKS blocks per slice)."""
    cols = cb * 128 + tl.arange(0, 128)
    if PER_ROW:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < R
        rows = rows.to(tl.int64)
    else:
        local = (pid_m % ROW_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = local < R
        rows = (pid_m // ROW_BLOCKS).to(tl.int64) * R + local
    return rows, rmask, cols, cols < K


@triton.jit(do_not_specialize=["R", "ROW_BLOCKS"])
def _quantize_fp8_kernel(x_ptr, q_ptr, s_ptr, R, K, stride_x, ROW_BLOCKS, COL_BLOCKS,
                         PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr):
    """One program: BLOCK_M rows x 128 columns. PER_ROW: one scale per row (R = all rows); else one scale for the
    tile, a 128-row block of one slice of R rows (ROW_BLOCKS blocks per slice)."""
    pid_m = tl.program_id(0)
    cb = tl.program_id(1)
    rows, rmask, cols, cmask = _tile(pid_m, cb, R, K, ROW_BLOCKS, PER_ROW, BLOCK_M)
    m = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * stride_x + cols[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if PER_ROW:
        amax = tl.max(tl.abs(x), axis=1)
        s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        s = tl.where(s > 0, s, 1.0)
        q = tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape))
        tl.store(s_ptr + rows * COL_BLOCKS + cb, s, mask=rmask)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        s = tl.math.div_rn(amax, 448.0)
        s = tl.where(s > 0, s, 1.0)
        q = tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * s)
        tl.store(s_ptr + pid_m.to(tl.int64) * COL_BLOCKS + cb, s)
    q_off = rows[:, None] * K + cols[None, :]
    tl.store(q_ptr + q_off, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m)


@triton.jit(do_not_specialize=["R", "ROW_BLOCKS"])
def _dequantize_fp8_kernel(q_ptr, s_ptr, out_ptr, R, K, ROW_BLOCKS, COL_BLOCKS, PER_ROW: tl.constexpr,
                           BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    cb = tl.program_id(1)
    rows, rmask, cols, cmask = _tile(pid_m, cb, R, K, ROW_BLOCKS, PER_ROW, BLOCK_M)
    if PER_ROW:
        s = tl.load(s_ptr + rows * COL_BLOCKS + cb, mask=rmask, other=0.0)[:, None]
    else:
        s = tl.load(s_ptr + pid_m.to(tl.int64) * COL_BLOCKS + cb)
    m = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * K + cols[None, :]
    q = tl.load(q_ptr + offs, mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    tl.store(out_ptr + offs, (q * s).to(out_ptr.dtype.element_ty), mask=m)


def _grid(lead: int, R: int, K: int, block_rows: int):
    """(programs, rows per program, row blocks per slice): per-row tiles of 16 rows, or one 128-row block each."""
    if block_rows == 1:
        return (host_math.cdiv(lead * R, 16), host_math.cdiv(K, FP8_BLOCK)), 16, 1
    rb = host_math.cdiv(R, 128)
    return (lead * rb, host_math.cdiv(K, FP8_BLOCK)), 128, rb


def quantize_fp8(x: torch.Tensor, block_rows: int = 1, *, check_finite: bool = True,
                 gate_up: bool = False, out: Fp8Tensor | None = None) -> Fp8Tensor:
    """Quantize ``x [..., R, K]`` (bf16/fp16/fp32, on the kernels' device) to FP8 with one scale per
    ``block_rows`` x 128 block (1: activations, per row; 128: weights; blocks never cross the leading dims).
    ``gate_up``: x is ``[..., 2I, K]``, gate rows then up rows, and each half is blocked on its own (an FP8
    ``w13``; see :class:`Fp8Tensor`). ``out``: an ``Fp8Tensor`` of x's shape and ``block_rows`` (contiguous parts,
    x's device) that the codes and scales are written into and that is returned (no allocation: a transport's own
    send buffers); not with ``gate_up``.

    NaN/Inf: FP8 E4M3FN has no Inf and its NaN is no number to compute with; with ``check_finite`` (default) a
    non-finite x raises :class:`MoEEpInputError` (one host sync, skipped under CUDA-graph capture); without it,
    a block holding NaN/Inf gets unspecified codes and scale. No other host sync.
    """
    check(isinstance(x, torch.Tensor), "type(x)", type(x).__name__, "a torch.Tensor")
    check(x.dtype in _DTYPES, "x.dtype", x.dtype, "torch.bfloat16, torch.float16, torch.float32")
    check(x.dim() >= 2, "x.dim()", x.dim(), ">= 2 ([..., R, K])")
    check(block_rows in BLOCK_ROWS and not isinstance(block_rows, bool), "block_rows", block_rows,
          "1 (activations) or 128 (weights)")
    check(isinstance(check_finite, bool), "check_finite", check_finite, "True or False")
    check(isinstance(gate_up, bool), "gate_up", gate_up, "True or False")
    check(not gate_up or x.shape[-2] % 2 == 0, "x.shape", tuple(x.shape), "[..., 2I, K] (even rows) with gate_up")
    check_on_kernel_device(x, "x")
    if out is not None:
        _check_out(out, x, block_rows, gate_up)
    if check_finite and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        if not bool(torch.isfinite(x).all()):
            raise MoEEpInputError("x holds NaN or Inf; allowed: finite values (pass check_finite=False to skip "
                                  "this check and get unspecified codes for those blocks)")
    if gate_up:  # each half on its own: scales of gate's row blocks, then up's
        half = x.shape[-2] // 2
        gate, up = (quantize_fp8(h, block_rows, check_finite=False) for h in (x[..., :half, :], x[..., half:, :]))
        return Fp8Tensor(torch.cat([gate.data, up.data], dim=-2), torch.cat([gate.scales, up.scales], dim=-2),
                         block_rows, True)
    *lead_dims, R, K = x.shape
    lead = math.prod(lead_dims)
    x2 = x.detach().reshape(-1, K) if K else x.detach().reshape(lead * R, 0)
    if K and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(fp8_scales_shape(x.shape, block_rows), dtype=torch.float32, device=x.device)
    else:
        q, s = out.data, out.scales
    if q.numel():
        grid, bm, rb = _grid(lead, R, K, block_rows)
        launch_cache.launch(_quantize_fp8_kernel, grid, x2, q.view(torch.uint8), s, lead * R if block_rows == 1 else R,
                            K, x2.stride(0), rb, grid[1], PER_ROW=block_rows == 1, BLOCK_M=bm)
    return Fp8Tensor(q, s, block_rows) if out is None else out


def _check_out(out, x: torch.Tensor, block_rows: int, gate_up: bool) -> None:
    """``quantize_fp8``'s ``out``: an Fp8Tensor of x's shape and block rows, contiguous parts on x's device."""
    check(isinstance(out, Fp8Tensor), "type(out)", type(out).__name__, "an Fp8Tensor")
    check(not gate_up, "out", "an Fp8Tensor", "None with gate_up (its halves are quantized apart)")
    check(tuple(out.shape) == tuple(x.shape) and out.block_rows == block_rows, "out (shape, block_rows)",
          (tuple(out.shape), out.block_rows), f"({tuple(x.shape)}, {block_rows}): x's")
    check(out.data.is_contiguous() and out.scales.is_contiguous(), "out parts contiguous",
          (out.data.is_contiguous(), out.scales.is_contiguous()), "(True, True)")
    check(out.data.device == x.device, "out.data.device", str(out.data.device), f"{x.device} (x's)")


def dequantize_fp8(q: Fp8Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q.data * q.scales`` (each scale over its block) in fp32, cast to ``dtype`` (bf16/fp16/fp32)."""
    check(isinstance(q, Fp8Tensor), "type(q)", type(q).__name__, "Fp8Tensor")
    check(dtype in _DTYPES, "dtype", dtype, "torch.bfloat16, torch.float16, torch.float32")
    q.check("q")
    check_on_kernel_device(q.data, "q.data")
    if q.gate_up:
        half, blocks = q.shape[-2] // 2, q.scales.shape[-2] // 2
        return torch.cat([dequantize_fp8(Fp8Tensor(q.data[..., :half, :], q.scales[..., :blocks, :], q.block_rows),
                                         dtype),
                          dequantize_fp8(Fp8Tensor(q.data[..., half:, :], q.scales[..., blocks:, :], q.block_rows),
                                         dtype)], dim=-2)
    *lead_dims, R, K = q.shape
    lead = math.prod(lead_dims)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if out.numel():
        grid, bm, rb = _grid(lead, R, K, q.block_rows)
        launch_cache.launch(_dequantize_fp8_kernel, grid, q.data.contiguous().view(torch.uint8), q.scales.contiguous(),
                            out, lead * R if q.block_rows == 1 else R, K, rb, grid[1], PER_ROW=q.block_rows == 1,
                            BLOCK_M=bm)
    return out
