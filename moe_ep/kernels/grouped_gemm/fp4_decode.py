"""NVFP4 operands decoded to bf16: in registers for a bf16 MMA (Hopper has no FP4 tensor cores; used on Blackwell too).

A weight tile arrives as int16 words of 4 E2M1 codes plus their E4M3 block-scale bytes; :func:`fp4_tile` turns it
into bf16 values ``e2m1 * s * 2^-8`` (exact in bf16) by 3 integer ops and one bf16x2 fma per register pair (inline
PTX, :data:`_FP4_ASM`) and the scales by 2.5 ops each (:data:`_SCALE_ASM`). With K permuted (:func:`dot_k_order`)
those registers are wgmma's register operand as they are, with no shuffles. The interpreter, which runs no inline
asm, takes plain ops that give the same values (:func:`fp4_value`). :func:`decode_nvfp4` writes the same values
out as a bf16 tensor, for the operands a bf16 GEMM over them beats decoding in the K loop: NVFP4 x always (masked:
only the rows within the counts), NVFP4 weights at prefill sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import device_facts
from ...triton_runtime import COMPILED
from .. import host_math
from ..autotuning import launch, nvfp4_configs, size_bucket
from ..nvfp4 import e4m3_values_of_bytes

# Two int16 words of 4 codes ($4: e0 low, e1 high) -> 4 bf16x2 registers, $i = code i of e0 and of e1: mask, one
# multiply to put the magnitude into the exponent LSBs / mantissa MSB and the sign into bit 15 (code 1 lands on a bf16
# subnormal, which bf16 fma keeps), mask, one bf16x2 fma by their block's scale s * 2^118 ($5, the same in both halves).
_FP4_ASM = tl.constexpr("""{
.reg .b32 m, n, z;
mov.b32 z, 0x80008000;
shr.b32 n, $4, 8;
and.b32 m, $4, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0; fma.rn.bf16x2 $0, m, $5, z;
and.b32 m, $4, 0x00F000F0; mul.lo.u32 m, m, 0x104; and.b32 m, m, 0x81C081C0; fma.rn.bf16x2 $1, m, $5, z;
and.b32 m, n, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0; fma.rn.bf16x2 $2, m, $5, z;
and.b32 m, n, 0x00F000F0; mul.lo.u32 m, m, 0x104; and.b32 m, m, 0x81C081C0; fma.rn.bf16x2 $3, m, $5, z;
}""")
# Two E4M3 bytes (sign ignored) -> s * 2^118 as bf16 each: placed at bits 4-10 of a 16-bit half they are the bf16 of
# s * 2^-120 (subnormal scales land on bf16 subnormals); two exact bf16x2 multiplies by 2^127 and 2^111 scale them up.
_SCALE_ASM = tl.constexpr("""{
.reg .b32 t, c, z;
mov.b32 z, 0x80008000;
prmt.b32 t, $1, $2, 0x4101; shr.b32 t, t, 4; and.b32 t, t, 0x07F007F0;
mov.b32 c, 0x7F007F00; fma.rn.bf16x2 t, t, c, z;
mov.b32 c, 0x77007700; fma.rn.bf16x2 $0, t, c, z;
}""")


@triton.jit
def fp4_tile(q, scale_bytes, R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_K_ORDER: tl.constexpr):
    """Packed E2M1 codes as int16 words [R, BLOCK_K / 4] (code i of word w: physical k = 4w + i) and their E4M3
    scale bytes [R, BLOCK_K / 16] -> bf16 [R, BLOCK_K] in the dot's k order (:func:`dot_k_order`), holding
    ``e2m1 * s * 2^-8`` (exact; the caller folds 2^8 into the global scale)."""
    QK: tl.constexpr = BLOCK_K // 4
    if COMPILED:  # inline PTX; the interpreter runs none: the same values from plain ops
        s = tl.inline_asm_elementwise(_SCALE_ASM, "=r,r,r", [scale_bytes.to(tl.int32)], dtype=tl.bfloat16,
                                      is_pure=True, pack=2)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], [R, BLOCK_K // 16, 4]), [R, QK])
        w0, w1, w2, w3 = tl.inline_asm_elementwise(_FP4_ASM, "=r,=r,=r,=r,r,r", [q, s], dtype=(tl.bfloat16, ) * 4,
                                                   is_pure=True, pack=2)
    else:
        s_val, _ = e4m3_values_of_bytes(scale_bytes.to(tl.int32))
        s = tl.reshape(tl.broadcast_to((s_val * 0.00390625)[:, :, None], [R, BLOCK_K // 16, 4]), [R, QK])
        p = q.to(tl.int32)
        w0 = fp4_value(p & 0xF, s)
        w1 = fp4_value((p >> 4) & 0xF, s)
        w2 = fp4_value((p >> 8) & 0xF, s)
        w3 = fp4_value((p >> 12) & 0xF, s)
    w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [R, BLOCK_K])  # physical k order
    if DOT_K_ORDER:
        w = dot_k_order(w, BLOCK_K, False)
    return w


@triton.jit
def dot_k_order(t, BLOCK_K: tl.constexpr, K_FIRST: tl.constexpr):
    """A tile [R, BLOCK_K] ([BLOCK_K, R] when K_FIRST) in physical k order -> the k order the NVFP4-weight dot sees
    (a permutation of K, applied to x too, leaves the dot unchanged). A wgmma register operand gives a thread
    k = 2c + e + 8h (e, h in {0, 1}) of every 16-chunk j, (2c, 2c + 1) and (2c + 8, 2c + 9) in one register each.
    Logical k = 16 (2t + jl) + 8h + 2c + e sits at physical ((c * BLOCK_K / 32 + t) * 2 + e) * 4 + 2 jl + h: lane c
    reads one run of BLOCK_K / 4 codes per row (whole int16 words, 2 scales for BLOCK_K 128), and a register holds
    the same code position of two adjacent words, so decoding a word pair fills 4 registers with no shuffles. Pure
    register relabeling for the weights; x (bf16, a few rows) is shuffled in registers on its way to shared memory."""
    if K_FIRST:
        R: tl.constexpr = t.shape[1]
        t = tl.permute(tl.reshape(t, [4, BLOCK_K // 32, 2, 2, 2, R]), (1, 3, 4, 0, 2, 5))
        out = tl.reshape(t, [BLOCK_K, R])
    else:
        R: tl.constexpr = t.shape[0]
        t = tl.permute(tl.reshape(t, [R, 4, BLOCK_K // 32, 2, 2, 2]), (0, 2, 4, 5, 1, 3))
        out = tl.reshape(t, [R, BLOCK_K])
    return out


@triton.jit
def fp4_value(code, scale):
    """E2M1 codes (int32, 4 bits) times fp32 block scales -> bf16 (exact), elementwise."""
    h = (((code & 7) << 9) | ((code & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
    return (h.to(tl.float32) * (scale * 16384.0)).to(tl.bfloat16)


@triton.autotune(configs=nvfp4_configs(), key=["K_BUCKET", "MASKED"])
@triton.jit(do_not_specialize=["R", "G", "M_MAX"])
def _decode_kernel(q_ptr, s_ptr, out_ptr, cnt_ptr, R, K, KQ, K16, G, M_MAX, K_BUCKET, MASKED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (i, j): the j-th BLOCK_K columns of row block i. MASKED: the grid's rows are G groups of programs, and
    the programs of group g walk its first counts[g] rows (which start at g * M_MAX) in strides, so no row past a
    count is read or written."""
    if MASKED:
        split = tl.num_programs(0) // G
        g = tl.program_id(0) // split
        first = g.to(tl.int64) * M_MAX
        n_rows = tl.minimum(tl.maximum(tl.load(cnt_ptr + g), 0), M_MAX)  # counts past M_max: all rows, no more
        r0 = tl.program_id(0) % split * BLOCK_M
        step = split * BLOCK_M
    else:
        first = tl.zeros([], dtype=tl.int64)
        n_rows = R
        r0 = tl.program_id(0) * BLOCK_M
        step = tl.num_programs(0) * BLOCK_M
    qk = tl.program_id(1) * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)
    sk = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    for r in range(r0, n_rows, step):
        rm = r + tl.arange(0, BLOCK_M)
        rmask = rm < n_rows
        rows = first + rm  # int64: rows * K can pass 2^31
        q = tl.load(q_ptr.to(tl.pointer_type(tl.int16)) + rows[:, None] * KQ + qk[None, :],
                    mask=rmask[:, None] & (qk[None, :] < KQ), other=0)
        sb = tl.load(s_ptr + rows[:, None] * K16 + sk[None, :], mask=rmask[:, None] & (sk[None, :] < K16), other=0)
        tl.store(out_ptr + rows[:, None] * K + kk[None, :], fp4_tile(q, sb, BLOCK_M, BLOCK_K, False),
                 mask=rmask[:, None] & (kk[None, :] < K))


