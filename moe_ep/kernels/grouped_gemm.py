"""Grouped GEMM over experts, ``y_g = x_g @ w_g^T``: masked or ragged rows, bf16 or NVFP4 operands.

One kernel covers every variant (constexpr flags). A program computes one ``BLOCK_M x BLOCK_N`` output
tile of one expert. Its expert and row tile come from the device-side counts (masked) or offsets (ragged)
alone (``tile_schedule.py``). So there is no host sync and no schedule tensor; the grid is a fixed upper bound
and surplus programs exit at once. Empty experts own no
tiles, and in the masked layout no program reads or writes a row past ``counts[g]`` (tile slots past it
compute on a copy of the expert's last row and are not stored). SwiGLU interleaves each gate row with its up
row, so one dot per K step covers both. A masked layout whose row capacity would launch more programs than a few
rounds of what fits on the GPU uses a persistent grid instead: program p takes tiles p, p + P, ... of the same
device-side tile count (:func:`_persistent`), so capacity past the counts launches nothing.

NVFP4 operands are decoded to bf16 (an E2M1 value times an E4M3 scale is exact in bf16) and fed to bf16 ``tl.dot``;
the fp32 global scales are applied to the fp32 accumulator. NVFP4 x is decoded once into a transient bf16 copy
(``fp4_mma.decode_nvfp4``; in the masked layout only the rows within the counts) before every GEMM: x is small, and
every column tile reads it. NVFP4 weights below prefill sizes (the decode-time bound: instructions, not bytes) are
read as int16 words of 4 codes and decoded in registers (``fp4_mma.py``: 3 integer ops and one bf16x2 fma per
register pair); with K permuted those registers are wgmma's register operand as they are (swapped), with no
shuffles, and each thread reads whole vectors of words and 2 scales per row. x follows the permutation in registers
on its way to shared memory. From ``tuning.DECODED_MIN_M`` tokens per expert on, weights are decoded into a bf16
copy too, and bf16 tiles run. (``tl.dot_scaled`` is not used: with e4m3 scales in 16-blocks it crashes Triton 3.6's
compiler on Hopper; the register path is what runs on Blackwell too.)

Decode shapes mostly swap the operands (``acc^T = W x^T``) so the handful of tokens sits in the MMA's N slot and
BLOCK_N weight rows fill its M slot; their row tiles are up to twice the mean tokens per expert, so that an expert's
routed rows take one pass over its weights (``tuning.prune_grouped_gemm_configs``).

Prefill shapes with bf16 weights in the ragged layout also have TMA configs (``TMA: True``; Hopper and newer):
x and weight tiles come by tensor descriptors instead of per-thread pointer loads, gate and up tiles are two
loads into two accumulators, and a persistent grid of as many programs as fit on the GPU walks the device-side
tile count (:func:`_tma_tiles`), so a program's next tile starts without a new launch wave. On the H200 this is
7-11% faster than the pointer-load tiles at 512-1024 tokens per expert, 1-2% at 128 (docs/PERF.md). The masked
layout keeps pointer loads: a TMA box would read an expert's padding rows.

:func:`expert_mlp` chains its two GEMMs for decode shapes with bf16 weights (``chain.py``): GEMM1 counts its finished
tiles per expert, GEMM2 (a programmatic dependent launch on Hopper and newer) waits per expert instead of for all of
GEMM1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..errors import check
from ..triton_runtime import device as kernel_device
from . import tuning
from .chain import Link, allow_dependents, dependent_launch_supported, expert_ready, finish_dependent, tile_done
from .chain import enabled as chain_enabled
from .fp4_mma import decode_nvfp4, dot_k_order, fp4_tile
from .nvfp4 import NvFp4Tensor
from .tile_schedule import expert_row_tiles, group_order, row_tile_slots, tile_expert, tile_slots


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
def _load_k(ptrs, k, K, EVEN_K: tl.constexpr):
    """Load a K-step tile; k (broadcast against ptrs) past K reads 0. EVEN_K (K % BLOCK_K == 0): no mask."""
    if EVEN_K:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=k < K, other=0)
    return v


@triton.jit
def _load_x_cols(x_ptr, xrow, kk, K, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr):
    """x at columns kk: [rows, len(kk)], or [len(kk), rows] when swapped (so no transpose is needed before the MMA,
    where x is the second operand)."""
    k = _as_cols(kk, SWAP_AB)
    return _load_k(x_ptr + _as_rows(xrow, SWAP_AB) * K + k, k, K, EVEN_K)


@triton.jit
def _accumulate(acc, xt, w_ptr, ws_ptr, wrow, k0, K, KQ, K16, W_FP4: tl.constexpr, SWAP_AB: tl.constexpr,
                EVEN_K: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += x[rows, k0:k0+BLOCK_K] @ w[wrow, k0:k0+BLOCK_K]^T for one K step (x loaded by the caller, in the
    dot's k order when W_FP4)."""
    if W_FP4:
        qk = k0 // 4 + tl.arange(0, BLOCK_K // 4)  # int16 words of 4 codes
        q = _load_k(w_ptr.to(tl.pointer_type(tl.int16)) + wrow[:, None] * KQ + qk[None, :], qk[None, :], KQ, EVEN_K)
        sk = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        sb = _load_k(ws_ptr + wrow[:, None] * K16 + sk[None, :], sk[None, :], K16, EVEN_K)
        w = fp4_tile(q, sb, R, BLOCK_K, SWAP_AB)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = _load_k(w_ptr + wrow[:, None] * K + kk[None, :], kk[None, :], K, EVEN_K)
    return _mma(acc, xt, w, SWAP_AB)


