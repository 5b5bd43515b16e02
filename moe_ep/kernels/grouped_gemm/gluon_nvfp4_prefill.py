"""A Gluon warp-specialized grouped GEMM for Hopper (sm_90a), NVFP4 weights times bf16 x, ragged or masked rows: the
prefill shape class (hundreds of tokens per expert). GPU-only; the ``triton.language`` kernel (``kernels.py``) stays the
reference path.

``y_g = x_g @ w_g^T`` per expert g, computed as ``acc^T = W_g x_g^T``: a math warpgroup's 64 weight rows are wgmma's
A operand, decoded from NVFP4 straight into the A *registers* (no decoded copy in shared memory, none in global
memory), and ``BLOCK_T`` tokens (16 to 256) its N, read by wgmma from the x tile TMA brought into shared memory. A
tile is 128 weight rows (two math warpgroups, 64 rows each, sharing the x tile) by ``BLOCK_T`` tokens.

Partitions, sharing a ``STAGES``-deep ring of shared-memory slots with a "ready" and an "empty" mbarrier each:

- the producer (1 warp, padded to a warpgroup by Triton) TMA-loads each K step's x tile ``[BLOCK_T, 64]`` and the
  tile's packed codes ``[128, 32 bytes]`` (the codes as they are, as int32 words);
- two math warpgroups: each loads its 64 rows' code words (and, from global memory a step ahead, their scale
  bytes), decodes them into wgmma's A registers (:func:`_decode_a`), issues the MMA, waits for it and frees the
  slot: while one warpgroup decodes, the other's MMA runs. (An MMA left in flight across the next decode would need
  its A registers kept intact to a later wait; Triton 3.6 keeps the bf16 values alive there, not the packed
  registers wgmma reads, and ptxas then serializes every MMA.) At the end of a tile: times ``256 / gs`` of the
  expert (the decode's values are ``e2m1 * s * 2^-8``) and, in GEMM2's form, the token's routing weight; GEMM1's
  form (SwiGLU) takes ``silu(gate) * up`` of each thread's gate and up sums. The result goes transposed into a
  shared-memory staging tile, then out by one TMA store where the tile's tokens are all its expert's, else copied
  out by the warpgroup's threads, 16 bytes a store, masked to the expert's rows.

The A operand of a bf16 wgmma gives thread ``(warp w, lane l)`` rows ``16 w + l // 4`` and ``+ 8``, and of each
16-wide K chunk the pairs ``k = 2c, 2c + 1`` and ``8 + 2c, 9 + 2c`` (``c = l % 4``): of the chunk's 8 code bytes, byte
``c`` and byte ``c + 4`` (a byte holds ``k = 2b`` in its low nibble and ``2b + 1`` in its high). So every thread of a
row's four loads the row's code words, and one ``prmt`` picks its two bytes out of a word pair; 8 ALU ops more make
two bf16x2 registers of A, scaled by the chunk's E4M3 scale (``_DECODE_ASM``). The layouts below say which register
holds which value; the conversion to wgmma's operand layout moves no data.

GEMM1's form (``SWIGLU``, :func:`gluon_nvfp4_prefill_swiglu_grouped_gemm`): a tile is 64 output channels, a math
warpgroup's 64 rows 4 groups of 8 gate rows over their 8 up rows, so that a thread's two accumulator rows (r and
r + 8) are one channel's gate and up. The producer brings a slot's 64 gate rows and their 64 up rows as two boxes; a
thread loads its channel's gate words and up words and joins them: the interleave is a relabeling of its registers.
The scale bytes are read at the same rows.

Every partition walks the persistent tile order of ``gluon_fp8``: experts in order, and within expert g its token
tiles fastest (``m_tiles(g) * n_tiles``), program p taking tiles p, p + P, ... Token tiles may read rows past their
expert's end (computed, never stored), weight tiles rows past N (likewise). K must be a multiple of 64 (a K step's
4 scale bytes of a row are one aligned int32; the code rows are then 16-byte multiples, as TMA needs).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ... import device_facts
from ...errors import MoEEpConfigError, check
from ...triton_runtime import triton_minor
from ..nvfp4_tensor import NvFp4Tensor
from .gluon_fp8 import _expert_rows, _first_tile, _tma_load, _tma_store, tma_storable
from .gluon_nvfp4 import _cta_barrier

BLOCK_K = 64  # K per ring slot: 4 scale blocks, one int32 of scale bytes per row
WG_ROWS = 64  # weight rows per math warpgroup: the wgmma M of one warpgroup
BLOCK_N = 2 * WG_ROWS  # a tile's weight rows: two math warpgroups
K_MULTIPLE = 64
TOKEN_TILES = (16, 32, 64, 128, 256)
"""BLOCK_T choices: wgmma N. 256 for experts of 256 tokens on; below, the smallest that holds an expert's tokens
(fewer tokens computed past an expert's end, more tiles in flight)."""
MAX_EXPERTS = 1024
_WG_ROWS = gl.constexpr(WG_ROWS)

# A thread's two code words of one K chunk's k 0-7 or 8-15 (row r's: $2, row r + 8's: $4) -> two bf16x2 registers of
# wgmma's A operand, (k = 2c, 2c + 1) of row r ($0) and of row r + 8 ($1): prmt by $6 (c | (4 + c) << 8) puts byte
# c of row r's word in byte 0 and of row r + 8's in byte 2; a shift and two more prmt put each byte's two nibbles
# (k = 2c in the low one, 2c + 1 in the high) at the bottom of a half each; then per register the tl kernel's
# _FP4_ASM steps: mask, one multiply to put the magnitude into the exponent LSBs / mantissa MSB and the sign into bit
# 15 (code 1 lands on a bf16 subnormal, which bf16 fma keeps), mask, one bf16x2 fma by the row's block scale as bf16
# s * 2^118 in both halves ($10, $11): e2m1 * s * 2^-8, exact. (The asm's 4 elements are the layout's first two
# register bits, e and the row's + 8; its other operands repeat the words and scales for e.)
_DECODE_ASM = gl.constexpr("""{
.reg .b32 t, y, u, m, z;
mov.b32 z, 0x80008000;
prmt.b32 t, $2, $4, $6;
shr.b32 y, t, 4;
prmt.b32 u, t, y, 0x0400;
and.b32 m, u, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0; fma.rn.bf16x2 $0, m, $10, z;
prmt.b32 u, t, y, 0x0602;
and.b32 m, u, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0; fma.rn.bf16x2 $1, m, $11, z;
}""")
_TWO_118 = gl.constexpr(2.0 ** 118)
# benchmarks only (ABLATE & 1): the code words themselves as the A registers, times the scale (the decode's data flow
# without its bit operations; the values are garbage)
_NO_DECODE_ASM = gl.constexpr("fma.rn.bf16x2 $0, $2, $10, $2; fma.rn.bf16x2 $1, $4, $11, $4;")

# The decode's layout of a math warpgroup's [64 rows, 4 (c), 4 (j: K chunk), 2 (h: the chunk's k 0-7 or 8-15), 2 (e:
# k even or odd)]: wgmma's A operand with the chunk's k split as 8h + 2c + e, register bits e, the row's + 8, h, j
# in that order (as the operand's), c the lane's low bits, the rest of the rows the lane's high bits and the warp.
DECODE_LAYOUT = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 0, 1], [8, 0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0]],
    lane_bases=[[0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]],
    warp_bases=[[16, 0, 0, 0, 0], [32, 0, 0, 0, 0]], block_bases=[], shape=[WG_ROWS, 4, 4, 2, 2])

