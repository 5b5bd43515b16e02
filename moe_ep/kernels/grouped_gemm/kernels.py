"""The grouped GEMM's ``triton.language`` kernel, ``y_g = x_g @ w_g^T``: masked or ragged rows, bf16, NVFP4 or FP8
operands.

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

FP8 (``FP8``: both operands block-scaled e4m3, DeepSeek-V3's format) feeds e4m3 tiles to ``tl.dot`` (Hopper's FP8
tensor cores) and applies the scales as DeepGEMM promotes them: each K step's product is summed in fp32 on its own
and added to the accumulator times x's scale (per row) and w's (per 128 weight rows) of its 128-wide K block
(BLOCK_K divides 128, so a step never crosses a block). ``FP8_OUT`` (GEMM1 of an FP8 expert MLP) quantizes the fp32
SwiGLU result per row per 128 columns in the epilogue, as ``quantize_fp8`` does (BLOCK_N a multiple of 128, so a tile
holds whole blocks), and writes e4m3 codes and fp32 scales instead of bf16 rows. x and w come through e4m3 pointers
(or TMA descriptors), so both tiles reach the MMA from shared memory.

Decode shapes mostly swap the operands (``acc^T = W x^T``) so the handful of tokens sits in the MMA's N slot and
BLOCK_N weight rows fill its M slot; their row tiles are up to twice the mean tokens per expert, so that an expert's
routed rows take one pass over its weights (``config_space.prune_grouped_gemm_configs``).

Prefill shapes with bf16 or FP8 tiles in the ragged layout also have TMA configs (``TMA: True``; Hopper and newer):
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
    elif ptrs.dtype.element_ty == tl.float8e4nv:  # e4m3 filled with zero bytes (e4m3 0): no int-to-e4m3 cast
        v = tl.load(ptrs.to(tl.pointer_type(tl.uint8)), mask=k < K, other=0).to(tl.float8e4nv, bitcast=True)
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
def _accumulate_fp8(acc, xt, w_ptr, ws_ptr, xs_ptr, wrow, srow, n_blocks, x_rows, k0, K, KB, SWIGLU: tl.constexpr,
                    SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += (x[rows, k0:k0+BLOCK_K] @ w[wrow, k0:k0+BLOCK_K]^T) * xs[rows, kb] * ws[srow, kb], kb = k0 // 128: the
    step's e4m3 product summed in fp32 on its own, then scaled into the accumulator (x and w are e4m3; the scales
    fp32 ``[rows, KB]`` and ``[G * weight row blocks, KB]``). Up to BLOCK_N 128 a tile's weight rows lie in one scale
    block (gate's and up's one each): srow is its scale row (gate's), a scalar, so a step loads one scale (two with
    SwiGLU) instead of one per accumulator column; wider tiles give srow per weight row."""
    kk = k0 + tl.arange(0, BLOCK_K)
    w = _load_k(w_ptr + wrow[:, None] * K + kk[None, :], kk[None, :], K, EVEN_K).to(tl.float8e4nv, bitcast=True)
    part = _mma(tl.zeros_like(acc), xt.to(tl.float8e4nv, bitcast=True), w, SWAP_AB)
    kb = k0 // 128
    xs = _as_rows(tl.load(xs_ptr + x_rows * KB + kb), SWAP_AB)
    ws = tl.load(ws_ptr + srow * KB + kb)
    if BLOCK_N <= 128:
        if SWIGLU:  # interleaved weight rows: gate's scale on even ones, up's on odd ones
            ws_up = tl.load(ws_ptr + (srow + n_blocks) * KB + kb)
            odd = _as_cols(tl.arange(0, 2 * BLOCK_N) % 2, SWAP_AB) == 1
            out = acc + part * (xs * tl.where(odd, ws_up, ws))
        else:
            out = acc + part * (xs * ws)
    else:
        out = acc + part * (xs * _as_cols(ws, SWAP_AB))
    return out


@triton.jit
def _fp8_scale(amax):
    """``quantize_fp8``'s scale of a block from its amax: amax / 448 (IEEE division), 1.0 for an all-zero block."""
    s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    return tl.where(s > 0, s, 1.0)