@triton.jit
def _global_scale(acc, acc_up, wgs_ptr, g):
    """NVFP4 weights' global scale: value = e2m1 * s / gs, and the weight tiles hold e2m1 * s / 256 (fp4_tile), so
    the fp32 sums are multiplied once by 256 / gs."""
    inv = 256.0 / tl.load(wgs_ptr + g)
    return acc * inv, acc_up * inv


@triton.jit
def _x_global_scale(acc, acc_up, xgs_ptr, x_rows, XGS_STRIDE, SWAP_AB: tl.constexpr):
    """NVFP4 x's global scale (one, or one per row): its decoded copy holds e2m1 * s / 256."""
    inv = _as_rows(256.0 / tl.load(xgs_ptr + x_rows * XGS_STRIDE), SWAP_AB)
    return acc * inv, acc_up * inv


@triton.jit
def _finish_tile(acc, acc_up, out_ptr, rs_ptr, x_rows, xrow, rn, rmask, nmask, N, SWIGLU: tl.constexpr,
                 HAS_RS: tl.constexpr, SWAP_AB: tl.constexpr):
    """SwiGLU, row scale, bf16 store of the rows and columns that exist."""
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if HAS_RS:
        acc = acc * _as_rows(tl.load(rs_ptr + x_rows), SWAP_AB)
    ptrs = out_ptr + _as_rows(xrow * N, SWAP_AB) + _as_cols(rn, SWAP_AB)
    tl.store(ptrs, acc.to(tl.bfloat16), mask=_as_rows(rmask, SWAP_AB) & _as_cols(nmask, SWAP_AB))