# A math warpgroup's code words of a K step, [64 rows, 8 words], as the decode reads them: the decode layout's rows,
# the 8 words in registers, the same words in the four lanes of a row (word 2j + h: chunk j's k 0-7 or 8-15)
WORD_LAYOUT = gl.DistributedLinearLayout(
    reg_bases=[[8, 0], [0, 1], [0, 2], [0, 4]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[WG_ROWS, BLOCK_K // 8])

# GEMM1's half of that: a warpgroup's 32 gate (or up) rows [32, 8], rows 8w + r in lane bits and the warp
HALF_WORD_LAYOUT = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[WG_ROWS // 2, BLOCK_K // 8])


@gluon.jit
def _rows(idx_ptr, g, M, MMAX, MASKED: gl.constexpr):
    """Expert g's rows [start, end) of x and out (``[M, K]``, ``[M, N]``): ragged, its offsets (``idx_ptr``: ``[G +
    1]``) clamped as ``gluon_fp8._expert_rows`` clamps them; MASKED, ``g * MMAX`` on, its count (``idx_ptr``:
    ``[G]``) clamped to [0, MMAX]."""
    if MASKED:
        start = g * MMAX
        end = start + gl.minimum(gl.maximum(gl.load(idx_ptr + g), 0), MMAX)
    else:
        start, end = _expert_rows(idx_ptr, g, M)
    return start, end


def token_tile(tokens_per_expert: int) -> int:
    """The BLOCK_T for an expected ``tokens_per_expert``: the smallest of :data:`TOKEN_TILES` holding them, 256 past
    that."""
    return next((t for t in TOKEN_TILES if t >= tokens_per_expert), TOKEN_TILES[-1])


def ring_stages(block_t: int) -> int:
    """Ring slots that fit shared memory beside the staging tiles: a slot is the x tile (``block_t * 128`` bytes)
    and 4 KB of codes; a math warpgroup's staging tile is ``[block_t, 64]`` bf16."""
    slot = block_t * BLOCK_K * 2 + BLOCK_N * BLOCK_K // 2
    staging = 2 * block_t * WG_ROWS * 2
    return min(6, (220 * 1024 - staging) // slot)


def shared_layouts(block_t: int, swiglu: bool = False) -> dict:
    """The NVMMA shared layouts of the x and code ring slots and the staging tile (also the compile check's
    descriptor types); ``swiglu``: GEMM1's (32 output columns a math warpgroup)."""
    return {"x": gl.NVMMASharedLayout.get_default_for([block_t, BLOCK_K], gl.bfloat16),
            # unswizzled: a thread reads its two rows' 32 bytes whole
            "codes": gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
            "out": gl.NVMMASharedLayout.get_default_for([block_t, wg_columns(swiglu)], gl.bfloat16)}


def wg_columns(swiglu: bool) -> int:
    """A math warpgroup's output columns: its 64 weight rows, or with ``swiglu`` the 32 channels of its 32 gate rows
    and 32 up rows."""
    return WG_ROWS // 2 if swiglu else WG_ROWS


def code_box(swiglu: bool) -> list:
    """The TMA box of code words over ``[G * R, K/8]``: a ring slot's 128 rows, or with ``swiglu`` half of them (its
    64 gate rows, then its 64 up rows)."""
    return [BLOCK_N // 2 if swiglu else BLOCK_N, BLOCK_K // 8]


@gluon.jit
def _producer(x_desc, q_desc, offs_ptr, x_ring, q_ring, ready, empty, M, N, K, G, N_TILES, MMAX,
              STAGES: gl.constexpr, SWIGLU: gl.constexpr, MASKED: gl.constexpr):
    """1 warp: for every tile of this program, fill ring slot i % STAGES with K step i's x tile and code words once
    both math warpgroups freed it. SWIGLU: a slot's 128 rows are the tile's 64 gate rows over their 64 up rows (two
    boxes of w13's ``[G * 2I, K/8]`` words): 64 output channels."""
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    TILE_N: gl.constexpr = 64 if SWIGLU else 128  # output columns a tile
    # a slot's bytes: the x tile and 128 rows of code words (SWIGLU: two boxes of 64)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + q_desc.block_type.nbytes * (2 if SWIGLU else 1)
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    k_steps = gl.cdiv(K, BK)
    i = 0
    first = 0
    for g in range(G):
        start, end = _rows(offs_ptr, g, M, MMAX, MASKED)
        m_tiles = gl.cdiv(end - start, BT)
        last = first + m_tiles * N_TILES
        for t in range(_first_tile(first, pid, P), last, P):
            local = t - first
            row0 = start + (local % m_tiles) * BT
            n0 = (local // m_tiles) * TILE_N
            for ks in range(k_steps):
                slot = i % STAGES
                # a fresh barrier counts as having completed the phase before phase 0: the first pass does not wait
                mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, nbytes)
                _tma_load(x_desc, [row0, ks * BK], bar, x_ring.index(slot))
                if SWIGLU:
                    gate = g * 2 * N + n0  # row of w13's [G * 2I, K/8] words
                    _tma_load(q_desc, [gate, ks * (BK // 8)], bar, q_ring.index(slot).slice(0, 64, dim=0))
                    _tma_load(q_desc, [gate + N, ks * (BK // 8)], bar, q_ring.index(slot).slice(64, 64, dim=0))
                else:
                    _tma_load(q_desc, [g * N + n0, ks * (BK // 8)], bar, q_ring.index(slot))
                i += 1
        first = last


@gluon.jit
def _decode_a(words, sw, a_layout: gl.constexpr, ABLATE: gl.constexpr = 0):
    """A math warpgroup's K step of weights as wgmma's A operand: ``words`` int32 ``[64, 4, 2]`` (row, j, h: the
    row's code word 2j + h of the step, in ``Slice(1, Slice(4, DECODE_LAYOUT))``) and ``sw`` int32 ``[64]`` (the
    row's 4 scale bytes of the step, chunk j's in byte j) -> bf16 ``[64, 64]`` ``e2m1 * s * 2^-8`` in ``a_layout``."""
    L: gl.constexpr = DECODE_LAYOUT
    R: gl.constexpr = words.shape[0]
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L)))))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, L)))))
    sel = (c | ((c + 4) << 8))[None, :, None, None, None]
    # chunk j's scale byte, sign dropped (as the tl kernel's decode), as bf16 s * 2^118 (exact)
    sb = ((sw[:, None] >> (8 * j[None, :])) & 0x7F).to(gl.uint8)  # [R, 4]
    s = (sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _TWO_118).to(gl.bfloat16)
    shape = gl.full([R, 4, 4, 2, 2], 0, gl.int32, L)  # (its shape and layout, to broadcast the operands to)
    if ABLATE & 2:  # (benchmarks only: the scale conversion left out)
        s = gl.full([R, 4], 1.0, gl.bfloat16, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, L))))
    asm: gl.constexpr = _NO_DECODE_ASM if ABLATE & 1 else _DECODE_ASM
    a = gl.inline_asm_elementwise(asm, "=r,=r,r,r,r,r,r,r,r,r,r,r",
                                  [gl.broadcast(words[:, None, :, :, None], shape)[0], gl.broadcast(sel, shape)[0],
                                   gl.broadcast(s[:, None, :, None, None], shape)[0]],
                                  dtype=gl.bfloat16, is_pure=True, pack=4)
    a = gl.permute(a, (0, 2, 3, 1, 4))  # [R, j, h, c, e]: k = 16j + 8h + 2c + e
    return gl.convert_layout(gl.reshape(a, [R, 64]), a_layout)


@gluon.jit
def _consumer(ws_ptr, gs_ptr, rs_ptr, out_ptr, offs_ptr, x_ring, q_ring, ready, empty, M, N, K, G, N_TILES, MMAX,
              o_desc, o_tile, WG: gl.constexpr, STAGES: gl.constexpr, HAS_RS: gl.constexpr, TMA_STORE: gl.constexpr,
              SWIGLU: gl.constexpr, MASKED: gl.constexpr, SCALE_AHEAD: gl.constexpr, ABLATE: gl.constexpr):
    """Math warpgroup WG: weight rows WG * 64 .. WG * 64 + 63 of each of this program's tiles against the tile's
    tokens, then stored (times 256 / gs, and with HAS_RS the token's routing weight) as out[token, row] where the
    token is its expert's and the row < N. SWIGLU: the warpgroup's rows are 4 groups of 8 gate rows over their 8 up
    rows (``_producer``), so a thread holds a channel's gate sums and its up sums; it stores ``silu(gate) * up`` of
    its 32 channels."""
    BT: gl.constexpr = x_ring.shape[1]
    BK: gl.constexpr = x_ring.shape[2]
    TILE_N: gl.constexpr = 64 if SWIGLU else 128  # output columns a tile
    WG_N: gl.constexpr = TILE_N // 2  # a warpgroup's
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, BT, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    word_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(4, DECODE_LAYOUT))
    row_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, DECODE_LAYOUT))))
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    k_steps = gl.cdiv(K, BK)
    KW = K // BK  # scale words per weight row
    r_dec = WG * _WG_ROWS + gl.arange(0, _WG_ROWS, layout=row_layout)
    toks = gl.arange(0, BT, layout=gl.SliceLayout(0, acc_layout))
    # the staging tile's rows as a thread copies them out: 8 bf16 (16 bytes) a thread, a row's 64 by 8 threads
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    c_rows = gl.arange(0, BT, layout=gl.SliceLayout(1, copy_layout))
    c_cols = gl.arange(0, WG_N, layout=gl.SliceLayout(0, copy_layout))
    if SWIGLU:
        # decode row 16w + 8u + r: channel 8w + r of the warpgroup's 32, gate's row (u = 0) or up's (u = 1)
        r_ch = (r_dec - WG * _WG_ROWS) // 16 * 8 + r_dec % 8 + WG * WG_N
        r_up = (r_dec // 8) % 2
    acc = gl.zeros([_WG_ROWS, BT], gl.float32, acc_layout)
    i = 0
    first = 0
    for g in range(G):
        start, end = _rows(offs_ptr, g, M, MMAX, MASKED)
        m_tiles = gl.cdiv(end - start, BT)
        last = first + m_tiles * N_TILES
        gs = gl.load(gs_ptr + g)
        # the reference's rows with a global scale that is not positive and finite are NaN; the decode's values
        # are e2m1 * s * 2^-8
        inv = gl.where((gs > 0.0) & (gs < float("inf")), 256.0 / gs, float("nan"))
        for t in range(_first_tile(first, pid, P), last, P):
            local = t - first
            row0 = start + (local % m_tiles) * BT
            n0 = (local // m_tiles) * TILE_N
            if SWIGLU:  # w13's row of each decode row: gate rows, then up rows
                s_ptrs = ws_ptr + (g * 2 * N + r_up * N + n0 + r_ch).to(gl.int64) * KW
                s_mask = n0 + r_ch < N
            else:
                wrow = n0 + r_dec  # the decode's weight rows of this expert
                s_ptrs = ws_ptr + (g * N + wrow).to(gl.int64) * KW
                s_mask = wrow < N
            sw = gl.load(s_ptrs, mask=s_mask, other=0)
            # SCALE_AHEAD 3 (a variant, not yet timed): the scale words loaded 3 K steps ahead, not 1, in case their
            # latency (from DRAM: each is read once a tile) outlasts a step
            sw1 = gl.load(s_ptrs + 1, mask=s_mask & (1 < KW), other=0) if SCALE_AHEAD == 3 else sw
            sw2 = gl.load(s_ptrs + 2, mask=s_mask & (2 < KW), other=0) if SCALE_AHEAD == 3 else sw
            for ks in range(k_steps):
                slot = i % STAGES
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                if SWIGLU:
                    # the warpgroup's 32 channels' gate rows and up rows, each [32, 8], joined so that decode row
                    # 16w + 8u + r is channel 8w + r's gate (u = 0) or up (u = 1) row: WORD_LAYOUT's registers
                    gate = q_ring.index(slot).slice(WG * WG_N, WG_N, dim=0).load(HALF_WORD_LAYOUT)
                    up = q_ring.index(slot).slice(2 * WG_N + WG * WG_N, WG_N, dim=0).load(HALF_WORD_LAYOUT)
                    words = gl.reshape(gl.join(gate, up), [4, 8, BK // 8, 2])  # [w, r, word, u]
                    words = gl.reshape(gl.permute(words, (0, 3, 1, 2)), [_WG_ROWS, BK // 8])
                else:
                    words = q_ring.index(slot).slice(WG * _WG_ROWS, _WG_ROWS, dim=0).load(WORD_LAYOUT)
                words = gl.convert_layout(gl.reshape(words, [_WG_ROWS, 4, 2]), word_layout)
                a = _decode_a(words, sw, a_layout, ABLATE)
                acc = warpgroup_mma(a, x_ring.index(slot).permute((1, 0)), acc, use_acc=ks > 0, is_async=True)
                # the next step's scale bytes (SCALE_AHEAD: the step's that far ahead) load while this MMA runs
                sw_next = gl.load(s_ptrs + (ks + SCALE_AHEAD), mask=s_mask & (ks + SCALE_AHEAD < KW), other=0)
                # the MMA is waited for here: its A registers must stay as they are until it is done, and Triton
                # 3.6 cannot keep the packed registers wgmma reads alive past a later wait (ptxas then serializes
                # the step's MMAs); the other math warpgroup's MMA runs while this one decodes its next step
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(empty.index(slot), count=1)
                if SCALE_AHEAD == 3:
                    sw, sw1, sw2 = sw1, sw2, sw_next
                else:
                    sw = sw_next
                i += 1
            vals = acc * inv
            tok = row0 + toks
            if HAS_RS:
                vals = vals * gl.load(rs_ptr + tok, mask=tok < end, other=0.0)[None, :]
            if SWIGLU:
                # rows 16w + 8u + r: u (a register bit of the accumulator layout) splits gate from up in each thread
                gate, up = gl.split(gl.permute(gl.reshape(vals, [4, 2, 8, BT]), (0, 2, 3, 1)))
                vals = gl.reshape(gate / (1.0 + gl.exp(-gate)) * up, [WG_N, BT])
            # the tile transposed into the staging tile, once the previous tile's store has read it (the TMA
            # store's wait, or the barrier after the copy below); the barrier after the write lets every thread of
            # the warpgroup read any of its rows
            if TMA_STORE:
                tma.store_wait(0)
            o_tile.store(gl.permute(vals.to(o_tile.dtype), (1, 0)))
            if TMA_STORE and row0 + BT <= end:
                fence_async_shared()
                _tma_store(o_desc, [row0, n0 + WG * WG_N], o_tile)
            else:
                # a tile over its expert's end (or an out TMA cannot store into): the rows that are the expert's,
                # 16 bytes a store
                _cta_barrier()  # (in a warp-specialized partition: the partition's threads)
                v = o_tile.load(copy_layout)
                cols = n0 + WG * WG_N + c_cols
                ptrs = out_ptr + (row0 + c_rows)[:, None].to(gl.int64) * N + cols[None, :]
                gl.store(ptrs, v, mask=((row0 + c_rows) < end)[:, None] & (cols < N)[None, :])
                _cta_barrier()
        first = last
    if TMA_STORE:
        tma.store_wait(0)  # the staging tile stays live until its last store has read it


@gluon.jit
def _gluon_nvfp4_prefill_kernel(x_desc, q_desc, ws_ptr, gs_ptr, rs_ptr, out_ptr, offs_ptr, M, N, K, G, N_TILES,
                                MMAX, o_desc, STAGES: gl.constexpr, HAS_RS: gl.constexpr, TMA_STORE: gl.constexpr,
                                SWIGLU: gl.constexpr, MASKED: gl.constexpr, SCALE_AHEAD: gl.constexpr,
                                ABLATE: gl.constexpr):
    """Persistent program p: tiles p, p + P, ... of the expert-major tile order (module docstring). ``o_desc``: with
    TMA_STORE a descriptor over out ``[M, N]`` of ``[BLOCK_T, 64]`` boxes (SWIGLU: 32), else out again (unread). N:
    the output's columns (SWIGLU: I, of w13's 2I rows an expert). ``offs_ptr``: the offsets ``[G + 1]``, or with
    MASKED the counts ``[G]`` of the experts' ``MMAX``-row blocks of x and out."""
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    WG_N: gl.constexpr = 32 if SWIGLU else 64  # output columns a math warpgroup
    gl.static_assert(q_desc.block_type.shape[1] * 8 == BK, "a slot's code words cover its x tile's K")
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BK], x_desc.layout)
    q_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 2 * _WG_ROWS, BK // 8], q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # a staging tile a math warpgroup (the TMA store's box layout)
    o_tiles = gl.allocate_shared_memory(gl.bfloat16, [2, BT, WG_N],
                                        gl.NVMMASharedLayout.get_default_for([BT, WG_N], gl.bfloat16))
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=2)  # each math warpgroup frees the slot once
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (ws_ptr, gs_ptr, rs_ptr, out_ptr, offs_ptr, x_ring, q_ring, ready, empty, M, N, K, G, N_TILES,
                     MMAX, o_desc, o_tiles.index(0), 0, STAGES, HAS_RS, TMA_STORE, SWIGLU, MASKED, SCALE_AHEAD,
                     ABLATE)),
        (_consumer, (ws_ptr, gs_ptr, rs_ptr, out_ptr, offs_ptr, x_ring, q_ring, ready, empty, M, N, K, G, N_TILES,
                     MMAX, o_desc, o_tiles.index(1), 1, STAGES, HAS_RS, TMA_STORE, SWIGLU, MASKED, SCALE_AHEAD,
                     ABLATE)),
        (_producer, (x_desc, q_desc, offs_ptr, x_ring, q_ring, ready, empty, M, N, K, G, N_TILES, MMAX, STAGES, SWIGLU,
                     MASKED)),
    ], [4, 1], [232, 24])
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(j))
        mbarrier.invalidate(empty.index(j))


