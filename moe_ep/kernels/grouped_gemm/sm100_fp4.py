"""The Blackwell (sm_100) W4A4 grouped GEMM: NVFP4 x times NVFP4 weights on the block-scaled FP4 tensor cores,
``y_g = x_g @ w_g^T`` per expert, masked or ragged rows, fp32 accumulation, bf16 (or fp32) out.

Each K step is one ``tl.dot_scaled(codes, e4m3 scales, "e2m1", codes, e4m3 scales, "e2m1")``: packed E2M1 codes
(two a byte, element 2i in the low nibble, as :class:`NvFp4Tensor` stores them) and one E4M3 scale per 16 elements
along K. Built for sm_100, Triton lowers it to ``tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale`` (3.6 spells
the 16-block ``scale_vec::4X``, 3.9 ``block16``) with UE4M3 scales in the instruction descriptor (its bit 23 clear):
``tests/test_sm100_fp4.py`` asserts exactly that for every config of :data:`SM100_CONFIGS`, so a Triton that falls
back to a decoded MMA fails CI. What was found by building for ``GPUTarget("cuda", 100, 32)`` (no B200 here):

- the MMA's M (the lhs rows of a tile) must be 128: with 64, Triton 3.6's compiler crashes (TritonGPUAccelerateMatmul)
  and 3.9 silently decodes to ``kind::f16``. N (the rhs rows) from 16 to 256 and K steps of 64 to 256 build the FP4
  instruction on both. Decode shapes therefore swap the operands (``acc^T = W x^T``: 128 weight rows in M, the few
  tokens in N), prefill shapes do not (128 tokens in M).
- neither interpreter runs it: Triton 3.6's has no ``dot_scaled`` at all, 3.9's reads e4m3 scale bytes as e8m0. So
  under the interpreter (``EMULATE``) the same operand tiles are decoded in the kernel (E2M1 value times E4M3 scale,
  exact in fp32) and multiplied by ``tl.dot``: the instruction's contract, which the CPU tests check against the fp32
  reference, while the operand tiles the kernel loads (:func:`_operands`) are the ones the GPU build passes.

Schedule as in the ``tl`` kernel (``schedule.py``): a program's expert and row tile come from the device-side counts
(masked) or offsets (ragged), no host sync; tile slots past an expert's rows compute on a copy of its last row and are
not stored. Scales are read in the layout the tensor holds: linear ``[rows, K/16]`` or the 128x4 swizzle
(:func:`scale_offsets`; ``quantize_nvfp4(..., swizzle=True)``). Global scales (x: one or one per row; w: one per
expert) divide the fp32 sums in the epilogue. SwiGLU interleaves each gate row with its up row, as the
``tl`` kernel does, so one MMA per K step covers both (two MMAs into two accumulators crash Triton 3.6's automatic
warp specialization: ``InsertTmemAref``, ``allocOp->hasOneUse()``); the ``[*, 2I]`` intermediate is never written.

Configs: :data:`SM100_CONFIGS`, pruned (:func:`prune`) to the FP4 MMA's shapes and to sm_100's shared memory and
tensor memory by estimates fitted to the builds (:func:`smem_bytes`, :func:`tmem_columns`). A call's config is
forced, a tuned file's ``n{N}_k{K}_xnvfp4_wnvfp4[_swiglu]`` entry (``tuned_files.validate_sm100``) or
:func:`default_config` (``plan.py``); ``moe-ep tune`` times :func:`tune_candidates` on a B200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import device_facts
from ...errors import MoEEpConfigError, check, fail
from ...triton_runtime import INTERPRETER, check_on_kernel_device, triton_minor
from .. import host_math
from ..nvfp4 import e2m1_values, e4m3_values_of_bytes, swizzled_offset
from ..nvfp4_tensor import NvFp4Tensor
from . import schedule
from .schedule import expert_row_tiles, group_order, row_tile_slots, tile_expert
from .kernels import _as_cols, _as_rows  # the accumulator orientation rule, shared with the tl kernel

MMA_M = 128  # tcgen05's M for one CTA: the lhs rows of every tile (see the module docstring)
CHECKED_TRITONS = ("3.6", "3.9")
"""Triton minor versions whose sm_100 build of this kernel was read (tests/test_sm100_fp4.py: the NVFP4 MMA in every
config's PTX): the dispatcher takes this path only under one of them."""


def available() -> bool:
    """Whether the grouped GEMM dispatcher takes this path for W4A4 calls here: a compiled (not interpreted) kernel on
    a GPU of compute capability 10.x (B200 / GB200) under one of :data:`CHECKED_TRITONS`."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why :func:`available` says False here (``moe-ep info`` shows it), or None."""
    props = device_facts.properties()
    if INTERPRETER or props is None:
        return "needs a compute capability 10.x GPU (B200 / GB200); none here"
    if props.major != 10:
        return f"needs a compute capability 10.x GPU (B200 / GB200); this one is {props.major}.{props.minor}"
    if triton_minor() not in CHECKED_TRITONS:
        return f"Triton {triton.__version__}: its builds were checked under {' / '.join(CHECKED_TRITONS)} only"
    return None


def _config(block_m: int, block_n: int, block_k: int, swap: bool, warps: int, stages: int) -> triton.Config:
    return triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWAP_AB=swap, GROUP_M=8),
                         num_warps=warps, num_stages=stages)