@triton.jit
def _tma_tiles(x_desc, w_desc, xgs_ptr, XGS_STRIDE, wgs_ptr, out_ptr, rs_ptr, cnt_ptr, G, M_MAX, N, K, S,
               RAGGED: tl.constexpr, SWIGLU: tl.constexpr, HAS_RS: tl.constexpr, X_DECODED: tl.constexpr,
               W_DECODED: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Ragged bf16 x and weights, tiles loaded by TMA (tensor descriptors over x [S, K] and w [G * NW, K]): program
    p walks tiles p, p + P, ... of the device-side tile count (persistent, P = the grid). A tile's rows past its
    expert's count and columns past N load the next expert's rows (or TMA's zeros past the tensor) and are not
    stored; gate and up tiles are two loads and two dots into two accumulators."""
    tiles, ends, cnt, lo = expert_row_tiles(cnt_ptr, G, M_MAX, S, RAGGED, BLOCK_G, BLOCK_M)
    tiles_m = tl.sum(tiles)
    n_tiles = tl.cdiv(N, BLOCK_N)
    NW = 2 * N if SWIGLU else N
    for t in tl.range(tl.program_id(0), tiles_m * n_tiles, tl.num_programs(0)):
        tm, pid_n = group_order(t, tiles_m, n_tiles, GROUP_M)
        g, tile, count, row0 = tile_expert(tm, tiles, ends, cnt, lo, BLOCK_G)
        x0 = (row0 + tile * BLOCK_M).to(tl.int32)
        w0 = g * NW + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([x0, k0])
            acc = tl.dot(a, w_desc.load([w0, k0]).T, acc)
            if SWIGLU:
                acc_up = tl.dot(a, w_desc.load([w0 + N, k0]).T, acc_up)
        rm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        x_rows = row0 + tl.minimum(rm, count - 1)
        if W_DECODED:
            acc, acc_up = _global_scale(acc, acc_up, wgs_ptr, g)
        if X_DECODED:
            acc, acc_up = _x_global_scale(acc, acc_up, xgs_ptr, x_rows, XGS_STRIDE, False)
        _finish_tile(acc, acc_up, out_ptr, rs_ptr, x_rows, row0 + rm, rn, rm < count, rn < N, N, SWIGLU, HAS_RS,
                     False)


@triton.jit
def _pointer_tiles(x_ptr, xgs_ptr, XGS_STRIDE, w_ptr, ws_ptr, wgs_ptr, out_ptr, rs_ptr, cnt_ptr, ready_ptr, WAIT_BM,
                   WAIT_NT, G, M_MAX, N, K, S, KQ, K16, RAGGED: tl.constexpr, W_FP4: tl.constexpr,
                   X_DECODED: tl.constexpr, W_DECODED: tl.constexpr, SWIGLU: tl.constexpr, HAS_RS: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SWAP_AB: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, SIGNAL: tl.constexpr,
                   WAIT: tl.constexpr, PERSISTENT: tl.constexpr):
    """Output tiles from pointer loads (any operand format; pipelined by Triton): one tile per program, or with
    PERSISTENT a fixed grid whose program p takes tiles p, p + P, ... of the device-side tile count (P = the grid),
    so that a masked layout's row capacity past the counts launches no programs."""
    if PERSISTENT:
        tiles, ends, cnt, lo = expert_row_tiles(cnt_ptr, G, M_MAX, S, RAGGED, BLOCK_G, BLOCK_M)
        tiles_m = tl.sum(tiles)
        n_tiles = tl.cdiv(N, BLOCK_N)
        for t_lin in tl.range(tl.program_id(0), tiles_m * n_tiles, tl.num_programs(0)):
            t, pid_n = group_order(t_lin, tiles_m, n_tiles, GROUP_M)
            g, tile, count, row0 = tile_expert(t, tiles, ends, cnt, lo, BLOCK_G)
            _pointer_tile(x_ptr, xgs_ptr, XGS_STRIDE, w_ptr, ws_ptr, wgs_ptr, out_ptr, rs_ptr, ready_ptr, WAIT_BM,
                          WAIT_NT, N, K, KQ, K16, g, tile, count, row0, pid_n, W_FP4, X_DECODED, W_DECODED,
                          SWIGLU, HAS_RS, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, EVEN_K, SIGNAL, WAIT)
    else:
        t, pid_n = group_order(tl.program_id(0), row_tile_slots(G, M_MAX, S, RAGGED, BLOCK_M), tl.cdiv(N, BLOCK_N),
                               GROUP_M)
        tiles, ends, cnt, lo = expert_row_tiles(cnt_ptr, G, M_MAX, S, RAGGED, BLOCK_G, BLOCK_M)
        if t < tl.sum(tiles):
            g, tile, count, row0 = tile_expert(t, tiles, ends, cnt, lo, BLOCK_G)
            _pointer_tile(x_ptr, xgs_ptr, XGS_STRIDE, w_ptr, ws_ptr, wgs_ptr, out_ptr, rs_ptr, ready_ptr, WAIT_BM,
                          WAIT_NT, N, K, KQ, K16, g, tile, count, row0, pid_n, W_FP4, X_DECODED, W_DECODED,
                          SWIGLU, HAS_RS, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, EVEN_K, SIGNAL, WAIT)


@triton.jit
def _pointer_tile(x_ptr, xgs_ptr, XGS_STRIDE, w_ptr, ws_ptr, wgs_ptr, out_ptr, rs_ptr, ready_ptr, WAIT_BM, WAIT_NT,
                  N, K, KQ, K16, g, tile, count, row0, pid_n, W_FP4: tl.constexpr, X_DECODED: tl.constexpr,
                  W_DECODED: tl.constexpr, SWIGLU: tl.constexpr, HAS_RS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr,
                  SIGNAL: tl.constexpr, WAIT: tl.constexpr):
    """Output tile (row tile ``tile`` of expert g, whose ``count`` rows start at ``row0``; column tile pid_n)."""
    rm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rm < count
    if WAIT:  # x is GEMM1's output (chain.py)
        ready = expert_ready(ready_ptr, g, count, WAIT_BM, WAIT_NT)
    xrow = row0 + rm  # int64: row * K can pass 2^31
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    NW = 2 * N if SWIGLU else N
    # tile slots past the expert's rows / N load a copy of its last row instead of masking every load (count >= 1
    # here); the results in those slots are never stored
    x_rows = row0 + tl.minimum(rm, count - 1)
    wrow = g.to(tl.int64) * NW + tl.minimum(rn, N - 1)
    R: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    if SWIGLU:  # gate row i and its up row (N further down) interleaved: one dot per K step, and the [*, 2I]
        wrow = tl.reshape(tl.join(wrow, wrow + N), [R])  # intermediate is never written

    if SWAP_AB:
        acc = tl.zeros([R, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = _load_x_cols(x_ptr, x_rows, k0 + tl.arange(0, BLOCK_K), K, SWAP_AB, EVEN_K)
        if W_FP4 and SWAP_AB:
            xt = dot_k_order(xt, BLOCK_K, True)
        acc = _accumulate(acc, xt, w_ptr, ws_ptr, wrow, k0, K, KQ, K16, W_FP4, SWAP_AB, EVEN_K, R, BLOCK_K)
    if SWIGLU:
        if SWAP_AB:
            acc, acc_up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_N, 2, BLOCK_M]), (0, 2, 1)))
        else:
            acc, acc_up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    else:
        acc_up = acc

    if W_FP4 or W_DECODED:
        acc, acc_up = _global_scale(acc, acc_up, wgs_ptr, g)
    if X_DECODED:
        acc, acc_up = _x_global_scale(acc, acc_up, xgs_ptr, x_rows, XGS_STRIDE, SWAP_AB)
    if WAIT:
        rmask = rmask & ready
    _finish_tile(acc, acc_up, out_ptr, rs_ptr, x_rows, xrow, rn, rmask, nmask, N, SWIGLU, HAS_RS, SWAP_AB)
    if SIGNAL:
        tile_done(ready_ptr, g)