def unavailable_reason() -> str | None:
    """Why :func:`gluon_nvfp4_prefill_grouped_gemm` cannot run here, or None where it can: it needs an sm_90 GPU
    (:func:`device_facts.sm90_unavailable_reason`)."""
    return device_facts.sm90_unavailable_reason()


def available() -> bool:
    """Whether :func:`gluon_nvfp4_prefill_grouped_gemm` can run here (an sm_90 GPU, no interpreter)."""
    return unavailable_reason() is None


CHECKED_TRITONS: tuple[str, ...] = ("3.6", )
"""Triton releases under which both forms passed the GPU property tests (``tests/test_gluon_nvfp4_prefill.py`` on
sm_90, every token tile): the grouped-GEMM dispatcher takes this path for ragged calls under these only
(:func:`dispatchable`); the entry points run under any. Not 3.9 yet: its builds are checked (no spills), its GPU
tests have not run under it."""

MASKED_CHECKED_TRITONS: tuple[str, ...] = ()
"""The same for the masked layout (the dispatcher's masked calls). None yet: its builds are checked and its CPU
tests pass; its GPU tests have not run."""


def dispatchable(masked: bool = False) -> bool:
    """Whether the grouped-GEMM dispatcher may take this path here for a ragged (or ``masked``) call:
    :func:`available`, under a Triton of :data:`CHECKED_TRITONS` (:data:`MASKED_CHECKED_TRITONS`)."""
    return not_dispatchable_reason(masked) is None