@triton.jit
def _fp8_bytes(v, s):
    """``quantize_fp8``'s codes of v with scale s (broadcast to v): e4m3_rne(v / s), saturating, the division IEEE;
    as bytes, the layout the codes are stored in."""
    return tl.math.div_rn(v, tl.broadcast_to(s, v.shape)).to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _store_fp8_rows(acc, out_ptr, os_ptr, xrow, rn, rmask, nmask, N, SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Store the tile quantized to FP8 per row per 128 columns, by ``quantize_fp8``'s rule (s = amax / 448, 1.0 for
    an all-zero block, codes e4m3_rne(v / s) saturating, both divisions IEEE): codes ``[rows, N]`` as bytes, scales
    fp32 ``[rows, ceil(N / 128)]``. The tile's columns past N hold copies of column N - 1 (its weight rows are
    clamped), which lies in the same 128-block: they leave its amax as it is, and blocks wholly past N are not
    stored (TMA tiles load other weight rows there and zero those columns first)."""
    if SWAP_AB:
        acc = tl.trans(acc)
    NB: tl.constexpr = BLOCK_N // 128
    v = tl.reshape(acc, [BLOCK_M, NB, 128])
    s = _fp8_scale(tl.max(tl.abs(v), axis=2))
    q = tl.reshape(_fp8_bytes(v, s[:, :, None]), [BLOCK_M, BLOCK_N])
    tl.store(out_ptr + xrow[:, None] * N + rn[None, :], q, mask=rmask[:, None] & nmask[None, :])
    n_blocks = tl.cdiv(N, 128)
    cb = tl.min(rn, axis=0) // 128 + tl.arange(0, NB)  # the tile's block columns
    tl.store(os_ptr + xrow[:, None] * n_blocks + cb[None, :], s, mask=rmask[:, None] & (cb < n_blocks)[None, :])


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
def _finish_tile(acc, acc_up, out_ptr, os_ptr, rs_ptr, x_rows, xrow, rn, rmask, nmask, N, SWIGLU: tl.constexpr,
                 HAS_RS: tl.constexpr, SWAP_AB: tl.constexpr, FP8_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """SwiGLU, row scale, store of the rows and columns that exist: in out's dtype (bf16; fp32 for tests), or with
    FP8_OUT quantized to FP8 (codes and scales)."""
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if HAS_RS:
        acc = acc * _as_rows(tl.load(rs_ptr + x_rows), SWAP_AB)
    if FP8_OUT:
        _store_fp8_rows(acc, out_ptr, os_ptr, xrow, rn, rmask, nmask, N, SWAP_AB, BLOCK_M, BLOCK_N)
    else:
        ptrs = out_ptr + _as_rows(xrow * N, SWAP_AB) + _as_cols(rn, SWAP_AB)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=_as_rows(rmask, SWAP_AB) & _as_cols(nmask, SWAP_AB))


@triton.jit
def _fp8_scale_rows(g, rn, pid_n, N, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight scale rows of column tile pid_n of expert g (``Fp8Tensor.gate_up``: gate's row blocks, then up's):
    up to BLOCK_N 128 the tile lies in one block (it starts below N, and its columns clamped to N - 1 stay in that
    block), a scalar (gate's; up's is n_blocks further); wider tiles, one per column. And n_blocks."""
    n_blocks = tl.cdiv(N, 128)
    srow0 = g.to(tl.int64) * (2 * n_blocks if SWIGLU else n_blocks)
    if BLOCK_N <= 128:
        srow = srow0 + (pid_n * BLOCK_N) // 128
    else:
        srow = srow0 + tl.minimum(rn, N - 1) // 128
    return srow, n_blocks


@triton.jit
def _promote(acc, part, xs, ws_ptr, srow, KB, kb, BLOCK_N: tl.constexpr):
    """acc + part * xs * ws of one K block (unswapped tiles; xs per row [BM, 1], ws by :func:`_fp8_scale_rows`)."""
    ws = tl.load(ws_ptr + srow * KB + kb)
    if BLOCK_N <= 128:
        out = acc + part * (xs * ws)
    else:
        out = acc + part * (xs * ws[None, :])
    return out