# counts and sizes that only bound loops and masks or pick rows (K, N and the K strides set the vector widths):
# not specialized on their divisibility, so varying token counts reuse one compiled variant
@triton.jit(do_not_specialize=["G", "M_MAX", "S", "M_BUCKET", "XGS_STRIDE", "WAIT_BM", "WAIT_NT"])
def _grouped_gemm_kernel(
        x_ptr, xgs_ptr,  # x: bf16 [rows, K]; X_DECODED: NVFP4 x's decoded copy, and its fp32 global scale(s)
        XGS_STRIDE,  # 0: one global scale for x; 1: one per row (tokens keep their source rank's scale)
        w_ptr, ws_ptr, wgs_ptr,  # w: bf16 [G, NW, K] or packed [G, NW, K/2] + scales [G, NW, K/16] + gs [G]
        out_ptr, rs_ptr,  # out bf16 [rows, N]; row scale fp32 [rows]
        cnt_ptr,  # masked: counts [G]; ragged: offsets [G+1]
        x_desc, w_desc,  # TMA descriptors of bf16 x [rows, K] and w [G * NW, K] (None where TMA is not possible)
        ready_ptr, WAIT_BM, WAIT_NT,  # GEMM1 -> GEMM2 chain (chain.py): tiles done per expert; GEMM1's tiling
        G, M_MAX, N, K, S,
        KQ, K16,  # K // 4, K // 16: own arguments so Triton specializes them as multiples of 16 (aligned NVFP4 rows)
        M_BUCKET,  # autotune key only
        RAGGED: tl.constexpr, W_FP4: tl.constexpr,
        X_DECODED: tl.constexpr, W_DECODED: tl.constexpr,  # bf16 copies of NVFP4 x / w (fp4_mma.decode_nvfp4)
        SWIGLU: tl.constexpr, HAS_RS: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
        GROUP_M: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr, PERSISTENT: tl.constexpr,
        SIGNAL: tl.constexpr, WAIT: tl.constexpr, PDL: tl.constexpr):  # chain.py: GEMM1 counts, GEMM2 waits
    allow_dependents(PDL, SIGNAL)
    if TMA:
        tl.static_assert(not (SIGNAL or WAIT), "the GEMM chain is for decode shapes, which have no TMA tiles")
        _tma_tiles(x_desc, w_desc, xgs_ptr, XGS_STRIDE, wgs_ptr, out_ptr, rs_ptr, cnt_ptr, G, M_MAX, N, K, S, RAGGED,
                   SWIGLU, HAS_RS, X_DECODED, W_DECODED, BLOCK_G, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        _pointer_tiles(x_ptr, xgs_ptr, XGS_STRIDE, w_ptr, ws_ptr, wgs_ptr, out_ptr, rs_ptr, cnt_ptr, ready_ptr, WAIT_BM,
                       WAIT_NT, G, M_MAX, N, K, S, KQ, K16, RAGGED, W_FP4, X_DECODED, W_DECODED,
                       SWIGLU, HAS_RS, BLOCK_G, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, GROUP_M, EVEN_K, SIGNAL, WAIT,
                       PERSISTENT)
    finish_dependent(PDL, WAIT)


def _persistent(a) -> bool:
    """Whether a masked-layout launch walks its tiles with a persistent grid: when one program per tile slot of the
    whole row capacity would be more programs than the persistent grid. Most of those programs find no rows and
    exit, and launching them costs more than walking: on the H200 at 8 ranks x 128 tokens of capacity, 947 -> 627 us
    for the DeepSeek-V3 expert MLP at 8 routed rows per expert, 738 -> 670 at 32 (docs/PERF.md)."""
    if a["RAGGED"] or a.get("TMA"):
        return False
    slots = tile_slots(False, a["G"], a["M_MAX"], a["S"], a["N"], a["BLOCK_M"], a["BLOCK_N"])
    return slots > tuning.persistent_programs(a, a["SWIGLU"])


_KEY = ["M_BUCKET", "N", "K", "RAGGED", "W_FP4", "SWIGLU", "HAS_RS"]
_launch = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0,
                             "PERSISTENT": lambda a: _persistent(a)})(_grouped_gemm_kernel)