def not_dispatchable_reason(masked: bool = False) -> str | None:
    """Why :func:`dispatchable` says False here (``moe-ep info`` shows the ragged layout's), or None."""
    reason = unavailable_reason()
    checked = MASKED_CHECKED_TRITONS if masked else CHECKED_TRITONS
    if reason is None and triton_minor() not in checked:
        reason = (f"Triton {triton.__version__}: verified under {' / '.join(checked)} only" if checked
                  else f"the {'masked' if masked else 'ragged'} layout: not yet run on a GPU")
    return reason


def takes(G: int, N: int, K: int, swiglu: bool) -> bool:
    """Whether a ragged call of these sizes (N: the output's columns, GEMM1's I) is one the kernels have: K a multiple
    of 64, GEMM1's I of 8, at most :data:`MAX_EXPERTS` experts."""
    return K % K_MULTIPLE == 0 and (not swiglu or N % 8 == 0) and 0 < G <= MAX_EXPERTS


def check_gluon_nvfp4_prefill(x: torch.Tensor, w: NvFp4Tensor, offsets: torch.Tensor | None,
                              row_scale: torch.Tensor | None = None, block_t: int | None = None,
                              num_programs: int | None = None, swiglu: bool = False,
                              counts: torch.Tensor | None = None) -> None:
    """Raise :class:`MoEEpInputError` unless the arguments are what :func:`gluon_nvfp4_prefill_grouped_gemm` (with
    ``swiglu``, :func:`gluon_nvfp4_prefill_swiglu_grouped_gemm`: no row scale) takes, ragged (``offsets``) or masked
    (``counts``) (no device is touched; the device checks come last)."""
    check(isinstance(w, NvFp4Tensor), "type(w)", type(w).__name__, "an NvFp4Tensor [G, N, K]")
    w.check("w")
    check(len(w.shape) == 3, "w.shape", tuple(w.shape), "[G, N, K] (3-D)")
    G, N, K = w.shape
    check(not w.swizzled, "w.swizzled", w.swizzled, "False (linear scales [G, N, K/16])")
    check(G > 0 and N > 0, "w.shape", tuple(w.shape), "G > 0 and N > 0")
    check(G <= MAX_EXPERTS, "w.shape[0] (G)", G, f"<= {MAX_EXPERTS}")
    check(K % K_MULTIPLE == 0 and K > 0, "w.shape[2] (K)", K,
          f"a positive multiple of {K_MULTIPLE} (a K step's 4 scale bytes of a row are one aligned int32)")
    check(w.global_scale.numel() in (1, G), "w.global_scale.numel()", w.global_scale.numel(), f"1 or {G}")
    if swiglu:
        check(N % 16 == 0, "w.shape[1] (2I)", N, "a multiple of 16 (gate rows, then up rows; I a multiple of 8)")
    masked = counts is not None
    check(masked != (offsets is not None), "(offsets, counts)",
          tuple(None if t is None else type(t).__name__ for t in (offsets, counts)),
          "exactly one of offsets (ragged layout) or counts (masked layout)")
    check(isinstance(x, torch.Tensor), "type(x)", type(x).__name__, "a bf16 torch.Tensor")
    check(x.dtype == torch.bfloat16, "x.dtype", x.dtype, "torch.bfloat16")
    if masked:
        check(x.dim() == 3 and x.shape[0] == G and x.shape[2] == K, "x.shape", tuple(x.shape),
              f"[{G}, M_max, {K}] (masked: G and K of w)")
    else:
        check(x.dim() == 2 and x.shape[1] == K, "x.shape", tuple(x.shape), f"[M, {K}] (ragged: K of w)")
    rows = x.shape[:-1]
    check(x.numel() // K < 2**31, "x's rows", x.numel() // K, "< 2^31")
    idx, name, length = (counts, "counts", G) if masked else (offsets, "offsets", G + 1)
    check(isinstance(idx, torch.Tensor) and idx.dtype == torch.int32, f"{name}.dtype",
          getattr(idx, "dtype", type(idx).__name__), "torch.int32")
    check(tuple(idx.shape) == (length, ), f"{name}.shape", tuple(idx.shape), f"({length},)")
    check(block_t is None or block_t in TOKEN_TILES, "block_t", block_t, f"None or one of {TOKEN_TILES}")
    check(num_programs is None or (isinstance(num_programs, int) and num_programs > 0), "num_programs", num_programs,
          "None or a positive int")
    if row_scale is not None:
        check(isinstance(row_scale, torch.Tensor) and row_scale.dtype == torch.float32, "row_scale.dtype",
              getattr(row_scale, "dtype", type(row_scale).__name__), "torch.float32")
        check(tuple(row_scale.shape) == tuple(rows), "row_scale.shape", tuple(row_scale.shape),
              f"{tuple(rows)} (one weight per row of x)")
    check(x.device.type == "cuda" and w.device == x.device, "x.device", str(x.device),
          f"a CUDA device, the weights' ({w.device})")
    check(idx.device == x.device, f"{name}.device", str(idx.device), str(x.device))
    if row_scale is not None:
        check(row_scale.device == x.device, "row_scale.device", str(row_scale.device), str(x.device))


def launch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor, offsets: torch.Tensor,
           out: torch.Tensor, row_scale: torch.Tensor | None, block_t: int, num_programs: int,
           swiglu: bool = False, m_max: int | None = None, scale_ahead: int = 1, ablate: int = 0) -> None:
    """Launch the kernel on checked parts (at least one row): x bf16 ``[M, K]``, codes uint8 ``[G, R, K/2]``, scale
    bytes ``[G, R, K/16]`` (any 1-byte dtype), fp32 ``gs [G]``, int32 ``offsets [G + 1]``, ``out`` bf16 ``[M, N]``
    (N = R, or with ``swiglu`` R / 2: w13's gate rows then up rows), ``row_scale`` fp32 ``[M]`` or None, the
    persistent grid ``num_programs``. ``m_max`` (masked layout): x and out are the experts' ``m_max``-row blocks
    (``M = G * m_max``) and ``offsets`` their int32 counts ``[G]``. ``scale_ahead``: how many K steps ahead of their
    decode the scale words load, 1 or 3 (benchmarks: 3 is not yet timed). ``ablate`` (benchmarks only, wrong
    results): 1 leaves the code decode's bit operations out, 2 the scale conversion."""
    G, R, K2 = codes.shape
    K = 2 * K2
    N = R // 2 if swiglu else R
    x = x.contiguous()
    if x.data_ptr() % 16:  # TMA reads from a 16-byte aligned base (a row slice of a larger tensor may not be)
        x = x.clone()
    words = codes.contiguous().view(torch.int32).view(G * R, K // 8)
    sw = scales.contiguous().view(torch.uint8).view(torch.int32).view(G * R, K // BLOCK_K)
    rs = gs if row_scale is None else row_scale.contiguous()  # unread without HAS_RS
    tma_store = tma_storable(out)
    if not tma_store:  # every tile copied out by the threads: at 256 tokens GEMM2's form spills (Triton 3.9's build)
        block_t = min(block_t, 128)
    lay = shared_layouts(block_t, swiglu)
    x_desc = TensorDescriptor.from_tensor(x, [block_t, BLOCK_K], lay["x"])
    q_desc = TensorDescriptor.from_tensor(words, code_box(swiglu), lay["codes"])
    o_desc = TensorDescriptor.from_tensor(out, [block_t, wg_columns(swiglu)], lay["out"]) if tma_store else out
    _gluon_nvfp4_prefill_kernel[(num_programs, )](x_desc, q_desc, sw, gs, rs, out, offsets, x.shape[0], N, K, G,
                                                  -(-N // (2 * wg_columns(swiglu))), m_max or 0, o_desc,
                                                  STAGES=ring_stages(block_t), HAS_RS=row_scale is not None,
                                                  TMA_STORE=tma_store, SWIGLU=bool(swiglu),
                                                  MASKED=m_max is not None, SCALE_AHEAD=scale_ahead,
                                                  ABLATE=ablate, num_warps=4)


def _run(x, w, offsets, counts, row_scale, out, block_t, num_programs, swiglu):
    """The entry points' common part past their checks: ``out`` checked or made, the launch (masked: on the
    experts' row blocks flattened)."""
    reason = unavailable_reason()
    if reason is not None:
        raise MoEEpConfigError(f"gluon_nvfp4_prefill {reason}")
    G, R, K = w.shape
    rows, N = tuple(x.shape[:-1]), R // 2 if swiglu else R
    if out is None:
        out = torch.empty(*rows, N, dtype=torch.bfloat16, device=x.device)
    else:
        check(isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
              and tuple(out.shape) == (*rows, N) and out.is_contiguous() and out.device == x.device, "out",
              f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}",
              f"a contiguous torch.bfloat16 {(*rows, N)} on {x.device}")
    M = x.numel() // K
    if M:
        masked = counts is not None
        gs = w.global_scale.reshape(-1).float().expand(G).contiguous()
        launch(x.reshape(M, K), w.data, w.scales, gs, counts if masked else offsets, out.view(M, N),
               None if row_scale is None else row_scale.reshape(M),
               block_t or token_tile(x.shape[1] if masked else -(-M // G)),
               num_programs or torch.cuda.get_device_properties(x.device).multi_processor_count, swiglu=swiglu,
               m_max=x.shape[1] if masked else None)
    return out


def gluon_nvfp4_prefill_grouped_gemm(x: torch.Tensor, w: NvFp4Tensor, offsets: torch.Tensor | None = None, *,
                                     counts: torch.Tensor | None = None, row_scale: torch.Tensor | None = None,
                                     out: torch.Tensor | None = None, block_t: int | None = None,
                                     num_programs: int | None = None) -> torch.Tensor:
    """``y_g = x_g @ dequant(w[g])^T`` per expert g on sm_90a (H100 / H200), ragged or masked.

    ``w``: :class:`NvFp4Tensor` ``[G, N, K]``, linear scales, a global scale per expert (``[G]``) or one; K a
    multiple of 64. Exactly one layout:

    - ragged: ``x`` bf16 ``[M, K]`` sorted by expert, ``offsets`` int32 ``[G + 1]`` on x's device, nondecreasing in
      ``[0, M]`` (clamped to it on the device; no host sync): expert g's rows are ``offsets[g]:offsets[g+1]``;
    - masked: ``x`` bf16 ``[G, M_max, K]``, ``counts`` int32 ``[G]`` (clamped to ``[0, M_max]`` on the device):
      expert g's rows are ``x[g, :counts[g]]``.

    ``row_scale``: optional fp32 ``[M]`` (masked: ``[G, M_max]``), each output row's factor (the routing weight of
    its slot). Returns bf16 ``[M, N]`` (masked: ``[G, M_max, N]``): ``out`` (contiguous, on x's device) or a new
    ``torch.empty``; rows outside every expert are not written, as with the tl kernel. ``block_t``: the token tile
    (default :func:`token_tile` of ``ceil(M / G)``, masked of ``M_max``). ``num_programs``: the persistent grid
    (default: the SM count). Bad arguments raise :class:`MoEEpInputError`; a machine without an sm_90 GPU raises
    :class:`MoEEpConfigError`.
    """
    check_gluon_nvfp4_prefill(x, w, offsets, row_scale, block_t, num_programs, counts=counts)
    return _run(x, w, offsets, counts, row_scale, out, block_t, num_programs, False)


def gluon_nvfp4_prefill_swiglu_grouped_gemm(x: torch.Tensor, w13: NvFp4Tensor, offsets: torch.Tensor | None = None,
                                            *, counts: torch.Tensor | None = None, out: torch.Tensor | None = None,
                                            block_t: int | None = None,
                                            num_programs: int | None = None) -> torch.Tensor:
    """GEMM1 of an expert MLP with NVFP4 weights on sm_90a (H100 / H200): ``h = silu(x w_gate[g]^T) * (x w_up[g]^T)``
    per expert, in fp32, bf16 out (the tl kernel's ``grouped_gemm(..., swiglu=True)``).

    ``w13``: :class:`NvFp4Tensor` ``[G, 2I, K]``, gate rows then up rows, linear scales, a global scale per expert or
    one; K a multiple of 64, I a multiple of 8. ``x`` with ``offsets`` (ragged) or ``counts`` (masked) as for
    :func:`gluon_nvfp4_prefill_grouped_gemm`. Returns bf16 ``[M, I]`` (masked: ``[G, M_max, I]``): ``out`` or a new
    ``torch.empty``; rows outside every expert are not written. ``block_t``, ``num_programs``: as there. Bad
    arguments raise :class:`MoEEpInputError`; a machine without an sm_90 GPU raises :class:`MoEEpConfigError`.
    """
    check_gluon_nvfp4_prefill(x, w13, offsets, None, block_t, num_programs, swiglu=True, counts=counts)
    return _run(x, w13, offsets, counts, None, out, block_t, num_programs, True)


def compile_signature(block_t: int, has_rs: bool = True, tma_store: bool = True,
                      swiglu: bool = False, masked: bool = False, scale_ahead: int = 1) -> tuple[dict, dict, dict]:
    """(signature, constexprs, compile options) of :func:`_gluon_nvfp4_prefill_kernel` for a token tile, form
    (``swiglu``: GEMM1's, no row scale), layout and ``scale_ahead`` (:func:`launch`), as a launch builds it, for a
    GPU-less ``triton.compile`` (compile checks)."""
    lay = shared_layouts(block_t, swiglu)
    consts = dict(STAGES=ring_stages(block_t), HAS_RS=has_rs and not swiglu, TMA_STORE=tma_store, SWIGLU=swiglu,
                  MASKED=masked, SCALE_AHEAD=scale_ahead, ABLATE=0)
    box = ", ".join(map(str, code_box(swiglu)))
    sig = {"x_desc": f"tensordesc<bf16[{block_t}, {BLOCK_K}],{lay['x']!r}>",
           "q_desc": f"tensordesc<i32[{box}],{lay['codes']!r}>",
           "ws_ptr": "*i32", "gs_ptr": "*fp32", "rs_ptr": "*fp32", "out_ptr": "*bf16", "offs_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "G": "i32", "N_TILES": "i32", "MMAX": "i32",
           "o_desc": (f"tensordesc<bf16[{block_t}, {wg_columns(swiglu)}],{lay['out']!r}>" if tma_store
                      else "*bf16"),
           **{name: "constexpr" for name in consts}}
    return sig, consts, dict(num_warps=4)


__all__ = ["gluon_nvfp4_prefill_grouped_gemm", "gluon_nvfp4_prefill_swiglu_grouped_gemm", "check_gluon_nvfp4_prefill",
           "unavailable_reason", "launch", "token_tile", "K_MULTIPLE", "TOKEN_TILES"]