@triton.jit
def _tma_fp8_sums(x_desc, w_desc, xs_ptr, ws_ptr, x0, w0, x_rows, srow, n_blocks, N, K, KB, SWIGLU: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The promoted fp32 sums of a TMA tile's BLOCK_N weight rows from w0 (and with SwiGLU their up rows, N further):
    each K step's products added in times the step's scales, gate's first, then up's, so that one product is live at
    a time; both e4m3 operands from shared memory."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([x0, k0])
        kb = k0 // 128
        xs = tl.load(xs_ptr + x_rows * KB + kb)[:, None]
        acc = _promote(acc, tl.dot(a, w_desc.load([w0, k0]).T), xs, ws_ptr, srow, KB, kb, BLOCK_N)
        if SWIGLU:
            acc_up = _promote(acc_up, tl.dot(a, w_desc.load([w0 + N, k0]).T), xs, ws_ptr, srow + n_blocks, KB, kb,
                              BLOCK_N)
    return acc, acc_up


@triton.jit
def _tma_fp8_swiglu_halves(x_desc, w_desc, xs_ptr, ws_ptr, out_ptr, os_ptr, rs_ptr, x0, w0, x_rows, xrow, rmask,
                           pid_n, srow, n_blocks, N, K, KB, HAS_RS: tl.constexpr, FP8_OUT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A 128-row FP8 SwiGLU TMA tile as two halves of BLOCK_N / 2 columns, one after the other (gate, up and a
    product of one half live at a time, then its SwiGLU result: the registers of a 64-row tile; x's tiles are read
    twice, from L2), stored as bf16 or, with FP8_OUT, quantized (:func:`_fp8_scale`, :func:`_fp8_bytes`) over the
    tile's one 128-column block (the halves' amax together). Columns past N are zeroed first (they hold other
    weight rows' sums)."""
    HALF: tl.constexpr = BLOCK_N // 2
    rn0 = pid_n * BLOCK_N + tl.arange(0, HALF)
    rn1 = rn0 + HALF
    g0, u0 = _tma_fp8_sums(x_desc, w_desc, xs_ptr, ws_ptr, x0, w0, x_rows, srow, n_blocks, N, K, KB, True, BLOCK_M,
                           HALF, BLOCK_K)
    g0 = tl.where((rn0 < N)[None, :], g0, 0.0)
    h0 = g0 / (1.0 + tl.exp(-g0)) * u0
    g1, u1 = _tma_fp8_sums(x_desc, w_desc, xs_ptr, ws_ptr, x0, w0 + HALF, x_rows, srow, n_blocks, N, K, KB, True,
                           BLOCK_M, HALF, BLOCK_K)
    g1 = tl.where((rn1 < N)[None, :], g1, 0.0)
    h1 = g1 / (1.0 + tl.exp(-g1)) * u1
    if HAS_RS:
        rs = tl.load(rs_ptr + x_rows)[:, None]
        h0 = h0 * rs
        h1 = h1 * rs
    m0 = rmask[:, None] & (rn0 < N)[None, :]
    m1 = rmask[:, None] & (rn1 < N)[None, :]
    if FP8_OUT:
        s = _fp8_scale(tl.maximum(tl.max(tl.abs(h0), axis=1), tl.max(tl.abs(h1), axis=1)))
        tl.store(out_ptr + xrow[:, None] * N + rn0[None, :], _fp8_bytes(h0, s[:, None]), mask=m0)
        tl.store(out_ptr + xrow[:, None] * N + rn1[None, :], _fp8_bytes(h1, s[:, None]), mask=m1)
        tl.store(os_ptr + xrow * tl.cdiv(N, 128) + pid_n, s, mask=rmask)  # BLOCK_N 128: block column pid_n
    else:
        tl.store(out_ptr + xrow[:, None] * N + rn0[None, :], h0.to(out_ptr.dtype.element_ty), mask=m0)
        tl.store(out_ptr + xrow[:, None] * N + rn1[None, :], h1.to(out_ptr.dtype.element_ty), mask=m1)


@triton.jit
def _tma_tiles(x_desc, w_desc, xgs_ptr, XGS_STRIDE, xs_ptr, ws_ptr, wgs_ptr, out_ptr, os_ptr, rs_ptr, cnt_ptr, G,
               M_MAX, N, K, S, RAGGED: tl.constexpr, SWIGLU: tl.constexpr, HAS_RS: tl.constexpr,
               X_DECODED: tl.constexpr, W_DECODED: tl.constexpr, FP8: tl.constexpr, FP8_OUT: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr):
    """Ragged bf16 or FP8 x and weights, tiles loaded by TMA (tensor descriptors over x [S, K] and w [G * NW, K]):
    program p walks tiles p, p + P, ... of the device-side tile count (persistent, P = the grid). A tile's rows past
    its expert's count and columns past N load the next expert's rows (or TMA's zeros past the tensor) and are not
    stored; gate and up tiles are two loads and two dots into two accumulators. FP8: each K step's products are
    promoted into the accumulators by the step's scales (gate's first, then up's, so that one product is live at a
    time), both e4m3 operands straight from shared memory."""
    tiles, ends, cnt, lo = expert_row_tiles(cnt_ptr, G, M_MAX, S, RAGGED, BLOCK_G, BLOCK_M)
    tiles_m = tl.sum(tiles)
    n_tiles = tl.cdiv(N, BLOCK_N)
    NW = 2 * N if SWIGLU else N
    KB = tl.cdiv(K, 128)
    for t in tl.range(tl.program_id(0), tiles_m * n_tiles, tl.num_programs(0)):
        tm, pid_n = group_order(t, tiles_m, n_tiles, GROUP_M)
        g, tile, count, row0 = tile_expert(tm, tiles, ends, cnt, lo, BLOCK_G)
        x0 = (row0 + tile * BLOCK_M).to(tl.int32)
        w0 = g * NW + pid_n * BLOCK_N
        rm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        x_rows = row0 + tl.minimum(rm, count - 1)
        if FP8 and SWIGLU and BLOCK_M == 128:  # (config_space.fp8_split_halves)
            tl.static_assert(BLOCK_N == 128, "FP8 SwiGLU TMA halves: one 128-column block a tile")
            srow, n_blocks = _fp8_scale_rows(g, rn, pid_n, N, SWIGLU, BLOCK_N)
            _tma_fp8_swiglu_halves(x_desc, w_desc, xs_ptr, ws_ptr, out_ptr, os_ptr, rs_ptr, x0, w0, x_rows, row0 + rm,
                                   rm < count, pid_n, srow, n_blocks, N, K, KB, HAS_RS, FP8_OUT, BLOCK_M, BLOCK_N,
                                   BLOCK_K)
        else:
            if FP8:
                srow, n_blocks = _fp8_scale_rows(g, rn, pid_n, N, SWIGLU, BLOCK_N)
                acc, acc_up = _tma_fp8_sums(x_desc, w_desc, xs_ptr, ws_ptr, x0, w0, x_rows, srow, n_blocks, N, K, KB,
                                            SWIGLU, BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    a = x_desc.load([x0, k0])
                    acc = tl.dot(a, w_desc.load([w0, k0]).T, acc)
                    if SWIGLU:
                        acc_up = tl.dot(a, w_desc.load([w0 + N, k0]).T, acc_up)
            if FP8_OUT:  # columns past N hold other weight rows' sums, not copies of column N - 1: out of the amax
                acc = tl.where((rn < N)[None, :], acc, 0.0)
            if W_DECODED:
                acc, acc_up = _global_scale(acc, acc_up, wgs_ptr, g)
            if X_DECODED:
                acc, acc_up = _x_global_scale(acc, acc_up, xgs_ptr, x_rows, XGS_STRIDE, False)
            _finish_tile(acc, acc_up, out_ptr, os_ptr, rs_ptr, x_rows, row0 + rm, rn, rm < count, rn < N, N, SWIGLU,
                         HAS_RS, False, FP8_OUT, BLOCK_M, BLOCK_N)


@triton.jit
def _pointer_tiles(x_ptr, xgs_ptr, xs_ptr, XGS_STRIDE, w_ptr, ws_ptr, wgs_ptr, out_ptr, os_ptr, rs_ptr, cnt_ptr,
                   ready_ptr, WAIT_BM, WAIT_NT, G, M_MAX, N, K, S, KQ, K16, RAGGED: tl.constexpr, W_FP4: tl.constexpr,
                   X_DECODED: tl.constexpr, W_DECODED: tl.constexpr, FP8: tl.constexpr, FP8_OUT: tl.constexpr,
                   SWIGLU: tl.constexpr, HAS_RS: tl.constexpr,
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
            _pointer_tile(x_ptr, xgs_ptr, xs_ptr, XGS_STRIDE, w_ptr, ws_ptr, wgs_ptr, out_ptr, os_ptr, rs_ptr,
                          ready_ptr, WAIT_BM, WAIT_NT, N, K, KQ, K16, g, tile, count, row0, pid_n, W_FP4, X_DECODED,
                          W_DECODED, FP8, FP8_OUT, SWIGLU, HAS_RS, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, EVEN_K, SIGNAL,
                          WAIT)
    else:
        t, pid_n = group_order(tl.program_id(0), row_tile_slots(G, M_MAX, S, RAGGED, BLOCK_M), tl.cdiv(N, BLOCK_N),
                               GROUP_M)
        tiles, ends, cnt, lo = expert_row_tiles(cnt_ptr, G, M_MAX, S, RAGGED, BLOCK_G, BLOCK_M)
        if t < tl.sum(tiles):
            g, tile, count, row0 = tile_expert(t, tiles, ends, cnt, lo, BLOCK_G)
            _pointer_tile(x_ptr, xgs_ptr, xs_ptr, XGS_STRIDE, w_ptr, ws_ptr, wgs_ptr, out_ptr, os_ptr, rs_ptr,
                          ready_ptr, WAIT_BM, WAIT_NT, N, K, KQ, K16, g, tile, count, row0, pid_n, W_FP4, X_DECODED,
                          W_DECODED, FP8, FP8_OUT, SWIGLU, HAS_RS, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, EVEN_K, SIGNAL,
                          WAIT)


@triton.jit
def _pointer_tile(x_ptr, xgs_ptr, xs_ptr, XGS_STRIDE, w_ptr, ws_ptr, wgs_ptr, out_ptr, os_ptr, rs_ptr, ready_ptr,
                  WAIT_BM, WAIT_NT, N, K, KQ, K16, g, tile, count, row0, pid_n, W_FP4: tl.constexpr,
                  X_DECODED: tl.constexpr, W_DECODED: tl.constexpr, FP8: tl.constexpr, FP8_OUT: tl.constexpr,
                  SWIGLU: tl.constexpr, HAS_RS: tl.constexpr, BLOCK_M: tl.constexpr,
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
    if FP8:
        srow, n_blocks = _fp8_scale_rows(g, rn, pid_n, N, SWIGLU, BLOCK_N)
        if SWIGLU and BLOCK_N > 128:  # per weight row, as interleaved
            srow = tl.reshape(tl.join(srow, srow + n_blocks), [R])
        KB = tl.cdiv(K, 128)

    if SWAP_AB:
        acc = tl.zeros([R, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = _load_x_cols(x_ptr, x_rows, k0 + tl.arange(0, BLOCK_K), K, SWAP_AB, EVEN_K)
        if FP8:
            acc = _accumulate_fp8(acc, xt, w_ptr, ws_ptr, xs_ptr, wrow, srow, n_blocks, x_rows, k0, K, KB, SWIGLU,
                                  SWAP_AB, EVEN_K, BLOCK_N, BLOCK_K)
        else:
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
    _finish_tile(acc, acc_up, out_ptr, os_ptr, rs_ptr, x_rows, xrow, rn, rmask, nmask, N, SWIGLU, HAS_RS, SWAP_AB,
                 FP8_OUT, BLOCK_M, BLOCK_N)
    if SIGNAL:
        tile_done(ready_ptr, g)


# counts and sizes that only bound loops and masks or pick rows (K, N and the K strides set the vector widths):
# not specialized on their divisibility, so varying token counts reuse one compiled variant
@triton.jit(do_not_specialize=["G", "M_MAX", "S", "M_BUCKET", "XGS_STRIDE", "WAIT_BM", "WAIT_NT"])
def _grouped_gemm_kernel(
        x_ptr, xgs_ptr,  # x: bf16 [rows, K]; X_DECODED: NVFP4 x's decoded copy, and its fp32 global scale(s)
        xs_ptr,  # FP8: x is e4m3 bytes [rows, K] and these its fp32 scales [rows, ceil(K / 128)]
        XGS_STRIDE,  # 0: one global scale for x; 1: one per row (tokens keep their source rank's scale)
        w_ptr, ws_ptr, wgs_ptr,  # w: bf16 [G, NW, K] or packed [G, NW, K/2] + scales [G, NW, K/16] + gs [G]; FP8: e4m3
        # bytes [G, NW, K] + fp32 scales [G, NW / 128 blocks (gate's, then up's), ceil(K / 128)]
        out_ptr, os_ptr, rs_ptr,  # out [rows, N] (bf16, fp32; FP8_OUT: e4m3 bytes + fp32 scales [rows, N / 128
        # blocks]); row scale fp32 [rows]
        cnt_ptr,  # masked: counts [G]; ragged: offsets [G+1]
        x_desc, w_desc,  # TMA descriptors of x [rows, K] and w [G * NW, K], bf16 or e4m3 (None: no TMA possible)
        ready_ptr, WAIT_BM, WAIT_NT,  # GEMM1 -> GEMM2 chain (chain.py): tiles done per expert; GEMM1's tiling
        G, M_MAX, N, K, S,
        KQ, K16,  # K // 4, K // 16: own arguments so Triton specializes them as multiples of 16 (aligned NVFP4 rows)
        M_BUCKET,  # autotune key only
        RAGGED: tl.constexpr, W_FP4: tl.constexpr,
        X_DECODED: tl.constexpr, W_DECODED: tl.constexpr,  # bf16 copies of NVFP4 x / w (fp4_decode.decode_nvfp4)
        FP8: tl.constexpr, FP8_OUT: tl.constexpr,  # FP8 x and w; FP8 output (GEMM1 of an FP8 expert MLP)
        SWIGLU: tl.constexpr, HAS_RS: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
        GROUP_M: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr, PERSISTENT: tl.constexpr,
        SIGNAL: tl.constexpr, WAIT: tl.constexpr, PDL: tl.constexpr):  # chain.py: GEMM1 counts, GEMM2 waits
    allow_dependents(PDL, SIGNAL)
    tl.static_assert(not (FP8 and (W_FP4 or X_DECODED or W_DECODED)), "FP8 operands are FP8 both")
    tl.static_assert(not FP8_OUT or (FP8 and SWIGLU and BLOCK_N % 128 == 0), "FP8 out: FP8 GEMM1, whole blocks")
    if TMA:
        tl.static_assert(not (SIGNAL or WAIT), "the GEMM chain is for decode shapes, which have no TMA tiles")
        _tma_tiles(x_desc, w_desc, xgs_ptr, XGS_STRIDE, xs_ptr, ws_ptr, wgs_ptr, out_ptr, os_ptr, rs_ptr, cnt_ptr, G,
                   M_MAX, N, K, S, RAGGED, SWIGLU, HAS_RS, X_DECODED, W_DECODED, FP8, FP8_OUT, BLOCK_G, BLOCK_M,
                   BLOCK_N, BLOCK_K, GROUP_M)
    else:
        _pointer_tiles(x_ptr, xgs_ptr, xs_ptr, XGS_STRIDE, w_ptr, ws_ptr, wgs_ptr, out_ptr, os_ptr, rs_ptr, cnt_ptr,
                       ready_ptr, WAIT_BM, WAIT_NT, G, M_MAX, N, K, S, KQ, K16, RAGGED, W_FP4, X_DECODED, W_DECODED,
                       FP8, FP8_OUT, SWIGLU, HAS_RS, BLOCK_G, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, GROUP_M, EVEN_K,
                       SIGNAL, WAIT, PERSISTENT)
    finish_dependent(PDL, WAIT)


_KEY = ["M_BUCKET", "N", "K", "RAGGED", "W_FP4", "FP8", "FP8_OUT", "SWIGLU", "HAS_RS"]
grouped_gemm_kernel = _grouped_gemm_kernel
"""The kernel as it is: launched with EVEN_K and PERSISTENT given (the launcher takes them, and the grid, from the
plan, which derives them as ``launch_kernel``'s heuristics do)."""
launch_kernel = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0,
                                   "PERSISTENT": lambda a: schedule.persistent_grid(a)})(_grouped_gemm_kernel)
"""The kernel with EVEN_K and PERSISTENT derived from its arguments: launched with a chosen config."""
autotuned_kernel = triton.autotune(configs=config_space.grouped_gemm_configs(), key=_KEY,
                                   prune_configs_by={"early_config_prune": config_space.prune_grouped_gemm_configs}
                                   )(launch_kernel)
"""The same, autotuned over the config space (pruned per shape class); ``best_config`` after a launch."""