# 2-CTA (``num_ctas=2``, ``tcgen05.mma.cta_group::2``) is not in the space: neither checked Triton builds this kernel
# with it for sm_100 (3.6: TritonGPUPlanCTAPass fails; 3.9: TritonGPUAccelerateMatmul, "Src and Dst encodings are not
# compatible" at the dot_scaled); docs/perf-log.md.
SM100_CONFIGS = [
    # decode: swapped, BLOCK_N weight rows (2 * 64 interleaved gate / up rows with SwiGLU) in the MMA's M, BLOCK_M
    # tokens in its N
    *(_config(bm, bn, bk, True, 4, st) for bn in (64, 128) for bm in (16, 32, 64, 128) for bk in (128, 256)
      for st in (3, 4)),
    # prefill: 128 tokens in M, BLOCK_N weight rows (twice that with SwiGLU) in N
    *(_config(128, bn, bk, False, w, st) for bn in (64, 128, 256) for bk in (128, 256) for w, st in ((4, 3), (8, 3))
      if not (bn == 256 and bk == 256)),
]
"""The sm_100 space: BLOCK_M x BLOCK_N output tiles (tokens x weight rows), BLOCK_K elements per MMA step; which of
them a call may take: :func:`config_fits`."""

MAX_MMA_N = 256  # tcgen05's largest N for one CTA


def mma_shape(cfg: dict, swiglu: bool) -> tuple[int, int]:
    """(M, N) of a config's MMA: weight rows (twice BLOCK_N with SwiGLU) and tokens when swapped, else the reverse."""
    w_rows = 2 * cfg["BLOCK_N"] if swiglu else cfg["BLOCK_N"]
    return (w_rows, cfg["BLOCK_M"]) if cfg["SWAP_AB"] else (cfg["BLOCK_M"], w_rows)


def config_fits(cfg: dict, swiglu: bool) -> bool:
    """Whether a config builds the FP4 MMA for this epilogue: M exactly :data:`MMA_M` (64 falls back or crashes),
    N at most :data:`MAX_MMA_N`."""
    m, n = mma_shape(cfg, swiglu)
    return m == MMA_M and n <= MAX_MMA_N


CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "GROUP_M", "num_warps", "num_stages")
"""An sm_100 config as a dict (``launch``'s ``config``, a tuned file's entry): no TMA key (the tl path's)."""
SMEM_SLACK = 1024  # bytes past the pipeline's operand buffers (the builds add 8: barriers)


def config_dict(cfg: triton.Config) -> dict:
    """A ``triton.Config`` of :data:`SM100_CONFIGS` as a dict of :data:`CONFIG_KEYS`."""
    kw = cfg.kwargs
    return {"BLOCK_M": int(kw["BLOCK_M"]), "BLOCK_N": int(kw["BLOCK_N"]), "BLOCK_K": int(kw["BLOCK_K"]),
            "SWAP_AB": bool(kw["SWAP_AB"]), "GROUP_M": int(kw["GROUP_M"]), "num_warps": int(cfg.num_warps),
            "num_stages": int(cfg.num_stages)}