_autotuned = triton.autotune(configs=tuning.grouped_gemm_configs(), key=_KEY,
                             prune_configs_by={"early_config_prune": tuning.prune_grouped_gemm_configs})(_launch)

last_launch: dict = {}
"""What the latest :func:`grouped_gemm` call launched: ``source`` ("tuned-file", "first-config" under
``MOE_EP_AUTOTUNE=off``, or "autotune"), ``config`` (the config the autotuner picked is known after the call) and
``decoded`` (whether NVFP4 x, w were decoded to bf16 copies first)."""


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
      never read or written (the output is allocated with ``torch.empty``: they hold garbage).
    - ragged: ``x [S, K]`` sorted by expert, ``offsets [G+1]`` (nondecreasing, in ``[0, S]``); rows
      ``offsets[g]:offsets[g+1]`` belong to expert g. Returns ``[S, N]``; rows outside every expert are
      not written.

    ``x``: bf16, or an :class:`NvFp4Tensor` (linear scales; one global scale, or one per row as
    received NVFP4 tokens carry their source rank's). ``w``: bf16 ``[G, N, K]``,
    or an NvFp4Tensor of that shape (linear scales, global scale ``[G]``, one per expert). K % 16 == 0.
    NVFP4 x is decoded into a transient bf16 copy first (as large as bf16 x; masked: only the rows within the
    counts are decoded), and so are NVFP4 weights from 512 tokens per expert on (``$MOE_EP_DECODED_MIN_M``: another
    bucket, or off); the GEMM then multiplies bf16 tiles: faster than decoding in every tile that reads them.
    ``swiglu``: w holds gate rows then up rows (``[G, 2I, K]``) and the result is ``silu(gate) * up``,
    ``[*, I]``, without the ``[*, 2I]`` intermediate ever being written. ``row_scale``: float32, one factor
    per row of x (``[G, M_max]`` / ``[S]``), applied to the output row (the routing weight).
    ``out``: optional bf16 contiguous output to write into. ``m_hint``: expected tokens per expert, to pick
    the tuned config (default: M_max when masked, S / G when ragged).
    """
    return _gemm(x, w, counts, offsets, swiglu, row_scale, out, m_hint, None)[0]


def _gemm(x, w, counts, offsets, swiglu, row_scale, out, m_hint, link: Link | None):
    """:func:`grouped_gemm`, as one link of the expert MLP's GEMM1 -> GEMM2 chain when ``link`` is given (chain.py).
    Returns (out, the config launched, or None when there were no rows)."""
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
        return out, None

    m = _tokens_per_expert(xshape, ragged, G, m_hint)
    xgs_stride = int(x_fp4 and xgs.numel() > 1)  # per-row global scales (received NVFP4 tokens)
    # NVFP4 x is always decoded once into a transient bf16 copy (masked: only the rows within the counts), then bf16
    # tiles: decoding it in the K loop redid it for every column tile, 1.1-12x slower on the H200 (docs/PERF.md).
    # NVFP4 weights likewise at prefill sizes; below them decoding the weight tile in registers streams 4x fewer bytes.
    x_dec, w_dec = x_fp4, w_fp4 and tuning.m_bucket(m) >= tuning.decoded_min_m()
    if x_dec:
        xd = decode_nvfp4(xd, xs, xshape, None if ragged else idx)
    if w_dec:
        wd, w_fp4 = decode_nvfp4(wd, ws, wshape), False
    # TMA configs (ragged prefill shapes, bf16 weights, a GPU with the tensor memory accelerator) take descriptors
    # over x and w as 2-D tensors, their tile shapes set per config (tuning.set_tma_blocks); none are made for decode
    # calls. Not masked: a TMA box would read an expert's padding rows, which that layout never touches.
    tma = ragged and not w_fp4 and tuning.m_bucket(m) > tuning.DECODE_MAX_M and tuning.tma_supported()
    if tma:  # descriptor bases must be 16-byte aligned (rows are: K % 16 == 0); a view at an odd offset is copied
        xd = xd if xd.data_ptr() % 16 == 0 else xd.clone()
        wd = wd if wd.data_ptr() % 16 == 0 else wd.clone()

    def descriptors():
        return (TensorDescriptor.from_tensor(xd.view(-1, K), [16, 32]),
                TensorDescriptor.from_tensor(wd.view(-1, K), [16, 32]))

    dummy = xd
    args = (xd, xgs if x_dec else dummy, xgs_stride, wd, ws if w_fp4 else dummy, wgs if w_fp4 or w_dec else dummy, out,
            row_scale if row_scale is not None else dummy, idx)

    def programs(meta):  # one per tile slot; persistent grids: TMA configs as many as fit on the GPU at once,
        # PERSISTENT pointer-load launches (masked, a large row capacity) PERSISTENT_ROUNDS times that
        bound = tile_slots(ragged, G, M_max, S, N, meta["BLOCK_M"], meta["BLOCK_N"])
        if meta.get("TMA"):
            bound = min(bound, tuning.resident_programs(meta, bool(swiglu)))
        elif meta.get("PERSISTENT"):
            bound = min(bound, tuning.persistent_programs(meta, bool(swiglu)))
        return (bound,)

    flags = dict(RAGGED=ragged, W_FP4=w_fp4, X_DECODED=x_dec, W_DECODED=w_dec, SWIGLU=bool(swiglu),
                 HAS_RS=row_scale is not None, BLOCK_G=max(triton.next_power_of_2(G), 2), SIGNAL=False, WAIT=False,
                 PDL=False)
    chain_args = (idx, 1, 1)  # ready counts (a placeholder when not chained), GEMM1's BLOCK_M and column tiles
    if link is not None:
        if link.ready is None:
            link.ready = torch.zeros(G, dtype=torch.int32, device=dev)
        chain_args = (link.ready, *(link.wait or (1, 1)))
        flags.update(SIGNAL=link.wait is None, WAIT=link.wait is not None, PDL=link.pdl)
        link.launched = args
    tail = (*chain_args, G, M_max, N, K, S, K // 4, K // 16, tuning.m_bucket(m))
    tuned, source = tuning.tuned_gemm_config(N, K, m, w_fp4, bool(swiglu)), "tuned-file"
    if tuned is None and tuning.search_off():
        tuned, source = tuning.first_gemm_config(N, K, m, G, w_fp4, bool(swiglu)), "first-config"
    if tuned is not None:
        cfg = dict(tuned)
        if cfg["TMA"] and (not tma or cfg["SWAP_AB"]):  # a TMA config where TMA cannot run: the same tiles
            cfg["TMA"] = False  # through pointer loads
        descs = (None, None)
        if cfg["TMA"]:
            descs = descriptors()
            tuning.set_tma_blocks(dict(x_desc=descs[0], w_desc=descs[1], **cfg))
        pdl = dict(launch_pdl=True) if flags["PDL"] and flags["WAIT"] else {}  # GEMM2 as GEMM1's dependent
        _launch[programs](*args, *descs, *tail, **flags, **cfg, **pdl)
        last_launch.update(source=source, config=cfg, decoded=(x_dec, w_dec))
        return out, cfg

    if link is not None:  # timed configs run one after another; GEMM2 follows a searched GEMM1 by a plain launch
        flags["PDL"] = link.pdl = False  # (earlier timing runs already completed its counts)
    _autotuned[programs](*args, *(descriptors() if tma else (None, None)), *tail, **flags)
    best = getattr(_autotuned, "best_config", None)
    cfg = dict(best.all_kwargs()) if best is not None else None
    last_launch.update(source="autotune", config=cfg, decoded=(x_dec, w_dec))
    return out, cfg


def expert_mlp(x, w13, w2, *, counts: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
               row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
               m_hint: int | None = None) -> torch.Tensor:
    """Expert SwiGLU MLP ``(silu(x W1^T) * (x W3^T)) W2^T`` per expert: two grouped GEMMs, bf16 in between.

    ``w13 [G, 2I, H]`` (gate rows then up rows) and ``w2 [G, H, I]``: bf16 tensors or NvFp4Tensors (global
    scale per expert). ``x``, ``counts`` / ``offsets``, ``row_scale`` (applied to the output of the second
    GEMM), ``out`` and ``m_hint`` as in :func:`grouped_gemm`. Returns bf16 ``[G, M_max, H]`` (masked; rows past
    the counts untouched) or ``[S, H]`` (ragged).

    Decode-sized calls (up to 32 tokens per expert) with bf16 weights chain the two GEMMs: GEMM2 starts on an expert
    as soon as GEMM1 has finished that expert's tiles (``moe_ep.kernels.chain``; ``MOE_EP_GEMM_CHAIN=off`` turns it
    off).
    """
    shape13 = tuple(w13.shape) if isinstance(w13, (torch.Tensor, NvFp4Tensor)) else None
    shape2 = tuple(w2.shape) if isinstance(w2, (torch.Tensor, NvFp4Tensor)) else None
    check(shape13 is not None and len(shape13) == 3, "w13.shape", shape13, "[G, 2I, H]")
    check(shape2 is not None and len(shape2) == 3, "w2.shape", shape2, "[G, H, I]")
    G, I2, H = shape13
    check(shape2 == (G, H, I2 // 2), "w2.shape", shape2, f"{(G, H, I2 // 2)} (from w13 {shape13})")
    # bf16 weights at decode shapes: GEMM2 waits for GEMM1's tiles expert by expert, not for all of GEMM1 (chain.py;
    # 0.3-1.8% faster on the H200). Not prefill (1% slower: its tensor cores run at the power cap) and not NVFP4
    # weights (-0.7 to +0.6%: that decode is bound by instructions, not by DRAM). Not as a dependent launch when out
    # shares memory with x: GEMM2 would write it while GEMM1 still reads other experts' rows.
    xshape = tuple(x.shape) if isinstance(x, (torch.Tensor, NvFp4Tensor)) else ()
    decode = len(xshape) in (2, 3) and tuning.m_bucket(_tokens_per_expert(xshape, offsets is not None, G, m_hint)) \
        <= tuning.DECODE_MAX_M
    chained = decode and isinstance(w13, torch.Tensor) and chain_enabled()
    first = Link(pdl=dependent_launch_supported()) if chained else None
    h, cfg1 = _gemm(x, w13, counts, offsets, True, None, None, m_hint, first)
    if first is None or cfg1 is None:  # chaining off, or no rows
        return _gemm(h, w2, counts, offsets, False, row_scale, out, m_hint, None)[0]
    second = Link(first.ready, (cfg1["BLOCK_M"], triton.cdiv(I2 // 2, cfg1["BLOCK_N"])),
                  first.pdl and not _shares_memory(out, x))
    return _gemm(h, w2, counts, offsets, False, row_scale, out, m_hint, second)[0]


def _tokens_per_expert(xshape, ragged: bool, G: int, m_hint: int | None) -> int:
    """The tokens per expert a call's tuned config is picked for: ``m_hint``, else M_max (masked) or S / G (ragged)."""
    return m_hint if m_hint is not None else (triton.cdiv(xshape[0], G) if ragged else xshape[1])