def decode_nvfp4(data: torch.Tensor, scales: torch.Tensor, shape, counts: torch.Tensor | None = None) -> torch.Tensor:
    """NVFP4 codes (uint8 ``[..., K/2]``) and linear E4M3 scale bytes (uint8 ``[..., K/16]``) -> bf16 ``shape``
    holding ``e2m1 * s / 256``, exactly the values :func:`fp4_tile` gives the MMA (the global scale and the 256 are
    left to the GEMM's fp32 accumulator). Contiguous inputs, K % 16 == 0 (the GEMM launcher's checks).

    ``counts`` (masked layout, ``shape`` ``[G, M_max, K]``): only the first ``counts[g]`` rows of each group are
    read and written; the copy's other rows are left unset."""
    K = shape[-1]
    R = data.numel() // (K // 2)
    out = torch.empty(shape, dtype=torch.bfloat16, device=data.device)
    if not R:
        return out
    masked = counts is not None
    G, m_max = (shape[0], shape[1]) if masked else (1, R)

    def row_programs(meta):  # masked: a few programs per group, enough for every SM, each walking row blocks
        blocks = host_math.cdiv(m_max, meta["BLOCK_M"])
        if not masked:
            return blocks
        return G * min(blocks, max(1, 4 * device_facts.sm_count() // (G * host_math.cdiv(K, meta["BLOCK_K"]))))

    grid = lambda meta: (row_programs(meta), host_math.cdiv(K, meta["BLOCK_K"]))  # noqa: E731
    launch(_decode_kernel, grid, data, scales, out, counts if masked else data, R, K, K // 4, K // 16, G, m_max,
           size_bucket(K), masked)
    return out