def smem_bytes(cfg: dict, swiglu: bool) -> int:
    """Shared memory one program of a config takes, estimated: ``num_stages - 1`` buffers (Triton's pipeliner keeps
    that many loads in flight) of both operands' tiles, the MMA's M + N rows of ``BLOCK_K / 2`` code bytes and
    ``BLOCK_K / 16`` scale bytes each, plus :data:`SMEM_SLACK`. Fitted to ``metadata.shared`` of the sm_100 builds of
    every config (Triton 3.6 and 3.9 alike): at or below it, never more than 2% plus the slack under it
    (tests/test_sm100_fp4.py)."""
    m, n = mma_shape(cfg, swiglu)
    bk = cfg["BLOCK_K"]
    return max(cfg["num_stages"] - 1, 1) * (m + n) * (bk // 2 + bk // 16) + SMEM_SLACK


def tmem_columns(cfg: dict, swiglu: bool) -> int:
    """Tensor-memory columns one CTA of a config allocates, estimated: the fp32 accumulator's N columns and
    ``2 * BLOCK_K / 16`` for the MMA's scales, rounded up to a power of two (at least 32), as Triton allocates it
    (``metadata.tmem_size`` of every config's sm_100 build: equal; tests/test_sm100_fp4.py)."""
    _, n = mma_shape(cfg, swiglu)
    return max(32, 1 << (n + 2 * (cfg["BLOCK_K"] // 16) - 1).bit_length())


def over_limits(cfg: dict, swiglu: bool, smem_limit: int | None = None) -> str | None:
    """What of an sm_100 GPU a config exceeds (None: nothing): shared memory (:func:`smem_bytes` against
    ``smem_limit``, default ``device_facts.sm100_smem_limit()``) or tensor memory (:func:`tmem_columns` against
    ``device_facts.SM100_TMEM_COLUMNS``)."""
    limit = device_facts.sm100_smem_limit() if smem_limit is None else smem_limit
    need = smem_bytes(cfg, swiglu)
    if need > limit:
        return f"{need} bytes of shared memory; allowed: at most {limit} on sm_100"
    cols = tmem_columns(cfg, swiglu)
    if cols > device_facts.SM100_TMEM_COLUMNS:
        return f"{cols} tensor-memory columns; allowed: at most {device_facts.SM100_TMEM_COLUMNS} per CTA"
    return None


def prune(configs, swiglu: bool, smem_limit: int | None = None) -> list[triton.Config]:
    """The ``configs`` that build the FP4 MMA for this epilogue (:func:`config_fits`) within an sm_100 GPU's shared
    and tensor memory (:func:`over_limits`)."""
    return [c for c in configs if config_fits(c.kwargs, swiglu)
            and over_limits(config_dict(c), swiglu, smem_limit) is None]


def configs_for(swiglu: bool) -> list[triton.Config]:
    """The configs of :data:`SM100_CONFIGS` a GEMM1 (``swiglu``) or GEMM2 may take: :func:`prune`."""
    return prune(SM100_CONFIGS, swiglu)


def check_keys(cfg, where: str) -> dict:
    """``cfg`` as a dict of exactly :data:`CONFIG_KEYS` (values unchecked), else MoEEpConfigError naming ``where``:
    not an object, keys other than :data:`CONFIG_KEYS` (a tl config's ``TMA`` too), or a missing one."""
    if not isinstance(cfg, dict):
        raise MoEEpConfigError(f"{where} = {cfg!r}; allowed: an sm100_fp4 config, an object with keys "
                               f"{list(CONFIG_KEYS)}")
    unknown = sorted(set(cfg) - set(CONFIG_KEYS), key=str)
    if unknown:
        raise MoEEpConfigError(f"{where}: keys {unknown}; allowed: only {list(CONFIG_KEYS)} (an sm100_fp4 config)")
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        raise MoEEpConfigError(f"{where}.{missing[0]} = missing; allowed: an sm100_fp4 config has {list(CONFIG_KEYS)}")
    return {k: cfg[k] for k in CONFIG_KEYS}


def check_config(cfg, where: str, swiglu: bool) -> dict:
    """``cfg`` as a dict of :data:`CONFIG_KEYS` if it is one of :func:`configs_for` (``swiglu``), else
    MoEEpConfigError naming ``where``: its keys (:func:`check_keys`), or a config outside the space (one that does
    not build the FP4 MMA, or exceeds shared / tensor memory, says which)."""
    out = check_keys(cfg, where)
    if any(config_dict(c) == out and type(cfg["SWAP_AB"]) is bool for c in configs_for(swiglu)):
        return out
    why = ""
    if all(type(out[k]) is int for k in CONFIG_KEYS if k != "SWAP_AB") and type(out["SWAP_AB"]) is bool:
        if not config_fits(out, swiglu):
            why = f": MMA (M, N) = {mma_shape(out, swiglu)}, allowed: M {MMA_M}, N at most {MAX_MMA_N}"
        else:
            why = ": " + (over_limits(out, swiglu) or "not in the space")
    raise MoEEpConfigError(f"{where} = {cfg!r}{why}; allowed: one of sm100_fp4.configs_for(swiglu={swiglu})")


def tune_candidates(m_bucket: int, n: int, k: int, swiglu: bool, quick: bool = False) -> list[dict]:
    """The configs ``moe-ep tune`` times for a W4A4 shape class on an sm_100 GPU, as dicts, from :func:`configs_for`:
    swapped token tiles of up to twice the bucket's rows (at least 16), the unswapped 128-token tile from 64 tokens
    per expert on, no wider than the shape (N, K) where a narrower one exists. ``quick`` (and the interpreter, whose
    timings mean nothing: each candidate only has to run) keeps the first two and the last."""
    fits = configs_for(swiglu)

    def right_kind(c):
        kw = c.kwargs
        return kw["BLOCK_M"] <= max(2 * m_bucket, 16) if kw["SWAP_AB"] else m_bucket >= 64
    kept = [c for c in fits if right_kind(c)] or [c for c in fits if c.kwargs["SWAP_AB"]][:1]
    narrow = [c for c in kept if c.kwargs["BLOCK_N"] <= max(host_math.next_power_of_2(n), 64)
              and c.kwargs["BLOCK_K"] <= max(host_math.next_power_of_2(k), 128)]
    kept = narrow or kept
    if (quick or INTERPRETER) and len(kept) > 3:
        kept = kept[:2] + kept[-1:]
    return [config_dict(c) for c in kept]


def default_config(tokens_per_expert: int, swiglu: bool) -> dict:
    """The config a call with this many expected tokens per expert launches (autotuning on a B200 would replace it):
    the smallest swapped token tile holding them up to 64 tokens, K steps of 256, else the 128-token prefill tile."""
    fits = configs_for(swiglu)
    pick = next((c for c in fits if c.kwargs["SWAP_AB"] and c.kwargs["BLOCK_M"] >= min(tokens_per_expert, 64)
                 and c.kwargs["BLOCK_K"] == 256), None) if tokens_per_expert <= 64 else None
    if pick is None:
        pick = next(c for c in fits
                    if not c.kwargs["SWAP_AB"] and c.kwargs["BLOCK_N"] == 128 and c.kwargs["BLOCK_K"] == 128)
    return dict(pick.kwargs, num_warps=pick.num_warps, num_stages=pick.num_stages)


@triton.jit
def scale_offsets(rows, kb, K16, SLICE_ROWS, CP, SWIZZLED: tl.constexpr):
    """Byte offsets of the scales of ``rows`` (global row numbers, [R] int64) at 16-blocks ``kb`` ([KB]): [R, KB].
    Linear: ``row * K16 + kb``. Swizzled: each slice of ``SLICE_ROWS`` rows is its own 128x4 layout of
    ``ceil(SLICE_ROWS / 128) * 128 * CP`` bytes (CP: K16 padded to 4), as ``swizzle_scales`` writes it."""
    if SWIZZLED:
        m = rows % SLICE_ROWS
        base = (rows // SLICE_ROWS) * (((SLICE_ROWS + 127) // 128) * 128 * CP)
        off = base[:, None] + swizzled_offset(m[:, None], kb[None, :], CP)
    else:
        off = rows[:, None] * K16 + kb[None, :]
    return off


@triton.jit
def _operands(q_ptr, s_ptr, rows, k0, K, K16, SLICE_ROWS, CP, SWIZZLED: tl.constexpr, EVEN_K: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """One K step of an NVFP4 operand: codes uint8 [R, BLOCK_K / 2] (K-packed) and e4m3 scales [R, BLOCK_K / 16]
    of ``rows``. K past the end reads code 0 and scale 0 (a zero product)."""
    kq = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    kb = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    qp = q_ptr + rows[:, None] * (K // 2) + kq[None, :]
    sp = s_ptr + scale_offsets(rows, kb, K16, SLICE_ROWS, CP, SWIZZLED)
    if EVEN_K:
        q = tl.load(qp)
        s = tl.load(sp)
    else:
        q = tl.load(qp, mask=kq[None, :] < K // 2, other=0)
        s = tl.load(sp, mask=kb[None, :] < K16, other=0)
    return q, s.to(tl.float8e4nv, bitcast=True)


@triton.jit
def decoded_operand(q, s, BLOCK_K: tl.constexpr):
    """What the instruction multiplies: codes [R, BLOCK_K / 2] and scales [R, BLOCK_K / 16] -> fp32 [R, BLOCK_K],
    element k = e2m1(code k) * scale[k // 16] (low nibble first; exact)."""
    R: tl.constexpr = q.shape[0]
    qi = q.to(tl.int32)
    v = tl.reshape(tl.join(e2m1_values(qi & 0xF), e2m1_values(qi >> 4)), [R, BLOCK_K // 16, 16])
    sv, _ = e4m3_values_of_bytes(s.to(tl.uint8, bitcast=True).to(tl.int32))
    return tl.reshape(v * sv[:, :, None], [R, BLOCK_K])


@triton.jit
def _block_scaled_mma(acc, a, sa, b, sb, EMULATE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += (a, sa) @ (b, sb)^T, a [M, K/2] and b [N, K/2] K-packed codes with their e4m3 16-block scales: the
    tcgen05 block-scaled FP4 MMA, or under the interpreter (EMULATE) its contract on decoded fp32 tiles."""
    if EMULATE:
        out = tl.dot(decoded_operand(a, sa, BLOCK_K), tl.trans(decoded_operand(b, sb, BLOCK_K)), acc,
                     input_precision="ieee")
    else:
        out = tl.dot_scaled(a, sa, "e2m1", tl.trans(b), sb, "e2m1", acc)
    return out


@triton.jit
def _mma(acc, xq, xs, wq, ws, SWAP_AB: tl.constexpr, EMULATE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += x @ w^T ([BM, BN]), or swapped acc^T += w @ x^T ([BN, BM])."""
    if SWAP_AB:
        out = _block_scaled_mma(acc, wq, ws, xq, xs, EMULATE, BLOCK_K)
    else:
        out = _block_scaled_mma(acc, xq, xs, wq, ws, EMULATE, BLOCK_K)
    return out


@triton.jit(do_not_specialize=["G", "M_MAX", "S", "XGS_STRIDE", "X_SLICE_ROWS", "W_SLICE_ROWS"])
def _sm100_fp4_kernel(
        xq_ptr, xs_ptr, xgs_ptr, XGS_STRIDE,  # x: codes uint8 [rows, K/2], scales (bytes), fp32 global scale(s)
        wq_ptr, ws_ptr, wgs_ptr,  # w: codes uint8 [G, NW, K/2], scales (bytes), fp32 global scales [G]
        out_ptr, rs_ptr, cnt_ptr,  # out [rows, N] bf16 / fp32; row scale fp32 [rows]; counts [G] / offsets [G+1]
        G, M_MAX, N, K, S, K16,
        X_SLICE_ROWS, W_SLICE_ROWS, CP,  # swizzled scales: rows per 128x4 slice, K16 padded to 4
        RAGGED: tl.constexpr, SWIGLU: tl.constexpr, HAS_RS: tl.constexpr, X_SWIZZLED: tl.constexpr,
        W_SWIZZLED: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
        EMULATE: tl.constexpr):
    t, pid_n = group_order(tl.program_id(0), row_tile_slots(G, M_MAX, S, RAGGED, BLOCK_M), tl.cdiv(N, BLOCK_N),
                           GROUP_M)
    tiles, ends, cnt, lo = expert_row_tiles(cnt_ptr, G, M_MAX, S, RAGGED, BLOCK_G, BLOCK_M)
    if t < tl.sum(tiles):
        g, tile, count, row0 = tile_expert(t, tiles, ends, cnt, lo, BLOCK_G)
        rm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        x_rows = row0 + tl.minimum(rm, count - 1)  # slots past the expert's rows: copies of its last row
        NW = 2 * N if SWIGLU else N
        w_rows = g.to(tl.int64) * NW + tl.minimum(rn, N - 1)
        R: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
        if SWIGLU:  # gate row n and its up row N + n interleaved: one MMA per K step covers both
            w_rows = tl.reshape(tl.join(w_rows, w_rows + N), [R])
        if SWAP_AB:
            acc = tl.zeros([R, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xq, xs = _operands(xq_ptr, xs_ptr, x_rows, k0, K, K16, X_SLICE_ROWS, CP, X_SWIZZLED, EVEN_K, BLOCK_K)
            wq, ws = _operands(wq_ptr, ws_ptr, w_rows, k0, K, K16, W_SLICE_ROWS, CP, W_SWIZZLED, EVEN_K, BLOCK_K)
            acc = _mma(acc, xq, xs, wq, ws, SWAP_AB, EMULATE, BLOCK_K)
        if SWIGLU:
            if SWAP_AB:
                acc, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_N, 2, BLOCK_M]), (0, 2, 1)))
            else:
                acc, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        # value = e2m1 * s / gs for both operands: the sums are divided by both global scales once
        inv = _as_rows(1.0 / tl.load(xgs_ptr + x_rows * XGS_STRIDE), SWAP_AB) / tl.load(wgs_ptr + g)
        acc = acc * inv
        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * (up * inv)
        if HAS_RS:
            acc = acc * _as_rows(tl.load(rs_ptr + x_rows), SWAP_AB)
        ptrs = out_ptr + _as_rows((row0 + rm) * N, SWAP_AB) + _as_cols(rn, SWAP_AB)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=_as_rows(rm < count, SWAP_AB) & _as_cols(rn < N, SWAP_AB))


def launch(xq: torch.Tensor, xs: torch.Tensor, xgs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
           wgs: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, row_scale: torch.Tensor | None, *, ragged: bool,
           swiglu: bool, G: int, N: int, K: int, M_max: int, S: int, config: dict, x_swizzled: bool = False,
           w_swizzled: bool = False) -> None:
    """Launch the kernel on checked, contiguous parts (codes uint8, scales as uint8 bytes, fp32 global scales: x's
    one or one per row, w's ``[G]``); ``config`` one of :func:`configs_for` as a dict (``num_warps``, ``num_stages``
    included). Writes ``out`` (bf16 or fp32 ``[rows, N]``) where rows belong to an expert."""
    kw = {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "GROUP_M")}
    k16 = K // 16
    grid = (schedule.tile_slots(ragged, G, M_max, S, N, kw["BLOCK_M"], kw["BLOCK_N"]),)
    _sm100_fp4_kernel[grid](
        xq, xs, xgs, int(xgs.numel() > 1), wq, ws, wgs, out, row_scale if row_scale is not None else xgs, idx,
        G, M_max, N, K, S, k16, max(S if ragged else M_max, 1), 2 * N if swiglu else N, -(-k16 // 4) * 4,
        RAGGED=ragged, SWIGLU=swiglu, HAS_RS=row_scale is not None, X_SWIZZLED=x_swizzled, W_SWIZZLED=w_swizzled,
        BLOCK_G=max(host_math.next_power_of_2(G), 2), EVEN_K=K % kw["BLOCK_K"] == 0, EMULATE=INTERPRETER,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **kw)


def sm100_fp4_grouped_gemm(x: NvFp4Tensor, w: NvFp4Tensor, *, counts: torch.Tensor | None = None,
                           offsets: torch.Tensor | None = None, swiglu: bool = False,
                           row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """W4A4 grouped GEMM ``y_g = x_g @ w_g^T`` on this module's kernel, whatever the GPU (the dispatcher,
    :func:`~moe_ep.kernels.grouped_gemm`, picks it on sm_100 alone; this entry is for tests and benchmarks).

    ``x``: NvFp4Tensor ``[S, K]`` with ``offsets [G+1]`` (ragged) or ``[G, M_max, K]`` with ``counts [G]`` (masked),
    one global scale or one per row. ``w``: NvFp4Tensor ``[G, N, K]`` (``[G, 2I, K]``, gate rows then up rows, with
    ``swiglu``), one global scale or one per expert. Scales linear or 128x4-swizzled, each tensor as it is. Layouts,
    the clamping of counts / offsets, ``row_scale`` (fp32, one per row of x) and ``out`` (bf16 or fp32, contiguous)
    as in ``grouped_gemm``; ``config``: one of :func:`configs_for` (a dict with ``num_warps``, ``num_stages``), default
    :func:`default_config`. Returns ``out`` (rows of no expert are not written). Bad arguments raise
    MoEEpInputError, a config that does not fit MoEEpConfigError."""
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, NvFp4Tensor):
            fail(f"type({name})", type(t).__name__, "an NvFp4Tensor (both operands NVFP4: W4A4)")
        t.check(name)
        check_on_kernel_device(t.data, f"{name}.data")
    check((counts is None) != (offsets is None), "(counts, offsets)",
          (counts is not None and "tensor", offsets is not None and "tensor"), "exactly one of counts or offsets")
    check(type(swiglu) is bool, "swiglu", swiglu, "True or False")
    ragged = offsets is not None
    check(len(w.shape) == 3, "w.shape", tuple(w.shape), "[G, N, K]")
    G, NW, K = w.shape
    check(len(x.shape) == (2 if ragged else 3), "x.shape", tuple(x.shape),
          "[S, K] (ragged)" if ragged else "[G, M_max, K] (masked)")
    check(x.shape[-1] == K, "x.shape[-1]", x.shape[-1], f"{K} (w's K)")
    check(ragged or x.shape[0] == G, "x.shape[0]", x.shape[0], f"{G} (w's G)")
    check(NW >= 1 and (not swiglu or NW % 2 == 0), "w.shape[1] (N)", NW, "even with swiglu, >= 1")
    check(w.device == x.device, "w.device", str(w.device), str(x.device))
    S = x.shape[0] if ragged else G * x.shape[1]
    M_max = 0 if ragged else x.shape[1]
    check(x.global_scale.numel() in (1, S), "x.global_scale.numel()", x.global_scale.numel(), f"1 or {S} (per row)")
    check(w.global_scale.numel() in (1, G), "w.global_scale.numel()", w.global_scale.numel(), f"1 or {G}")
    idx = offsets if ragged else counts
    want = (G + 1,) if ragged else (G,)
    check(isinstance(idx, torch.Tensor) and idx.dtype in (torch.int32, torch.int64) and tuple(idx.shape) == want
          and idx.device == x.device, "offsets" if ragged else "counts",
          getattr(idx, "shape", type(idx).__name__), f"an int32/int64 tensor of shape {want} on {x.device}")
    N = NW // 2 if swiglu else NW
    rows = (S,) if ragged else (G, M_max)
    if row_scale is not None:
        check(isinstance(row_scale, torch.Tensor) and row_scale.dtype == torch.float32
              and tuple(row_scale.shape) == rows and row_scale.device == x.device, "row_scale",
              getattr(row_scale, "shape", type(row_scale).__name__), f"float32 {rows} on {x.device}")
        row_scale = row_scale.contiguous()
    if out is None:
        out = torch.empty(*rows, N, dtype=torch.bfloat16, device=x.device)
    check(isinstance(out, torch.Tensor) and out.dtype in (torch.bfloat16, torch.float32)
          and tuple(out.shape) == (*rows, N) and out.device == x.device and out.is_contiguous(), "out",
          getattr(out, "shape", type(out).__name__), f"a contiguous bf16 / fp32 tensor {(*rows, N)} on {x.device}")
    m = -(-S // G) if ragged else M_max
    cfg = default_config(m, swiglu) if config is None else config
    if config is not None:
        cfg = check_config(config, "config", swiglu)
    if S > 0:
        launch(x.data.contiguous(), x.scales.contiguous().view(torch.uint8), x.global_scale.reshape(-1).contiguous(),
               w.data.contiguous(), w.scales.contiguous().view(torch.uint8),
               w.global_scale.reshape(-1).expand(G).contiguous(), idx.contiguous(), out, row_scale, ragged=ragged,
               swiglu=swiglu, G=G, N=N, K=K, M_max=M_max, S=S, config=cfg, x_swizzled=x.swizzled,
               w_swizzled=w.swizzled)
    return out