def _shares_memory(out, x) -> bool:
    """Whether the caller's ``out`` lives in the same storage as x (or x's packed NVFP4 data)."""
    xd = x.data if isinstance(x, NvFp4Tensor) else x
    return (isinstance(out, torch.Tensor) and isinstance(xd, torch.Tensor)
            and out.untyped_storage().data_ptr() == xd.untyped_storage().data_ptr())


def _compile_checks():
    """(raw jit function, signature, constexprs) per kernel variant, one representative config each,
    for ``tests/test_compile.py`` (``triton.compile`` for sm_90 / sm_100 without the interpreter)."""
    checks = []
    for ragged in (False, True):
        for x_dec in (False, True):
            for w_fp4 in (False, True):
                for swiglu, has_rs in ((True, False), (False, True)):
                    for swap, tma in ((True, False), (False, False), (False, True)):
                        if tma and (w_fp4 or not ragged):
                            continue
                        sig = {"x_ptr": "*bf16", "xgs_ptr": "*fp32", "XGS_STRIDE": "i32",
                               "w_ptr": "*u8" if w_fp4 else "*bf16", "ws_ptr": "*u8", "wgs_ptr": "*fp32",
                               "out_ptr": "*bf16", "rs_ptr": "*fp32", "cnt_ptr": "*i32",
                               "x_desc": "tensordesc<bf16[128, 64]>", "w_desc": "tensordesc<bf16[128, 64]>",
                               "ready_ptr": "*i32", "WAIT_BM": "i32", "WAIT_NT": "i32",
                               "G": "i32", "M_MAX": "i32", "N": "i32", "K": "i32", "S": "i32", "KQ": "i32",
                               "K16": "i32", "M_BUCKET": "i32"}
                        const = {"RAGGED": ragged, "W_FP4": w_fp4, "SWIGLU": swiglu, "HAS_RS": has_rs, "BLOCK_G": 32,
                                 "X_DECODED": x_dec, "W_DECODED": not (w_fp4 or swiglu),  # decoded NVFP4 copies
                                 "BLOCK_M": 16 if swap else 128, "BLOCK_N": 128 if swap else 128,
                                 "BLOCK_K": 128 if swap else 64, "SWAP_AB": swap, "GROUP_M": 8, "TMA": tma,
                                 "EVEN_K": ragged,  # both load paths, over the variants
                                 "PERSISTENT": not ragged and swiglu and not tma,  # both masked grids
                                 "SIGNAL": swiglu and not tma, "WAIT": not swiglu and not tma,  # as in expert_mlp
                                 "PDL": not tma}
                        if not tma:
                            const.update(x_desc=None, w_desc=None)
                        for name in const:
                            sig[name] = "constexpr"
                        checks.append((_grouped_gemm_kernel, sig, const))
    return checks
