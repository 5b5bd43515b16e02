"""The grouped GEMM's ``triton.language`` kernel, ``y_g = x_g @ w_g^T``: masked or ragged rows, bf16 or NVFP4 operands.

One kernel covers every variant (constexpr flags). A program computes one ``BLOCK_M x BLOCK_N`` output
tile of one expert. Its expert and row tile come from the device-side counts (masked) or offsets (ragged)
alone (``schedule.py``). So there is no host sync and no schedule tensor; the grid is a fixed upper bound
and surplus programs exit at once. Empty experts own no
tiles, and in the masked layout no program reads or writes a row past ``counts[g]`` (tile slots past it
compute on a copy of the expert's last row and are not stored). SwiGLU interleaves each gate row with its up
row, so one dot per K step covers both. A masked layout whose row capacity would launch more programs than a few
rounds of what fits on the GPU uses a persistent grid instead: program p takes tiles p, p + P, ... of the same
device-side tile count (``schedule.persistent_grid``), so capacity past the counts launches nothing.

NVFP4 operands are decoded to bf16 (an E2M1 value times an E4M3 scale is exact in bf16) and fed to bf16 ``tl.dot``;
the fp32 global scales are applied to the fp32 accumulator. NVFP4 x is decoded once into a transient bf16 copy
(``fp4_decode.decode_nvfp4``; in the masked layout only the rows within the counts) before every GEMM: x is small, and
every column tile reads it. NVFP4 weights below prefill sizes (the decode-time bound: instructions, not bytes) are
read as int16 words of 4 codes and decoded in registers (``fp4_decode.py``: 3 integer ops and one bf16x2 fma per
register pair); with K permuted those registers are wgmma's register operand as they are (swapped), with no
shuffles, and each thread reads whole vectors of words and 2 scales per row. x follows the permutation in registers
on its way to shared memory. From ``config_space.DECODED_MIN_M`` tokens per expert on, weights are decoded into a bf16
copy too, and bf16 tiles run. (``tl.dot_scaled`` is not used: with e4m3 scales in 16-blocks it crashes Triton 3.6's
compiler on Hopper; the register path is what runs on Blackwell too.)

Decode shapes mostly swap the operands (``acc^T = W x^T``) so the handful of tokens sits in the MMA's N slot and
BLOCK_N weight rows fill its M slot; their row tiles are up to twice the mean tokens per expert, so that an expert's
routed rows take one pass over its weights (``config_space.prune_grouped_gemm_configs``).

Prefill shapes with bf16 weights in the ragged layout also have TMA configs (``TMA: True``; Hopper and newer):
x and weight tiles come by tensor descriptors instead of per-thread pointer loads, gate and up tiles are two
loads into two accumulators, and a persistent grid of as many programs as fit on the GPU walks the device-side
tile count (:func:`_tma_tiles`), so a program's next tile starts without a new launch wave: fewer instructions
per loaded byte than pointer loads at prefill sizes (docs/PERF.md). The masked layout keeps pointer loads: a TMA
box would read an expert's padding rows.

:func:`expert_mlp` chains its two GEMMs for decode shapes with bf16 weights (``chain.py``): GEMM1 counts its finished
tiles per expert, GEMM2 (a programmatic dependent launch on Hopper and newer) waits per expert instead of for all of
GEMM1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import config_space, schedule
from .chain import allow_dependents, expert_ready, finish_dependent, tile_done
from .fp4_decode import dot_k_order, fp4_tile
from .schedule import expert_row_tiles, group_order, row_tile_slots, tile_expert


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
        X_DECODED: tl.constexpr, W_DECODED: tl.constexpr,  # bf16 copies of NVFP4 x / w (fp4_decode.decode_nvfp4)
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


_KEY = ["M_BUCKET", "N", "K", "RAGGED", "W_FP4", "SWIGLU", "HAS_RS"]
launch_kernel = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0,
                                   "PERSISTENT": lambda a: schedule.persistent_grid(a)})(_grouped_gemm_kernel)
"""The kernel with EVEN_K and PERSISTENT derived from its arguments: launched with a chosen config."""
autotuned_kernel = triton.autotune(configs=config_space.grouped_gemm_configs(), key=_KEY,
                                   prune_configs_by={"early_config_prune": config_space.prune_grouped_gemm_configs}
                                   )(launch_kernel)
"""The same, autotuned over the config space (pruned per shape class); ``best_config`` after a launch."""
