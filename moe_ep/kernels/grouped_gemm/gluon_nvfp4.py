"""A Gluon warp-specialized grouped GEMM for Hopper (sm_90a), NVFP4 weights times bf16 x, ragged rows: the decode
shape class (a few tokens per expert). GPU-only; the ``triton.language`` kernel (``kernels.py``) stays the
reference path, and this one is not chosen by the dispatcher yet.

``y_g = x_g @ w_g^T`` per expert g, computed as ``acc^T = W_g x_g^T`` so that 64 weight rows fill the wgmma M slot
and the handful of tokens its N slot (``BLOCK_T`` of 8, 16, 32 or 64). A program owns 64 weight rows of one expert
and walks that expert's tokens in ``BLOCK_T`` chunks (one chunk at decode), over K in steps of ``BLOCK_K``.

Two partitions share a ``STAGES``-deep ring of shared-memory slots, each guarded by a "ready" and an "empty"
mbarrier:

- the producer (1 warp, padded to a warpgroup by Triton) TMA-loads a step's packed codes ``[64, BLOCK_K/2]``
  (uint8), their E4M3 scale bytes ``[64, BLOCK_K/16]`` and the x tile ``[BLOCK_T, BLOCK_K]`` (bf16; rows past S read
  as zeros) into a free slot;
- the consumer (the default partition: one warpgroup) decodes codes * scales into bf16 (``e2m1 * s`` is exact in
  bf16: at most 2 significant bits times 4; by the tl kernel's inline PTX, or by plain fp32 ops), writes them to the
  wgmma A buffer in shared memory, runs ``warpgroup_mma`` against x^T (the x slot seen transposed), frees the slot
  once the MMA is done, and at the end of the K loop multiplies by the expert's ``1 / gs`` (the reference divides
  each weight by gs: the same up to fp32 rounding) and stores the rows of this expert's tokens.

With ``overlap``, the A buffer is doubled and a slot is freed one step late, so that each step's MMA runs while the
next one is decoded. The ring depth and the register budget per token tile (:func:`launch_params`) let 2-3 CTAs
share an SM at the decode tiles: Triton's own budget for a warp-specialized kernel (256 registers a thread) admits
one.

Operands are the user-visible :class:`NvFp4Tensor` as it is (linear scales, no kernel-specific packing). TMA needs
16-byte row strides, so K must be a multiple of 256 (the scale rows are K/16 bytes), which :func:`check_gluon_nvfp4`
says with a named error; the same bound makes ``BLOCK_K`` 256 divide K.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ... import device_facts
from ...errors import check
from ..nvfp4_tensor import NvFp4Tensor
from .fp4_decode import _FP4_ASM  # the tl kernel's register decode: 4 codes of 2 words -> 4 bf16x2, one fma each

BLOCK_N = 64  # weight rows per program: the wgmma M of one warpgroup
BLOCK_K = 256  # K per ring slot (128 code bytes per row: one 128-byte swizzle row)
K_MULTIPLE = 256  # TMA: the scale rows (K/16 bytes) must be 16-byte multiples
TOKEN_TILES = (8, 16, 32, 64)  # BLOCK_T choices: wgmma N of 8 .. 64
_TWO_118 = gl.constexpr(2.0 ** 118)
# a barrier of the CTA's threads: Gluon's name for it changed (Triton 3.6 ``thread_barrier``, 3.9 ``barrier``)
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# TMA's global -> shared copy, likewise renamed (3.6 ``async_copy_global_to_shared``, 3.9 ``async_load``; the same
# arguments: descriptor, coordinates, mbarrier, destination)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


def token_tile(tokens_per_expert: int) -> int:
    """The BLOCK_T for an expected ``tokens_per_expert``: the smallest of :data:`TOKEN_TILES` holding them (64 past
    that; an expert with more tokens takes more chunks)."""
    return next((t for t in TOKEN_TILES if t >= tokens_per_expert), TOKEN_TILES[-1])


def launch_params(block_t: int) -> tuple[int, int | None]:
    """(ring stages, registers per thread or None for Triton's 256) of a token tile: as many CTAs per SM as shared
    memory and registers allow together. The warp-specialized CTA is 2 warpgroups (the consumer, and the producer's
    warp padded to one), so ``maxnreg`` r gives 65536 // (256 r) CTAs per SM, the consumer ``2 r - 24`` registers:
    80 -> 3 CTAs (136 consumer registers), 128 -> 2. Shared memory per CTA: the 32 KB A buffer plus
    ``stages * (9 KB + block_t KB / 2)``; 8 and 16 token tiles take 2 stages (3 CTAs), 32 takes 3 (2 CTAs), 64 fits
    one CTA."""
    return {8: (2, 80), 16: (2, 80), 32: (3, 128)}.get(block_t, (3, None))


LAUNCH_SWEEP = [(None, None, False), (2, 80, False), (2, 64, False), (3, 128, False), (3, 256, False),
                (4, 128, False), (2, 80, True), (2, 128, True), (3, 128, True)]
"""(stages, maxnreg, overlap) that benchmarks/bench_gluon_nvfp4.py times and the GPU tests check: first the token
tile's :func:`launch_params` (None), then others (256 registers: Triton's own budget, one CTA per SM)."""


def shared_layouts(block_t: int) -> dict:
    """The NVMMA shared layouts of the ring slots and the A buffer (also the compile check's descriptor types)."""
    return {"codes": gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K // 2], gl.uint8),
            "scales": gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K // 16], gl.uint8),
            "x": gl.NVMMASharedLayout.get_default_for([block_t, BLOCK_K], gl.bfloat16)}


@gluon.jit
def _expert_rows(offs_ptr, S):
    """This program's expert's token rows [start, end), offsets clamped to [0, S]."""
    g = gl.program_id(1)
    start = gl.minimum(gl.maximum(gl.load(offs_ptr + g), 0), S)
    end = gl.maximum(gl.minimum(gl.load(offs_ptr + g + 1), S), start)
    return g, start, end


@gluon.jit
def _producer(q_desc, s_desc, x_desc, offs_ptr, q_ring, s_ring, x_ring, ready, empty, S, N, K,
              BLOCK_T: gl.constexpr, STAGES: gl.constexpr):
    """1 warp: fill ring slot i % STAGES with K step i's codes, scales and x tile once the consumer freed it."""
    BN: gl.constexpr = q_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    g, start, end = _expert_rows(offs_ptr, S)
    row = g * N + gl.program_id(0) * BN  # row of the [G * N, ...] code and scale views
    nbytes: gl.constexpr = q_desc.block_type.nbytes + s_desc.block_type.nbytes + x_desc.block_type.nbytes
    i = 0
    for t0 in range(start, end, BLOCK_T):
        for k0 in range(0, K, BK):
            slot = i % STAGES
            # a fresh barrier counts as having completed the phase before phase 0: the first pass does not wait
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            _tma_load(q_desc, [row, k0 // 2], bar, q_ring.index(slot))
            _tma_load(s_desc, [row, k0 // 16], bar, s_ring.index(slot))
            _tma_load(x_desc, [t0, k0], bar, x_ring.index(slot))
            i += 1


@gluon.jit
def _fp4_values(code):
    """E2M1 codes (int16, 4 bits) -> fp32 values: the magnitude bits land in an fp16's exponent LSBs and mantissa
    MSB (code 1 on an fp16 subnormal), the sign in its sign bit; 2^14 rescales (exact)."""
    h = ((code & 7) << 9) | ((code & 8) << 12)
    return h.to(gl.float16, bitcast=True).to(gl.float32) * 16384.0


@gluon.jit
def _decode_plain(q, sb, code_layout: gl.constexpr):
    """Codes uint8 [BN, BK/2] (``code_layout``: a thread holds one scale block's 8 bytes) and their scale bytes
    [BN, BK/16] -> bf16 [BN, BK] ``e2m1 * s`` (exact), in fp32 arithmetic."""
    BN: gl.constexpr = q.shape[0]
    BK: gl.constexpr = 2 * q.shape[1]
    q = q.to(gl.int16)
    s = sb.to(gl.float8e4nv, bitcast=True).to(gl.float32)
    s = gl.join(s, s)
    s = gl.join(s, s)
    s = gl.join(s, s)  # [BN, BK/16, 2, 2, 2]: the scale of each code byte of its block
    s = gl.convert_layout(gl.reshape(s, [BN, BK // 2]), code_layout)
    lo = (_fp4_values(q & 0xF) * s).to(gl.bfloat16)  # element 2c of byte c
    hi = (_fp4_values((q >> 4) & 0xF) * s).to(gl.bfloat16)  # element 2c + 1
    return gl.reshape(gl.join(lo, hi), [BN, BK])


@gluon.jit
def _decode_fast(q, sb, code_layout: gl.constexpr):
    """The same values times 2^-8 (the caller folds 256 into the global scale) by the tl kernel's inline PTX
    (``fp4_decode._FP4_ASM``): byte pairs make int16 words of 4 codes, and each pair of words takes 3 integer ops
    and one bf16x2 fma per register of 2 values, against its block's scale as bf16 ``s * 2^118`` (exact)."""
    BN: gl.constexpr = q.shape[0]
    BK: gl.constexpr = 2 * q.shape[1]
    b0, b1 = gl.split(gl.reshape(q, [BN, BK // 4, 2]))
    words = b0.to(gl.int16) | (b1.to(gl.int16) << 8)  # [BN, BK/4]: word w holds elements 4w .. 4w + 3
    s = sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _TWO_118
    s = gl.join(s, s)
    s = gl.join(s, s)  # [BN, BK/16, 2, 2]: the scale of each word of its block
    s = gl.convert_layout(gl.reshape(s, [BN, BK // 4]), words.type.layout).to(gl.bfloat16)
    w0, w1, w2, w3 = gl.inline_asm_elementwise(_FP4_ASM, "=r,=r,=r,=r,r,r", [words, s],
                                               dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
                                               is_pure=True, pack=2)
    return gl.reshape(gl.join(gl.join(w0, w2), gl.join(w1, w3)), [BN, BK])


@gluon.jit
def _consumer(gs_ptr, out_ptr, offs_ptr, q_ring, s_ring, x_ring, a_smem, ready, empty, S, N, K,
              BLOCK_T: gl.constexpr, STAGES: gl.constexpr, FAST_DECODE: gl.constexpr):
    """The default warpgroup: decode each slot's codes * scales into the A buffer, free the slot, wgmma against x^T;
    then scale by 1 / gs and store this expert's rows."""
    BN: gl.constexpr = a_smem.shape[1]
    BK: gl.constexpr = a_smem.shape[2]
    A_BUFFERS: gl.constexpr = a_smem.shape[0]
    # a thread holds 8 code bytes (16 values: one scale block) of a row, and the matching scale byte
    code_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    scale_layout: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, BLOCK_T, 16])
    g, start, end = _expert_rows(offs_ptr, S)
    n0 = gl.program_id(0) * BN
    gs = gl.load(gs_ptr + g)
    # the reference's rows with a global scale that is not positive and finite are NaN
    inv = gl.where((gs > 0.0) & (gs < float("inf")), 1.0 / gs, float("nan"))
    if FAST_DECODE:
        inv = inv * 256.0  # the fast decode's values are e2m1 * s * 2^-8
    rows = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
    toks = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, acc_layout))
    i = 0
    for t0 in range(start, end, BLOCK_T):
        acc = gl.zeros([BN, BLOCK_T], gl.float32, acc_layout)
        for k0 in range(0, K, BK):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            q = q_ring.index(slot).load(code_layout)  # [BN, BK/2]
            sb = s_ring.index(slot).load(scale_layout)  # [BN, BK/16]
            if FAST_DECODE:
                w = _decode_fast(q, sb, code_layout)
            else:
                w = _decode_plain(q, sb, code_layout)
            a_buf = a_smem.index(i % A_BUFFERS)
            a_buf.store(w)
            fence_async_shared()
            _cta_barrier()  # every warp's part of A is written before the MMA reads it
            acc = warpgroup_mma(a_buf, x_ring.index(slot).permute((1, 0)), acc, is_async=True)
            if A_BUFFERS == 2:  # the MMA runs on while the next slot is decoded into the other A buffer
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                # step i - 1's MMA is done: its slot is free (a chunk's first step has no step before it)
                mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=k0 > 0)
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(empty.index(slot), count=1)
            i += 1
        if A_BUFFERS == 2:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1)
        tok = t0 + toks
        ptrs = out_ptr + tok[None, :].to(gl.int64) * N + rows[:, None]
        mask = (tok[None, :] < end) & (rows[:, None] < N)
        gl.store(ptrs, (acc * inv).to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _gluon_nvfp4_kernel(q_desc, s_desc, x_desc, gs_ptr, out_ptr, offs_ptr, S, N, K, BLOCK_T: gl.constexpr,
                        STAGES: gl.constexpr, FAST_DECODE: gl.constexpr, A_BUFFERS: gl.constexpr):
    """Program (n, g): weight rows n * 64 .. of expert g against all of g's tokens (module docstring)."""
    BN: gl.constexpr = q_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    q_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, BK // 2], q_desc.layout)
    s_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, BK // 16], s_desc.layout)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, BK], x_desc.layout)
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [A_BUFFERS, BN, BK], a_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (gs_ptr, out_ptr, offs_ptr, q_ring, s_ring, x_ring, a_smem, ready, empty, S, N, K, BLOCK_T,
                     STAGES, FAST_DECODE)),
        (_producer, (q_desc, s_desc, x_desc, offs_ptr, q_ring, s_ring, x_ring, ready, empty, S, N, K, BLOCK_T,
                     STAGES)),
    ], [1], [24])
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(j))
        mbarrier.invalidate(empty.index(j))


def unavailable_reason() -> str | None:
    """Why :func:`gluon_nvfp4_grouped_gemm` cannot run here, or None where it can: it needs an sm_90 GPU
    (:func:`device_facts.sm90_unavailable_reason`)."""
    return device_facts.sm90_unavailable_reason()


def check_gluon_nvfp4(x: torch.Tensor, w: NvFp4Tensor, offsets: torch.Tensor, out_dtype: torch.dtype,
                      stages: int | None = None, maxnreg: int | None = None, overlap: bool = False,
                      tokens_per_expert: int | None = None, fast_decode: bool = True) -> None:
    """Raise :class:`MoEEpInputError` unless the arguments are what :func:`gluon_nvfp4_grouped_gemm` takes."""
    check(isinstance(w, NvFp4Tensor), "type(w)", type(w).__name__, "an NvFp4Tensor [G, N, K]")
    w.check("w")
    check(len(w.shape) == 3, "w.shape", tuple(w.shape), "[G, N, K] (3-D)")
    G, N, K = w.shape
    check(not w.swizzled, "w.swizzled", w.swizzled, "False (linear scales [G, N, K/16])")
    check(K % K_MULTIPLE == 0, "w.shape[2] (K)", K,
          f"a multiple of {K_MULTIPLE} (TMA rows of the K/16 scale bytes must be 16-byte multiples)")
    check(G > 0 and N > 0, "w.shape", tuple(w.shape), "G > 0 and N > 0")
    check(w.global_scale.numel() in (1, G), "w.global_scale.numel()", w.global_scale.numel(), f"1 or {G}")
    check(isinstance(x, torch.Tensor), "type(x)", type(x).__name__, "a bf16 torch.Tensor [S, K]")
    check(x.dtype == torch.bfloat16, "x.dtype", x.dtype, "torch.bfloat16")
    check(x.dim() == 2 and x.shape[1] == K, "x.shape", tuple(x.shape), f"[S, {K}] (K of w)")
    check(isinstance(offsets, torch.Tensor) and offsets.dtype == torch.int32, "offsets.dtype",
          getattr(offsets, "dtype", type(offsets).__name__), "torch.int32")
    check(tuple(offsets.shape) == (G + 1, ), "offsets.shape", tuple(offsets.shape), f"({G + 1},) (G + 1)")
    check(out_dtype in (torch.float32, torch.bfloat16), "out_dtype", out_dtype, "torch.float32 or torch.bfloat16")
    check(stages is None or (isinstance(stages, int) and 1 <= stages <= 8), "stages", stages,
          "None or an int in [1, 8]")
    check(maxnreg is None or (isinstance(maxnreg, int) and 32 <= maxnreg <= 256), "maxnreg", maxnreg,
          "None or an int in [32, 256]")
    check(overlap in (False, True), "overlap", overlap, "True or False")
    check(tokens_per_expert is None or (isinstance(tokens_per_expert, int) and tokens_per_expert > 0),
          "tokens_per_expert", tokens_per_expert, "None or a positive int")
    check(not overlap or stages is None or stages >= 2, "stages", stages,
          ">= 2 with overlap (a slot is freed a step late)")
    check(fast_decode in (False, True), "fast_decode", fast_decode, "True or False")
    check(x.shape[0] < 2**31, "x.shape[0] (S)", x.shape[0], "< 2^31")
    check(x.device == w.device and x.device.type == "cuda", "x.device", str(x.device),
          f"a CUDA device, the weights' ({w.device})")
    check(offsets.device == x.device, "offsets.device", str(offsets.device), str(x.device))


def gluon_nvfp4_grouped_gemm(x: torch.Tensor, w: NvFp4Tensor, offsets: torch.Tensor, *,
                             out_dtype: torch.dtype = torch.bfloat16, tokens_per_expert: int | None = None,
                             out: torch.Tensor | None = None, fast_decode: bool = True, stages: int | None = None,
                             maxnreg: int | None = None, overlap: bool = False) -> torch.Tensor:
    """``y[offsets[g]:offsets[g+1]] = x[offsets[g]:offsets[g+1]] @ dequant(w[g])^T`` on sm_90a (H100 / H200).

    ``x``: bf16 ``[S, K]`` sorted by expert (CUDA; a contiguous copy is made of a strided one). ``w``:
    :class:`NvFp4Tensor` ``[G, N, K]``, linear scales, global scale per expert (``[G]``) or one; K a multiple of 256.
    ``offsets``: int32 ``[G + 1]`` on x's device, nondecreasing in ``[0, S]`` (clamped to it on the device; no host
    sync). Returns ``out_dtype`` (float32 or bf16) ``[S, N]``: ``out`` (contiguous, that dtype and shape, x's device)
    or a new ``torch.empty``; rows outside every expert are not written, as with the tl kernel.
    ``tokens_per_expert`` (default ``ceil(S / G)``) picks the token tile; an expert with more tokens takes more passes
    over its weights, never a wrong answer. ``fast_decode``: decode by the tl kernel's inline PTX (bf16x2 fma; the
    default) or by plain fp32 ops (the simpler decode, the same values). ``stages`` (ring depth, >= 1) and ``maxnreg``
    (registers per thread) override :func:`launch_params` (the benchmark sweeps them). ``overlap``: two A buffers, so
    that each step's MMA runs while the next step is decoded (32 KB more shared memory; stages >= 2). Bad arguments
    raise :class:`MoEEpInputError`.
    """
    check_gluon_nvfp4(x, w, offsets, out_dtype, stages, maxnreg, overlap, tokens_per_expert, fast_decode)
    G, N, K = w.shape
    S = x.shape[0]
    if out is None:
        out = torch.empty(S, N, dtype=out_dtype, device=x.device)
    else:
        check(isinstance(out, torch.Tensor) and out.dtype == out_dtype and tuple(out.shape) == (S, N)
              and out.is_contiguous() and out.device == x.device, "out",
              f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}",
              f"a contiguous {out_dtype} ({S}, {N}) on {x.device}")
    if S == 0:
        return out
    if tokens_per_expert is None:
        tokens_per_expert = -(-S // G)
    block_t = token_tile(tokens_per_expert)
    default_stages, default_regs = launch_params(block_t)
    stages = default_stages if stages is None else stages
    maxnreg = default_regs if maxnreg is None else maxnreg
    x = x.contiguous()
    if x.data_ptr() % 16:  # TMA reads from a 16-byte aligned base (a row slice of a larger tensor may not be)
        x = x.clone()
    codes = w.data.contiguous().view(G * N, K // 2)
    scales = w.scales.contiguous().view(torch.uint8).view(G * N, K // 16)
    gs = w.global_scale.reshape(-1).float().expand(G).contiguous()
    lay = shared_layouts(block_t)
    q_desc = TensorDescriptor.from_tensor(codes, [BLOCK_N, BLOCK_K // 2], lay["codes"])
    s_desc = TensorDescriptor.from_tensor(scales, [BLOCK_N, BLOCK_K // 16], lay["scales"])
    x_desc = TensorDescriptor.from_tensor(x, [block_t, BLOCK_K], lay["x"])
    grid = (math.ceil(N / BLOCK_N), G)
    regs = {} if maxnreg is None else {"maxnreg": maxnreg}
    _gluon_nvfp4_kernel[grid](q_desc, s_desc, x_desc, gs, out, offsets, S, N, K, BLOCK_T=block_t, STAGES=stages,
                              FAST_DECODE=bool(fast_decode), A_BUFFERS=_a_buffers(overlap), num_warps=4, **regs)
    return out


def _a_buffers(overlap: bool) -> int:
    """The kernel's ``A_BUFFERS`` (the launch's and the compile check's alike): 2 with overlap, else 1."""
    return 2 if overlap else 1


def compile_signature(block_t: int, out: str = "bf16", fast_decode: bool = True,
                      overlap: bool = False) -> tuple[dict, dict, dict]:
    """(signature, constexprs, compile options) of :func:`_gluon_nvfp4_kernel` at a token tile's
    :func:`launch_params`, for a GPU-less ``triton.compile`` (compile checks)."""
    stages, maxnreg = launch_params(block_t)
    lay = shared_layouts(block_t)
    sig = {"q_desc": f"tensordesc<u8[{BLOCK_N}, {BLOCK_K // 2}],{lay['codes']!r}>",
           "s_desc": f"tensordesc<u8[{BLOCK_N}, {BLOCK_K // 16}],{lay['scales']!r}>",
           "x_desc": f"tensordesc<bf16[{block_t}, {BLOCK_K}],{lay['x']!r}>",
           "gs_ptr": "*fp32", "out_ptr": f"*{out}", "offs_ptr": "*i32", "S": "i32", "N": "i32", "K": "i32",
           "BLOCK_T": "constexpr", "STAGES": "constexpr", "FAST_DECODE": "constexpr", "A_BUFFERS": "constexpr"}
    return (sig, {"BLOCK_T": block_t, "STAGES": stages, "FAST_DECODE": fast_decode, "A_BUFFERS": _a_buffers(overlap)},
            dict(num_warps=4, **({} if maxnreg is None else {"maxnreg": maxnreg})))


__all__ = ["gluon_nvfp4_grouped_gemm", "check_gluon_nvfp4", "unavailable_reason", "token_tile", "K_MULTIPLE"]
