"""Grouped GEMM over experts, ``y_g = x_g @ w_g^T``: masked or ragged rows, bf16 or NVFP4 operands.

One kernel covers every variant (constexpr flags). A program computes one ``BLOCK_M x BLOCK_N`` output
tile of one expert. Its expert and row tile come from the device-side counts (masked) or offsets (ragged)
alone: each program loads the per-expert counts, takes ``cumsum(cdiv(count, BLOCK_M))`` and finds its
expert by counting how many prefix sums lie at or below its tile index. So there is no host sync and no
schedule tensor; the grid is a fixed upper bound and surplus programs exit at once. Empty experts own no
tiles, and in the masked layout no program reads, computes or writes a row past ``counts[g]``.

NVFP4 operands are decoded in registers to bf16 (an E2M1 value times an E4M3 scale is exact in bf16) and
fed to bf16 ``tl.dot``; the fp32 global scales are applied to the fp32 accumulator. NVFP4 weights are decoded
by a few integer ops and one bf16x2 fma per pair (inline PTX, :data:`_FP4_ASM`) straight into the layout of
wgmma's register operand (swapped) with K permuted (:func:`_k_perm`, x follows) so each thread reads whole
words of packed codes and two scales per row: the decode, not the weight bytes, was the decode-time bound.
(``tl.dot_scaled`` is not used: with e4m3 scales in 16-blocks it crashes Triton 3.6's
compiler on Hopper; the register path is what runs on Blackwell too.)

Decode shapes swap the operands (``acc^T = W x^T``) so the handful of tokens sits in the MMA's N slot and
BLOCK_N weight rows fill its M slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import MoEEpInputError, check
from ..triton_runtime import INTERPRETER, device as kernel_device
from . import tuning
from .nvfp4 import NvFp4Tensor, e4m3_values_of_bytes


# 4 packed bytes (8 codes) -> lo / hi nibbles as bf16 bit patterns e2m1 * 2^-126 (magnitude into exponent LSBs
# and mantissa MSB; code 1 lands on a bf16 subnormal, which bf16 fma keeps), times s * 2^118 with one bf16x2 fma per
# pair: integer ops and no cvt (cvt runs at 1/4 the rate and made the decode, not the weight bytes, the bound).
_FP4_ASM = tl.constexpr("""{
.reg .b32 t, u, m, z;
mov.b32 z, 0x80008000;
prmt.b32 t, $4, 0, 0x4140;
prmt.b32 u, $4, 0, 0x4342;
and.b32 m, t, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0; fma.rn.bf16x2 $0, m, $5, z;
and.b32 m, u, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0; fma.rn.bf16x2 $1, m, $6, z;
and.b32 m, t, 0x00F000F0; mul.lo.u32 m, m, 0x104; and.b32 m, m, 0x81C081C0; fma.rn.bf16x2 $2, m, $5, z;
and.b32 m, u, 0x00F000F0; mul.lo.u32 m, m, 0x104; and.b32 m, m, 0x81C081C0; fma.rn.bf16x2 $3, m, $6, z;
}""")
_DECODE_ASM = tl.constexpr(not INTERPRETER)  # the interpreter runs no inline asm: same values, plain ops


@triton.jit
def _fp4_tile(packed, scale_bytes, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed E2M1 bytes [R, BLOCK_K / 2] and their E4M3 scale bytes [R, BLOCK_K / 16] -> bf16 [R, BLOCK_K] in
    natural k order, holding ``e2m1 * s * 2^-8`` (exact; the caller folds 2^8 into the global scale). The join
    puts a byte's two nibbles side by side, which is what a thread holds of a wgmma register operand."""
    s_val, _ = e4m3_values_of_bytes(scale_bytes.to(tl.int32))
    HK: tl.constexpr = BLOCK_K // 2
    if _DECODE_ASM:
        s = (s_val * 3.3230699894622794e35).to(tl.bfloat16)  # 2^118: exact, s <= 448 keeps it below bf16's max
        s = tl.reshape(tl.broadcast_to(s[:, :, None], [R, BLOCK_K // 16, 8]), [R, HK])
        w_lo, w_hi = tl.inline_asm_elementwise(_FP4_ASM, "=r,=r,=r,=r,r,r,r", [packed, s],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        p = packed.to(tl.int32)
        s = s_val * 64.0  # the fp16 trick below yields e2m1 * 2^-14
        s = tl.reshape(tl.broadcast_to(s[:, :, None], [R, BLOCK_K // 16, 8]), [R, HK])
        lo = (((p & 7) << 9) | ((p & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (((p & 0x70) << 5) | ((p & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        w_lo = (lo.to(tl.float32) * s).to(tl.bfloat16)
        w_hi = (hi.to(tl.float32) * s).to(tl.bfloat16)
    # physical (c, j, h, e) -> logical k = 16j + 8h + 2c + e (see _k_perm)
    w = tl.reshape(tl.join(w_lo, w_hi), [R, 4, BLOCK_K // 16, 2, 2])
    return tl.reshape(tl.permute(w, (0, 2, 3, 1, 4)), [R, BLOCK_K])


@triton.jit
def _k_perm(BLOCK_K: tl.constexpr):
    """Physical k offset (in the tile) of each logical k the NVFP4-weight dot sees. A wgmma register operand
    gives a thread k = 2c, 2c+1, 2c+8, 2c+9 of every 16-chunk; ordering K so those are physically adjacent
    hands each thread whole 4 * BLOCK_K / 16 element runs of a row: vector shared loads, 2 scales per row.
    A permutation of K (applied to x too) leaves the dot unchanged."""
    l = tl.arange(0, BLOCK_K)
    p = (l % 8 // 2) * (BLOCK_K // 4) + (l // 16) * 4 + (l // 8 % 2) * 2 + l % 2
    return tl.max_contiguous(tl.multiple_of(p, 2), 2)  # pairs stay adjacent: 4-byte async copies of x


@triton.jit
def _mma(acc, a, b, SWAP_AB: tl.constexpr):
    """acc += a @ b^T (a [M, K], b [N, K]); swapped (a given as [K, M]): acc^T += b @ a."""
    if SWAP_AB:
        out = tl.dot(b, a, acc)
    else:
        out = tl.dot(a, tl.trans(b), acc)
    return out


@triton.jit
def _as_rows(v, SWAP_AB: tl.constexpr):
    """A per-row vector broadcast against the accumulator ([BM, BN], or [BN, BM] when swapped)."""
    if SWAP_AB:
        out = v[None, :]
    else:
        out = v[:, None]
    return out


@triton.jit
def _as_cols(v, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        out = v[:, None]
    else:
        out = v[None, :]
    return out


@triton.jit
def _fp4_value(code, scale):
    """E2M1 codes (int32, 4 bits) times fp32 block scales -> bf16 (exact), elementwise."""
    h = (((code & 7) << 9) | ((code & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
    return (h.to(tl.float32) * (scale * 16384.0)).to(tl.bfloat16)


@triton.jit
def _load_x_fp4(x_ptr, xs_ptr, xrow, rmask, kk, K, SWAP_AB: tl.constexpr):
    """NVFP4 x at columns kk (any order) -> bf16 [rows, k] ([k, rows] when swapped). Each element loads its
    own byte and scale (x is the small operand; repeated addresses hit L1): no nibble interleave or scale
    broadcast through shared memory."""
    r = _as_rows(xrow, SWAP_AB)
    k = _as_cols(kk, SWAP_AB)
    m = _as_rows(rmask, SWAP_AB) & (k < K)
    b = tl.load(x_ptr + r * (K // 2) + k // 2, mask=m, other=0).to(tl.int32)
    sb = tl.load(xs_ptr + r * (K // 16) + k // 16, mask=m, other=0).to(tl.int32)
    s_val, _ = e4m3_values_of_bytes(sb)
    return _fp4_value((b >> ((k & 1) * 4)) & 0xF, s_val)


@triton.jit
def _load_x_cols(x_ptr, xs_ptr, xrow, rmask, kk, K, X_FP4: tl.constexpr, SWAP_AB: tl.constexpr):
    """x at columns kk as bf16: [rows, len(kk)], or [len(kk), rows] when swapped (so no transpose is needed
    before the MMA, where x is the second operand)."""
    if X_FP4:
        xt = _load_x_fp4(x_ptr, xs_ptr, xrow, rmask, kk, K, SWAP_AB)
    else:
        k = _as_cols(kk, SWAP_AB)
        xt = tl.load(x_ptr + _as_rows(xrow, SWAP_AB) * K + k, mask=_as_rows(rmask, SWAP_AB) & (k < K), other=0.0)
    return xt


@triton.jit
def _accumulate(acc, xt, w_ptr, ws_ptr, wrow, nmask, k0, K, K16, W_FP4: tl.constexpr, SWAP_AB: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += x[rows, k0:k0+BLOCK_K] @ w[wrow, k0:k0+BLOCK_K]^T for one K step (x loaded by the caller)."""
    if W_FP4:
        hk = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        q = tl.load(w_ptr + wrow[:, None] * (K // 2) + hk[None, :], mask=nmask[:, None] & (hk[None, :] < K // 2),
                    other=0)
        # row stride K16 is its own argument so Triton specializes it as a multiple of 16: aligned vector loads,
        # which the pipeliner needs to prefetch the scales asynchronously
        sk = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        sb = tl.load(ws_ptr + wrow[:, None] * K16 + sk[None, :], mask=nmask[:, None] & (sk[None, :] < K16), other=0)
        w = _fp4_tile(q, sb, BLOCK_N, BLOCK_K)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + wrow[:, None] * K + kk[None, :], mask=nmask[:, None] & (kk[None, :] < K), other=0.0)
    return _mma(acc, xt, w, SWAP_AB)


@triton.jit
def _grouped_gemm_kernel(
        x_ptr, xs_ptr, xgs_ptr,  # x: bf16 [rows, K] or packed uint8 [rows, K/2] + e4m3 bytes [rows, K/16] + fp32 gs
        XGS_STRIDE,  # 0: one global scale for x; 1: one per row (tokens keep their source rank's scale)
        w_ptr, ws_ptr, wgs_ptr,  # w: bf16 [G, NW, K] or packed [G, NW, K/2] + scales [G, NW, K/16] + gs [G]
        out_ptr, rs_ptr,  # out bf16 [rows, N]; row scale fp32 [rows]
        cnt_ptr,  # masked: counts [G]; ragged: offsets [G+1]
        G, M_MAX, N, K, K16, S,  # K16 = K // 16
        M_BUCKET,  # autotune key only
        RAGGED: tl.constexpr, X_FP4: tl.constexpr, W_FP4: tl.constexpr, SWIGLU: tl.constexpr,
        HAS_RS: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
        GROUP_M: tl.constexpr):
    # program -> (row tile t, column tile): GROUP_M row tiles share a weight column tile while it is in L2
    pid = tl.program_id(0)
    if RAGGED:  # the row-tile upper bound the launcher sized the grid with
        TILES_M = tl.cdiv(S, BLOCK_M) + G
    else:
        TILES_M = G * tl.cdiv(M_MAX, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * n_tiles
    first_t = (pid // width) * GROUP_M
    group_rows = tl.minimum(TILES_M - first_t, GROUP_M)
    t = first_t + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows

    # row tile t -> (expert g, its row tile), from the device-side counts
    gi = tl.arange(0, BLOCK_G)
    gmask = gi < G
    if RAGGED:
        lo = tl.minimum(tl.maximum(tl.load(cnt_ptr + gi, mask=gmask, other=0).to(tl.int32), 0), S)
        hi = tl.minimum(tl.maximum(tl.load(cnt_ptr + gi + 1, mask=gmask, other=0).to(tl.int32), 0), S)
        cnt = tl.maximum(hi - lo, 0)
    else:
        cnt = tl.minimum(tl.maximum(tl.load(cnt_ptr + gi, mask=gmask, other=0).to(tl.int32), 0), M_MAX)
        lo = gi.to(tl.int64) * M_MAX
    tiles = (cnt + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    if t >= tl.sum(tiles):
        return
    g = tl.sum((ends <= t).to(tl.int32))
    sel = gi == g
    tile = t - tl.sum(tl.where(sel, ends - tiles, 0))
    count = tl.sum(tl.where(sel, cnt, 0))
    row0 = tl.sum(tl.where(sel, lo, 0)).to(tl.int64)

    rm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rm < count
    xrow = row0 + rm  # int64: row * K can pass 2^31
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    NW = 2 * N if SWIGLU else N
    wrow = g.to(tl.int64) * NW + rn

    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = acc
    for k0 in range(0, K, BLOCK_K):
        if W_FP4:
            xt = _load_x_cols(x_ptr, xs_ptr, xrow, rmask, k0 + _k_perm(BLOCK_K), K, X_FP4, SWAP_AB)
        else:
            xt = _load_x_cols(x_ptr, xs_ptr, xrow, rmask, k0 + tl.arange(0, BLOCK_K), K, X_FP4, SWAP_AB)
        acc = _accumulate(acc, xt, w_ptr, ws_ptr, wrow, nmask, k0, K, K16, W_FP4, SWAP_AB, BLOCK_N, BLOCK_K)
        if SWIGLU:  # the matching up rows (N further down), so the [*, 2I] intermediate is never written
            acc_up = _accumulate(acc_up, xt, w_ptr, ws_ptr, wrow + N, nmask, k0, K, K16, W_FP4, SWAP_AB, BLOCK_N,
                                 BLOCK_K)

    if W_FP4:  # global scales: value = e2m1 * s / gs, so divide the fp32 sums once (256: the weight tiles
        inv = 256.0 / tl.load(wgs_ptr + g)  # hold e2m1 * s / 256)
        acc = acc * inv
        acc_up = acc_up * inv
    if X_FP4:
        xinv = _as_rows(1.0 / tl.load(xgs_ptr + xrow * XGS_STRIDE, mask=rmask, other=1.0), SWAP_AB)
        acc = acc * xinv
        acc_up = acc_up * xinv
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if HAS_RS:
        acc = acc * _as_rows(tl.load(rs_ptr + xrow, mask=rmask, other=0.0), SWAP_AB)
    ptrs = out_ptr + _as_rows(xrow * N, SWAP_AB) + _as_cols(rn, SWAP_AB)
    tl.store(ptrs, acc.to(tl.bfloat16), mask=_as_rows(rmask, SWAP_AB) & _as_cols(nmask, SWAP_AB))


_KEY = ["M_BUCKET", "N", "K", "RAGGED", "X_FP4", "W_FP4", "SWIGLU", "HAS_RS"]
_autotuned = triton.autotune(configs=tuning.grouped_gemm_configs(), key=_KEY,
                             prune_configs_by={"early_config_prune": tuning.prune_grouped_gemm_configs})(
                                 _grouped_gemm_kernel)

last_launch: dict = {}
"""What the latest :func:`grouped_gemm` call launched: ``source`` ("tuned-file" or "autotune") and ``config``
(the config the autotuner picked is known after the call)."""


def _operand(t, name: str, dims: int, what: str):
    """(data, scales bytes, global scale, logical shape, is_fp4) of a bf16 tensor or an NvFp4Tensor."""
    dev = kernel_device()
    if isinstance(t, NvFp4Tensor):
        check(not t.swizzled, f"{name}.swizzled", t.swizzled, "False (linear scales)")
        check(len(t.shape) == dims, f"{name}.shape", tuple(t.shape), what)
        check(t.data.dtype == torch.uint8 and tuple(t.data.shape) == (*t.shape[:-1], t.shape[-1] // 2),
              f"{name}.data", f"{t.data.dtype} {tuple(t.data.shape)}", f"uint8 {(*t.shape[:-1], t.shape[-1] // 2)}")
        check(t.scales.dtype == torch.float8_e4m3fn and tuple(t.scales.shape) == (*t.shape[:-1], t.shape[-1] // 16),
              f"{name}.scales", f"{t.scales.dtype} {tuple(t.scales.shape)}",
              f"float8_e4m3fn {(*t.shape[:-1], t.shape[-1] // 16)}")
        check(t.global_scale.dtype == torch.float32, f"{name}.global_scale.dtype", t.global_scale.dtype,
              "torch.float32")
        for part in ("data", "scales", "global_scale"):
            d = getattr(t, part).device
            check(d.type == dev.type, f"{name}.{part}.device", str(d), f"{dev.type} (where the kernels run here)")
        return (t.data.contiguous(), t.scales.contiguous().view(torch.uint8), t.global_scale.reshape(-1).contiguous(),
                tuple(t.shape), True)
    check(isinstance(t, torch.Tensor), f"type({name})", type(t).__name__, "a bf16 torch.Tensor or an NvFp4Tensor")
    check(t.dtype == torch.bfloat16, f"{name}.dtype", t.dtype, "torch.bfloat16 (or an NvFp4Tensor)")
    check(t.dim() == dims, f"{name}.shape", tuple(t.shape), what)
    check(t.device.type == dev.type, f"{name}.device", str(t.device), f"{dev.type} (where the kernels run here)")
    return t.contiguous(), None, None, tuple(t.shape), False


def _index(t, name: str, length: int, dev) -> torch.Tensor:
    check(isinstance(t, torch.Tensor), f"type({name})", type(t).__name__, "a torch.Tensor")
    check(t.dtype in (torch.int32, torch.int64), f"{name}.dtype", t.dtype, "torch.int32 or torch.int64")
    check(tuple(t.shape) == (length,), f"{name}.shape", tuple(t.shape), f"({length},)")
    check(t.device == dev, f"{name}.device", str(t.device), str(dev))
    return t.contiguous()


def grouped_gemm(x, w, *, counts: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                 swiglu: bool = False, row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 m_hint: int | None = None) -> torch.Tensor:
    """Grouped GEMM ``y_g = x_g @ w_g^T`` per expert g, fp32 accumulation, bf16 output.

    Layouts (exactly one of ``counts`` / ``offsets``, int32/int64 on x's device; no host sync, so the call
    can be captured in a CUDA graph once autotuning has run for its shape):

    - masked: ``x [G, M_max, K]``, ``counts [G]``; returns ``[G, M_max, N]``. Rows ``>= counts[g]`` are
      never read, computed or written (the output is allocated with ``torch.empty``: they hold garbage).
    - ragged: ``x [S, K]`` sorted by expert, ``offsets [G+1]`` (nondecreasing, in ``[0, S]``); rows
      ``offsets[g]:offsets[g+1]`` belong to expert g. Returns ``[S, N]``; rows outside every expert are
      not written.

    ``x``: bf16, or an :class:`NvFp4Tensor` (linear scales; one global scale, or one per row as
    received NVFP4 tokens carry their source rank's). ``w``: bf16 ``[G, N, K]``,
    or an NvFp4Tensor of that shape (linear scales, global scale ``[G]``, one per expert). K % 16 == 0.
    ``swiglu``: w holds gate rows then up rows (``[G, 2I, K]``) and the result is ``silu(gate) * up``,
    ``[*, I]``, without the ``[*, 2I]`` intermediate ever being written. ``row_scale``: float32, one factor
    per row of x (``[G, M_max]`` / ``[S]``), applied to the output row (the routing weight).
    ``out``: optional bf16 contiguous output to write into. ``m_hint``: expected tokens per expert, to pick
    the tuned config (default: M_max when masked, S / G when ragged).
    """
    check((counts is None) != (offsets is None), "(counts, offsets)",
          ("tensor" if counts is not None else None, "tensor" if offsets is not None else None),
          "exactly one of counts (masked layout) or offsets (ragged layout)")
    ragged = offsets is not None
    xd, xs, xgs, xshape, x_fp4 = _operand(x, "x", 2 if ragged else 3,
                                          "[S, K] (ragged)" if ragged else "[G, M_max, K] (masked)")
    wd, ws, wgs, wshape, w_fp4 = _operand(w, "w", 3, "[G, N, K]")
    G, NW, K = wshape
    check(G >= 1, "w.shape[0] (G)", G, ">= 1")
    check(K >= 16 and K % 16 == 0, "w.shape[2] (K)", K, "a positive multiple of 16")
    check(xshape[-1] == K, "x.shape[-1]", xshape[-1], f"{K} (w's K)")
    check(NW >= 1 and (not swiglu or NW % 2 == 0), "w.shape[1] (N)", NW,
          "an even number >= 2 (gate rows then up rows)" if swiglu else ">= 1")
    dev = (x.data if x_fp4 else x).device
    if x_fp4:
        n_rows = xd.numel() // (K // 2)
        check(xgs.numel() in (1, n_rows), "x.global_scale.shape", tuple(x.global_scale.shape),
              f"a scalar, or one per row ({n_rows} = {tuple(xshape[:-1])})")
    if w_fp4:
        check(wgs.numel() in (1, G), "w.global_scale.shape", tuple(w.global_scale.shape), f"[{G}] (one per expert)")
        wgs = wgs.expand(G).contiguous()
    if ragged:
        S, M_max = xshape[0], 0
        idx = _index(offsets, "offsets", G + 1, dev)
        rows_shape = (S,)
    else:
        check(xshape[0] == G, "x.shape[0]", xshape[0], f"{G} (w's number of experts G)")
        S, M_max = G * xshape[1], xshape[1]
        idx = _index(counts, "counts", G, dev)
        rows_shape = (G, M_max)
    N = NW // 2 if swiglu else NW
    if row_scale is not None:
        check(isinstance(row_scale, torch.Tensor) and row_scale.dtype == torch.float32, "row_scale.dtype",
              getattr(row_scale, "dtype", type(row_scale).__name__), "torch.float32")
        check(tuple(row_scale.shape) == rows_shape, "row_scale.shape", tuple(row_scale.shape), str(rows_shape))
        check(row_scale.device == dev, "row_scale.device", str(row_scale.device), str(dev))
        row_scale = row_scale.contiguous()
    if out is None:
        out = torch.empty(*rows_shape, N, dtype=torch.bfloat16, device=dev)
    else:
        check(isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16, "out.dtype",
              getattr(out, "dtype", type(out).__name__), "torch.bfloat16")
        check(tuple(out.shape) == (*rows_shape, N), "out.shape", tuple(out.shape), str((*rows_shape, N)))
        check(out.device == dev and out.is_contiguous(), "out", f"{out.device}, contiguous={out.is_contiguous()}",
              f"a contiguous tensor on {dev}")
    if S == 0:
        return out

    m = m_hint if m_hint is not None else (M_max if not ragged else triton.cdiv(S, G))
    dummy = xd
    xgs_stride = int(x_fp4 and xgs.numel() > 1)  # per-row global scales (received NVFP4 tokens)
    args = (xd, xs if x_fp4 else dummy, xgs if x_fp4 else dummy, xgs_stride, wd, ws if w_fp4 else dummy,
            wgs if w_fp4 else dummy, out, row_scale if row_scale is not None else dummy, idx)

    def tiles_m(bm):  # upper bound on row tiles: every expert full (masked), or S rows plus a ragged tail each
        return triton.cdiv(S, bm) + G if ragged else G * triton.cdiv(M_max, bm)

    flags = dict(RAGGED=ragged, X_FP4=x_fp4, W_FP4=w_fp4, SWIGLU=bool(swiglu), HAS_RS=row_scale is not None,
                 BLOCK_G=max(triton.next_power_of_2(G), 2))
    tuned = tuning.tuned_gemm_config(N, K, m, x_fp4, w_fp4, bool(swiglu))
    if tuned is not None:
        cfg = dict(tuned)
        grid = (tiles_m(cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _grouped_gemm_kernel[grid](*args, G, M_max, N, K, K // 16, S, tuning.m_bucket(m), **flags, **cfg)
        last_launch.update(source="tuned-file", config=cfg)
        return out

    def grid(meta):
        return (tiles_m(meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _autotuned[grid](*args, G, M_max, N, K, K // 16, S, tuning.m_bucket(m), **flags)
    best = getattr(_autotuned, "best_config", None)
    last_launch.update(source="autotune", config=dict(best.all_kwargs()) if best is not None else None)
    return out


def expert_mlp(x, w13, w2, *, counts: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
               row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
               m_hint: int | None = None) -> torch.Tensor:
    """Expert SwiGLU MLP ``(silu(x W1^T) * (x W3^T)) W2^T`` per expert: two grouped GEMMs, bf16 in between.

    ``w13 [G, 2I, H]`` (gate rows then up rows) and ``w2 [G, H, I]``: bf16 tensors or NvFp4Tensors (global
    scale per expert). ``x``, ``counts`` / ``offsets``, ``row_scale`` (applied to the output of the second
    GEMM), ``out`` and ``m_hint`` as in :func:`grouped_gemm`. Returns bf16 ``[G, M_max, H]`` (masked; rows past
    the counts untouched) or ``[S, H]`` (ragged).
    """
    shape13 = tuple(w13.shape) if isinstance(w13, (torch.Tensor, NvFp4Tensor)) else None
    shape2 = tuple(w2.shape) if isinstance(w2, (torch.Tensor, NvFp4Tensor)) else None
    check(shape13 is not None and len(shape13) == 3, "w13.shape", shape13, "[G, 2I, H]")
    check(shape2 is not None and len(shape2) == 3, "w2.shape", shape2, "[G, H, I]")
    G, I2, H = shape13
    check(shape2 == (G, H, I2 // 2), "w2.shape", shape2, f"{(G, H, I2 // 2)} (from w13 {shape13})")
    h = grouped_gemm(x, w13, counts=counts, offsets=offsets, swiglu=True, m_hint=m_hint)
    return grouped_gemm(h, w2, counts=counts, offsets=offsets, row_scale=row_scale, out=out, m_hint=m_hint)


def _compile_checks():
    """(raw jit function, signature, constexprs) per kernel variant, one representative config each,
    for ``tests/test_compile.py`` (``triton.compile`` for sm_90 / sm_100 without the interpreter)."""
    checks = []
    for ragged in (False, True):
        for x_fp4 in (False, True):
            for w_fp4 in (False, True):
                for swiglu, has_rs in ((True, False), (False, True)):
                    for swap in (True, False):
                        sig = {"x_ptr": "*u8" if x_fp4 else "*bf16", "xs_ptr": "*u8", "xgs_ptr": "*fp32",
                               "XGS_STRIDE": "i32",
                               "w_ptr": "*u8" if w_fp4 else "*bf16", "ws_ptr": "*u8", "wgs_ptr": "*fp32",
                               "out_ptr": "*bf16", "rs_ptr": "*fp32", "cnt_ptr": "*i32",
                               "G": "i32", "M_MAX": "i32", "N": "i32", "K": "i32", "K16": "i32", "S": "i32", "M_BUCKET": "i32"}
                        const = {"RAGGED": ragged, "X_FP4": x_fp4, "W_FP4": w_fp4, "SWIGLU": swiglu,
                                 "HAS_RS": has_rs, "BLOCK_G": 32,
                                 "BLOCK_M": 16 if swap else 128, "BLOCK_N": 128 if swap else 128,
                                 "BLOCK_K": 128 if swap else 64, "SWAP_AB": swap, "GROUP_M": 8}
                        for name in const:
                            sig[name] = "constexpr"
                        checks.append((_grouped_gemm_kernel, sig, const))
    return checks

