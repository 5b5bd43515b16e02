"""A Gluon warp-specialized FP8 x FP8 block-scaled ragged grouped GEMM for Hopper (sm_90a): the prefill shape class.
GPU-only; the ``triton.language`` kernel (``kernels.py``) stays the reference path. The grouped-GEMM dispatcher
(``plan.py``, path "gluon-fp8") takes these kernels for ragged FP8 calls from ``MOE_EP_GLUON_FP8_MIN_M`` tokens per
expert on, where :func:`dispatchable`: GEMM2's form with a bf16 output, and GEMM1's with SwiGLU and an FP8 output.

``y[rows of g] = sum_kb (x_q[rows, kb] @ w_q[g, :, kb]^T) * xs[rows, kb] * ws[g, n // 128, kb]`` in fp32, bf16 out,
optionally times a routing weight per row (GEMM2's form; the tl kernel's ``HAS_RS``). Operands are DeepSeek-V3's
format as :class:`Fp8Tensor` holds it (docs/DESIGN.md, FP8): x e4m3 ``[M, K]`` with fp32 scales ``[M, ceil(K/128)]``,
w e4m3 ``[G, N, K]`` with fp32 scales ``[G, ceil(N/128), ceil(K/128)]``. Each 128-wide K block's product is summed by
the tensor core on its own (``use_acc=False``) and added to the fp32 accumulator times its two scales: DeepGEMM's
promotion, so the tensor core's reduced-precision FP8 accumulation never spans more than one block.

Why Gluon: in ``triton.language`` a block's product comes from a zero-initialised ``tl.dot`` that is waited on at
once, so every K step issues its MMA, waits, and promotes while the tensor core idles. Here the partitions are:

- a producer (1 warp, padded to a warpgroup by Triton) TMA-loads each K step's x tile ``[BLOCK_M, 128]`` and w tile
  ``[BLOCK_N, 128]`` into a ``STAGES``-deep ring of shared-memory slots, each with a "ready" and an "empty" mbarrier;
- ``CONSUMERS`` math warpgroups (the default partition and, with two, a worker partition running the same code) each
  own 64 rows of the ``64 * CONSUMERS``-row tile, read the slot's x rows and the shared w tile by ``warpgroup_mma``,
  promote, and free the slot (the empty barrier counts one arrival per consumer, so neither waits for the other:
  while one promotes, the other's MMA runs). ``OVERLAP`` also keeps a second K block's MMA in flight while the
  previous one is promoted, within one warpgroup (two product buffers, each MMA writing into the registers of a
  product already promoted; the K loop's body is a group of ``2 * PAIRS`` blocks that ends with nothing in flight,
  so that no in-flight product is carried over the loop's back edge, and the producer pads K with zero blocks to
  whole groups).

Every partition walks the same persistent tile order: experts in order, and within expert g its row tiles fastest
(``m_tiles(g) * n_tiles`` tiles), program p taking tiles p, p + P, ... of that sequence. The order comes from the
device-side offsets alone (no host sync); empty experts own no tiles. Row tiles may read rows past their expert's end
(the next expert's rows, or TMA's zero fill past M): those rows are computed and never stored, and columns past N
likewise. K need not be a multiple of 128 (TMA fills the last block's columns past K with zeros), but TMA needs
16-byte row strides: K a multiple of 16.

Named variants (:data:`VARIANTS`) choose the consumers, the overlap and GEMM2's store: from registers (two bytes a
store, half of each 32-byte sector used: ncu on an H100 counts 48% of the kernel's global sectors excessive), or
(TMA_STORE) through a staging tile in shared memory and one asynchronous TMA store a warpgroup tile, whose drain
overlaps the warpgroup's next tile. PAIRED (``coop_tma_store_paired``, GEMM2's default) takes the K steps in pairs so
that each step's block scales are loaded a whole step before the product that uses them (ncu found the math warps
waiting on those loads: 8-10% of GEMM2's time by ablation), with ``coop``'s operations in ``coop``'s order. ORDERED
(``coop_ordered``, GEMM1's default) has the two math warpgroups issue each slot's MMAs in turn, so that one
warpgroup's promotion runs beside the other's MMA rather than both promoting at once (:func:`_mma_step`).

GEMM1's form (``SWIGLU``, :func:`gluon_fp8_swiglu_grouped_gemm`): w13 ``[G, 2I, K]``, gate rows then up rows, with
gate's scale row blocks then up's (``Fp8Tensor.gate_up``), and N is I. A tile is 128 output channels, one FP8 scale
block of the output, so that its epilogue sees every value a scale is the amax of. Its gate and up sums (two
64 x 128 fp32 tiles a warpgroup) and a product besides would take 192 registers, which spills (as OVERLAP at BLOCK_N
128 does), so the tile is two passes over K of 64 channels each: a pass's slot holds x's tile and a w tile of the 64
gate rows over their 64 up rows (two TMA boxes into the slot's halves), one wgmma of N 128 gives both halves' product,
and the promotion takes gate's scale for the first 64 columns and up's for the rest. Between the passes a warpgroup
keeps the first pass's 64 x 64 SwiGLU values; x's tile is loaded again for the second (from L2). The epilogue
(``gluon_fp8_swiglu``) quantizes the block from both passes.
"""

from __future__ import annotations

from typing import NamedTuple

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
from ..fp8 import FP8_BLOCK, Fp8Tensor, fp8_scales_shape
from .gluon_fp8_swiglu import store_fp8_block, swiglu_pass

BLOCK_K = FP8_BLOCK  # one scale block per ring slot
WG_ROWS = 64  # rows per math warpgroup: the wgmma M of one warpgroup
_WG_ROWS = gl.constexpr(WG_ROWS)
PAIRS = gl.constexpr(2)  # OVERLAP: pairs of K blocks per group (the K loop's unrolled body)
K_MULTIPLE = 16  # TMA: the e4m3 rows (K bytes) must be 16-byte multiples
MAX_EXPERTS = 1024  # the tile schedule's per-expert vector (a power of two at least G) stays small


class Variant(NamedTuple):
    """A kernel variant's compile-time choices."""

    consumers: int  # math warpgroups (CONSUMERS), 64 tile rows each
    overlap: bool  # OVERLAP: the next block's MMA in flight while a product is promoted
    block_n: int  # the tile's weight rows (GEMM1: a slot's gate + up rows)
    stages: int  # ring slots
    tma_store: bool = False  # TMA_STORE (GEMM2's form): a warpgroup's whole 64-row tiles stored through shared memory
    paired: bool = False  # PAIRED (no OVERLAP): K steps in pairs, each step's scales multiplied a step after loading
    ordered: bool = False  # ORDERED (two consumers): the warpgroups issue each ring slot's MMAs in turn, 0 then 1

    @property
    def block_m(self) -> int:
        """The tile's x rows: 64 a math warpgroup."""
        return WG_ROWS * self.consumers


VARIANTS = {
    "coop": Variant(2, False, 128, 4),  # two warpgroups on one 128 x 128 tile; each waits for its MMA, then promotes
    "coop_overlap": Variant(2, True, 64, 6),  # two warpgroups on 128 x 64 tiles, each with a second MMA in flight
    "single_overlap": Variant(1, True, 64, 8),  # one warpgroup on 64 x 64 tiles, a second MMA in flight
    # coop, a warpgroup's tile rows stored by TMA from a 64 x 128 bf16 staging tile of its own (16 KB), issued
    # asynchronously: its next tile's MMAs start while the store drains
    "coop_tma_store": Variant(2, False, 128, 4, True),
    # coop_tma_store with the scales' loads a step away from their use (PAIRED)
    "coop_tma_store_paired": Variant(2, False, 128, 4, True, True),
}
"""Variant name -> :class:`Variant`. A ring slot takes (64 * CONSUMERS + BLOCK_N) * 128 bytes (128-144 KB of shared
memory at these depths; TMA_STORE adds 16 KB a math warpgroup). With OVERLAP a warpgroup holds two products besides
its accumulator: at BLOCK_N 128 that is 192 of its registers, and ptxas spills; at 64, none do (compile checks).
Without TMA_STORE a warpgroup stores its bf16 tile from registers (masked ``gl.store``: two bytes a store); with it,
a tile whose 64 rows are all its expert's goes through shared memory and one TMA store (TMA clips the columns past N),
and a tile over an expert's end is stored from registers as without."""
DEFAULT_CHECKED_TRITONS = ("3.6", "3.9")
"""Triton releases under which GEMM2's default variant, ``coop_tma_store_paired``, passed the GPU property tests (its
outputs ``coop``'s: the same operations in the same order; 5-23% less time than ``coop`` on an H100: docs/PERF.md);
GEMM2's default is ``coop`` under the others."""
DEFAULT_VARIANT = "coop_tma_store_paired" if triton_minor() in DEFAULT_CHECKED_TRITONS else "coop"

SWIGLU_VARIANTS = {
    # OVERLAP never: two products of 128 columns would spill
    "coop": Variant(2, False, 128, 4),  # two warpgroups on 128 rows x 128 channels, each pass's slot 64 gate + 64 up
    "single": Variant(1, False, 128, 8),  # one warpgroup on 64 rows x 128 channels, a deeper ring
    # coop with the warpgroups' MMAs issued in turn (ORDERED): while one promotes, the other's MMA runs
    "coop_ordered": Variant(2, False, 128, 4, ordered=True),
}
"""GEMM1's variants (:func:`gluon_fp8_swiglu_grouped_gemm`), as :data:`VARIANTS`: a tile is 128 output channels, one
scale block, in two passes of 64 (a warpgroup holds one pass's 64 x 128 sums and product, and the first pass's
64 x 64 SwiGLU values through the second); a slot takes (64 * CONSUMERS + 128) * 128 bytes (128 KB for coop,
192 KB for single)."""
SWIGLU_DEFAULT_CHECKED_TRITONS = ("3.6", )
"""Triton releases under which GEMM1's default variant, ``coop_ordered``, passed the GPU property tests (its outputs
``coop``'s: the same operations, the MMAs issued in another order; 3% less time than ``coop`` on an H100:
docs/PERF.md); GEMM1's default is ``coop`` under the others."""
DEFAULT_SWIGLU_VARIANT = "coop_ordered" if triton_minor() in SWIGLU_DEFAULT_CHECKED_TRITONS else "coop"


def variant_spec(variant: str, swiglu: bool) -> Variant:
    """The :class:`Variant` named ``variant``: of :data:`SWIGLU_VARIANTS` (GEMM1's form) with ``swiglu``, else of
    :data:`VARIANTS`."""
    return (SWIGLU_VARIANTS if swiglu else VARIANTS)[variant]


# TMA's global -> shared copy: Triton 3.6 ``async_copy_global_to_shared``, 3.9 ``async_load`` (the same arguments:
# descriptor, coordinates, mbarrier, destination)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# and shared -> global: 3.6 ``async_copy_shared_to_global``, 3.9 ``async_store`` (descriptor, coordinates, source)
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


def tma_storable(out: torch.Tensor) -> bool:
    """Whether a TMA_STORE variant's kernel can store into ``out`` (bf16 ``[M, N]``, contiguous) by TMA: a 16-byte
    aligned base and 16-byte row strides (N a multiple of 8). Elsewhere :func:`launch` runs the variant with the
    register store, which writes the same values."""
    return out.data_ptr() % 16 == 0 and out.stride(0) * out.element_size() % 16 == 0


def out_tile_layout(block_n: int):
    """The NVMMA shared layout of a math warpgroup's bf16 staging tile ``[64, block_n]`` (TMA_STORE)."""
    return gl.NVMMASharedLayout.get_default_for([WG_ROWS, block_n], gl.bfloat16)


def shared_layouts(block_m: int, block_n: int) -> dict:
    """The NVMMA shared layouts of the x and w ring slots (also the compile check's descriptor types)."""
    return {"x": gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], gl.float8e4nv),
            "w": gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K], gl.float8e4nv)}


@gluon.jit
def _expert_rows(offs_ptr, g, M):
    """Expert g's rows [start, end): its offsets clamped to [0, M] and made nondecreasing."""
    start = gl.minimum(gl.maximum(gl.load(offs_ptr + g), 0), M)
    end = gl.maximum(gl.minimum(gl.load(offs_ptr + g + 1), M), start)
    return start, end


@gluon.jit
def _first_tile(first, pid, P):
    """This program's first tile at or after ``first`` in the persistent order (tiles p, p + P, ...)."""
    return first + ((pid - first) % P + P) % P


@gluon.jit
def _k_steps(K, BK: gl.constexpr, OVERLAP: gl.constexpr):
    """K steps a tile takes: one per 128-wide K block, with OVERLAP rounded up to whole groups of 2 * PAIRS (the
    blocks past K are TMA's zero fill, their scales read as 0)."""
    steps = gl.cdiv(K, BK)
    if OVERLAP:
        steps = gl.cdiv(steps, 2 * PAIRS) * (2 * PAIRS)
    return steps


@gluon.jit
def _producer(x_desc, w_desc, offs_ptr, x_ring, w_ring, ready, empty, M, N, K, G, N_TILES,
              STAGES: gl.constexpr, OVERLAP: gl.constexpr, SWIGLU: gl.constexpr):
    """1 warp: for every tile of this program (and with SWIGLU each of its two passes), fill ring slot i % STAGES with
    K step i's x and w tiles once every consumer freed it (:func:`_k_steps` of them a pass). SWIGLU: w is
    ``[G * 2N, K]`` (gate rows, then up rows), and a slot's w tile is the pass's gate rows over its up rows."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_ring.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    HALF: gl.constexpr = BN // 2
    nbytes: gl.constexpr = x_desc.block_type.nbytes + BN * BK  # e4m3: a byte an element
    PASSES: gl.constexpr = 2 if SWIGLU else 1
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    k_steps = _k_steps(K, BK, OVERLAP)
    i = 0
    first = 0
    for g in range(G):
        start, end = _expert_rows(offs_ptr, g, M)
        m_tiles = gl.cdiv(end - start, BM)
        last = first + m_tiles * N_TILES
        for t in range(_first_tile(first, pid, P), last, P):
            local = t - first
            row0 = start + (local % m_tiles) * BM
            n0 = (local // m_tiles) * BN
            for p in gl.static_range(PASSES):
                for ks in range(k_steps):
                    slot = i % STAGES
                    # a fresh barrier counts as having completed the phase before phase 0: the first pass does not
                    # wait
                    mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
                    bar = ready.index(slot)
                    mbarrier.expect(bar, nbytes)
                    _tma_load(x_desc, [row0, ks * BK], bar, x_ring.index(slot))
                    if SWIGLU:
                        gate = g * 2 * N + n0 + p * HALF  # row of the [G * 2N, K] weight view
                        _tma_load(w_desc, [gate, ks * BK], bar, w_ring.index(slot).slice(0, HALF, dim=0))
                        _tma_load(w_desc, [gate + N, ks * BK], bar, w_ring.index(slot).slice(HALF, HALF, dim=0))
                    else:
                        _tma_load(w_desc, [g * N + n0, ks * BK], bar, w_ring.index(slot))
                    i += 1
        first = last


@gluon.jit
def _block_scale_loads(xs_ptr, ws_ptr, rows, rmask, srow, up_srow, ks, KB, SWIGLU: gl.constexpr):
    """K block ks's scales as loaded: ``(xs, ws, ws_up)``, x's per accumulator row and w's of the tile's weight rows
    (and with SWIGLU of its up rows, scale row ``up_srow``); 0 for a K block past the last one (the zero blocks that
    pad OVERLAP's groups). :func:`_loaded_factors` multiplies them."""
    ok = ks < KB
    xs = gl.load(xs_ptr + rows * KB + ks, mask=rmask & ok, other=0.0)
    ws = gl.load(ws_ptr + srow * KB + ks, mask=ok, other=0.0)
    ws_up = ws
    if SWIGLU:
        ws_up = gl.load(ws_ptr + up_srow * KB + ks, mask=ok, other=0.0)
    return xs, ws, ws_up


@gluon.jit
def _loaded_factors(xs, ws, ws_up, SWIGLU: gl.constexpr):
    """The fp32 factors of a K block per accumulator row from :func:`_block_scale_loads`' values: x's scale of the
    row times w's (and with SWIGLU, times up's: ``(s, s_up)``)."""
    s = xs * ws
    s_up = s
    if SWIGLU:
        s_up = xs * ws_up
    return s, s_up


@gluon.jit
def _block_scales(xs_ptr, ws_ptr, rows, rmask, srow, up_srow, ks, KB, SWIGLU: gl.constexpr):
    """K block ks's factors (:func:`_loaded_factors`), multiplied where they are loaded."""
    xs, ws, ws_up = _block_scale_loads(xs_ptr, ws_ptr, rows, rmask, srow, up_srow, ks, KB, SWIGLU)
    return _loaded_factors(xs, ws, ws_up, SWIGLU)


@gluon.jit
def _paired_step(xs_ptr, ws_ptr, x_ring, w_ring, ready, empty, rows, rmask, srow, up_srow, KB, i, ks, da, acc, xs, ws,
                 ws_up, up_cols, WG: gl.constexpr, STAGES: gl.constexpr, SWIGLU: gl.constexpr):
    """PAIRED: K step ks (ring position i) whose scales were loaded in the step before (``xs``, ``ws``, ``ws_up``):
    issue its MMA, load step ks + 1's scales, wait, free the slot, promote. ``(acc, da, step ks + 1's loads)``."""
    pa = _mma_step(x_ring, w_ring, ready, i, da, WG, STAGES)
    nx, nw, nw_up = _block_scale_loads(xs_ptr, ws_ptr, rows, rmask, srow, up_srow, ks + 1, KB, SWIGLU)
    da = warpgroup_mma_wait(num_outstanding=0, deps=(pa, ))
    mbarrier.arrive(empty.index(i % STAGES), count=1)
    s, s_up = _loaded_factors(xs, ws, ws_up, SWIGLU)
    return acc + _scaled(da, s, s_up, up_cols, SWIGLU), da, nx, nw, nw_up


@gluon.jit
def _scaled(d, s, s_up, up_cols, SWIGLU: gl.constexpr):
    """A K block's product times its factors (:func:`_block_scales`): with SWIGLU, up's columns (``up_cols``) take
    up's, as the tl kernel selects them per column."""
    if SWIGLU:
        out = d * gl.where(up_cols[None, :], s_up[:, None], s[:, None])
    else:
        out = d * s[:, None]
    return out


@gluon.jit
def _mma_step(x_ring, w_ring, ready, i, spare, WG: gl.constexpr, STAGES: gl.constexpr):
    """Wait for ring slot i % STAGES and issue this warpgroup's MMA of it (its 64 x rows times the w tile^T),
    asynchronously, its product summed on its own (``use_acc=False``) into the registers of ``spare`` (a product
    already promoted: reusing its registers keeps a dead buffer from being copied or a zero tile from staying live).
    ``ready``: the slots' barriers, and with ORDERED two more after them, the warpgroups' turns (count 1 each):
    warpgroup 0 issues ring position i's MMA once warpgroup 1 has issued i - 1's, and warpgroup 1 once warpgroup 0
    has issued i's, so that the tensor core takes one warpgroup's MMA after the other's, and one warpgroup's
    promotion runs beside the other's MMA (both issued together, the two would share the tensor core, end together
    and leave it idle while both promote). A turn barrier is never more than one phase ahead of its waiter."""
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    a = x_ring.index(slot).slice(WG * spare.shape[0], spare.shape[0], dim=0)
    b = w_ring.index(slot).permute((1, 0))
    if ready.shape[0] > STAGES:  # ORDERED
        # (a fresh barrier counts as having completed the phase before phase 0: warpgroup 0's first wait passes)
        mbarrier.wait(ready.index(STAGES + WG), (i & 1) ^ (1 - WG))
        product = warpgroup_mma(a, b, spare, use_acc=False, is_async=True)
        mbarrier.arrive(ready.index(STAGES + 1 - WG), count=1)
    else:
        product = warpgroup_mma(a, b, spare, use_acc=False, is_async=True)
    return product


@gluon.jit
def _promoted_sums(xs_ptr, ws_ptr, x_ring, w_ring, ready, empty, rows, rmask, srow, up_srow, KB, KB_STEPS, i, da, db,
                   up_cols, WG: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr, SWIGLU: gl.constexpr,
                   PAIRED: gl.constexpr):
    """One pass over K of this warpgroup's rows of a tile, every block's product promoted: ``(acc, da, db, i)``, the
    fp32 sums, the product buffers (carried on, so that every MMA writes into registers of a promoted product) and
    the ring position after the pass."""
    if OVERLAP:
        # two products a and b alternate over the K blocks, each promoted while the other's MMA runs (wait(1):
        # every MMA but the one issued last is done); a group of 2 * PAIRS blocks per iteration ends with nothing in
        # flight, so that no in-flight product is carried over the loop's back edge
        acc = gl.zeros_like(da)
        for k0 in range(0, KB_STEPS, 2 * PAIRS):
            pa = _mma_step(x_ring, w_ring, ready, i, da, WG, STAGES)
            sa, sa_up = _block_scales(xs_ptr, ws_ptr, rows, rmask, srow, up_srow, k0, KB, SWIGLU)
            for u in gl.static_range(PAIRS):
                pb = _mma_step(x_ring, w_ring, ready, i + 1, db, WG, STAGES)
                sb, sb_up = _block_scales(xs_ptr, ws_ptr, rows, rmask, srow, up_srow, k0 + 2 * u + 1, KB, SWIGLU)
                da = warpgroup_mma_wait(num_outstanding=1, deps=(pa, ))
                mbarrier.arrive(empty.index(i % STAGES), count=1)
                acc = acc + _scaled(da, sa, sa_up, up_cols, SWIGLU)
                if u + 1 < PAIRS:
                    pa = _mma_step(x_ring, w_ring, ready, i + 2, da, WG, STAGES)
                    sa, sa_up = _block_scales(xs_ptr, ws_ptr, rows, rmask, srow, up_srow, k0 + 2 * u + 2, KB,
                                              SWIGLU)
                    db = warpgroup_mma_wait(num_outstanding=1, deps=(pb, ))
                else:
                    db = warpgroup_mma_wait(num_outstanding=0, deps=(pb, ))
                mbarrier.arrive(empty.index((i + 1) % STAGES), count=1)
                acc = acc + _scaled(db, sb, sb_up, up_cols, SWIGLU)
                i += 2
    elif PAIRED:
        # the K steps in pairs, a step's scales loaded in the step before (while its MMA runs) and multiplied in the
        # step that uses them, two sets of registers taking turns: where one step loads and multiplies (below), the
        # compiler puts the product before that step's MMA wait, and it waits for the loads (an L2 round trip under
        # the ring's TMA traffic); a set carried from step to step would be copied there, with the same wait
        i0 = i
        xb, wb, wb_up = _block_scale_loads(xs_ptr, ws_ptr, rows, rmask, srow, up_srow, 0, KB, SWIGLU)
        acc = gl.full_like(da, -0.0)  # -0.0 + v is v for every v (+0.0 too): the first product enters as coop's does
        for k0 in range(0, KB_STEPS - 1, 2):
            acc, da, xa, wa, wa_up = _paired_step(xs_ptr, ws_ptr, x_ring, w_ring, ready, empty, rows, rmask, srow,
                                                  up_srow, KB, i0 + k0, k0, da, acc, xb, wb, wb_up, up_cols, WG,
                                                  STAGES, SWIGLU)
            acc, da, xb, wb, wb_up = _paired_step(xs_ptr, ws_ptr, x_ring, w_ring, ready, empty, rows, rmask, srow,
                                                  up_srow, KB, i0 + k0 + 1, k0 + 1, da, acc, xa, wa, wa_up, up_cols,
                                                  WG, STAGES, SWIGLU)
        if KB_STEPS % 2 == 1:
            acc, da, xa, wa, wa_up = _paired_step(xs_ptr, ws_ptr, x_ring, w_ring, ready, empty, rows, rmask, srow,
                                                  up_srow, KB, i0 + KB_STEPS - 1, KB_STEPS - 1, da, acc, xb, wb,
                                                  wb_up, up_cols, WG, STAGES, SWIGLU)
        i = i0 + KB_STEPS
    else:
        # each step's scales are loaded a step ahead: their latency hides behind the MMA of the step before
        s, s_up = _block_scales(xs_ptr, ws_ptr, rows, rmask, srow, up_srow, 0, KB, SWIGLU)
        pa = _mma_step(x_ring, w_ring, ready, i, da, WG, STAGES)
        s_next, s_next_up = _block_scales(xs_ptr, ws_ptr, rows, rmask, srow, up_srow, 1, KB, SWIGLU)
        da = warpgroup_mma_wait(num_outstanding=0, deps=(pa, ))
        mbarrier.arrive(empty.index(i % STAGES), count=1)
        acc = _scaled(da, s, s_up, up_cols, SWIGLU)
        i += 1
        for ks in range(1, KB_STEPS):
            s = s_next
            s_up = s_next_up
            pa = _mma_step(x_ring, w_ring, ready, i, da, WG, STAGES)
            s_next, s_next_up = _block_scales(xs_ptr, ws_ptr, rows, rmask, srow, up_srow, ks + 1, KB, SWIGLU)
            da = warpgroup_mma_wait(num_outstanding=0, deps=(pa, ))
            mbarrier.arrive(empty.index(i % STAGES), count=1)
            acc = acc + _scaled(da, s, s_up, up_cols, SWIGLU)
            i += 1
    return acc, da, db, i


@gluon.jit
def _consumer(xs_ptr, ws_ptr, rs_ptr, out_ptr, os_ptr, offs_ptr, x_ring, w_ring, ready, empty, M, N, K, G, N_TILES,
              o_desc, o_tile, WG: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
              HAS_RS: gl.constexpr, SWIGLU: gl.constexpr, TMA_STORE: gl.constexpr, PAIRED: gl.constexpr):
    """Math warpgroup WG: rows WG * 64 .. WG * 64 + 63 of each of this program's tiles, promoted per K block, then
    (times the row's routing weight with HAS_RS) stored as bf16 where the row is its expert's and the column < N; with
    SWIGLU, two passes of 64 channels each, their SwiGLU values stored as FP8 (``gluon_fp8_swiglu``)."""
    BN: gl.constexpr = w_ring.shape[1]
    BK: gl.constexpr = w_ring.shape[2]
    BM: gl.constexpr = _WG_ROWS * CONSUMERS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, BN, 32])
    half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN // 2, 32])
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    KB = gl.cdiv(K, BK)
    n_blocks = gl.cdiv(N, 128)
    KB_STEPS = _k_steps(K, BK, OVERLAP)
    r_off = WG * _WG_ROWS + gl.arange(0, _WG_ROWS, layout=gl.SliceLayout(1, acc_layout))
    c_off = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    up_cols = c_off >= BN // 2  # SWIGLU: the slot's second half of rows, up's
    # product buffers carried from tile to tile, so that every MMA writes into registers of a promoted product
    da = gl.zeros([_WG_ROWS, BN], gl.float32, acc_layout)
    db = gl.zeros([_WG_ROWS, BN], gl.float32, acc_layout)
    i = 0
    first = 0
    for g in range(G):
        start, end = _expert_rows(offs_ptr, g, M)
        m_tiles = gl.cdiv(end - start, BM)
        last = first + m_tiles * N_TILES
        for t in range(_first_tile(first, pid, P), last, P):
            local = t - first
            row0 = start + (local % m_tiles) * BM + WG * _WG_ROWS
            rows = start + (local % m_tiles) * BM + r_off
            n0 = (local // m_tiles) * BN
            rmask = rows < end
            if SWIGLU:
                # gate's row blocks, then up's (Fp8Tensor.gate_up); the tile's 128 channels are one block of each
                srow = g.to(gl.int64) * (2 * n_blocks) + n0 // 128
                acc, da, db, i = _promoted_sums(xs_ptr, ws_ptr, x_ring, w_ring, ready, empty, rows, rmask, srow,
                                                srow + n_blocks, KB, KB_STEPS, i, da, db, up_cols, WG, STAGES,
                                                OVERLAP, SWIGLU, PAIRED)
                h0 = swiglu_pass(acc, n0, N, half_layout)
                acc, da, db, i = _promoted_sums(xs_ptr, ws_ptr, x_ring, w_ring, ready, empty, rows, rmask, srow,
                                                srow + n_blocks, KB, KB_STEPS, i, da, db, up_cols, WG, STAGES,
                                                OVERLAP, SWIGLU, PAIRED)
                h1 = swiglu_pass(acc, n0 + BN // 2, N, half_layout)
                store_fp8_block(h0, h1, out_ptr, os_ptr, row0, end, n0, N)
            else:
                srow = g.to(gl.int64) * n_blocks + n0 // 128  # the tile's weight rows are one scale block
                acc, da, db, i = _promoted_sums(xs_ptr, ws_ptr, x_ring, w_ring, ready, empty, rows, rmask, srow,
                                                srow, KB, KB_STEPS, i, da, db, up_cols, WG, STAGES, OVERLAP, SWIGLU,
                                                PAIRED)
                if HAS_RS:
                    acc = acc * gl.load(rs_ptr + rows, mask=rmask, other=0.0)[:, None]
                cols = n0 + c_off
                ptrs = out_ptr + rows[:, None].to(gl.int64) * N + cols[None, :]
                if TMA_STORE:
                    if row0 + _WG_ROWS <= end:
                        # the previous tile's store has read the staging tile (the wait also syncs the warpgroup)
                        tma.store_wait(0)
                        o_tile.store(acc.to(out_ptr.dtype.element_ty))
                        fence_async_shared()
                        _tma_store(o_desc, [row0, n0], o_tile)
                    else:
                        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (cols[None, :] < N))
                else:
                    gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (cols[None, :] < N))
        first = last
    if TMA_STORE:
        tma.store_wait(0)  # the staging tile stays live until its last store has read it


@gluon.jit
def _gluon_fp8_kernel(x_desc, w_desc, xs_ptr, ws_ptr, rs_ptr, out_ptr, os_ptr, offs_ptr, M, N, K, G, N_TILES, o_desc,
                      CONSUMERS: gl.constexpr, OVERLAP: gl.constexpr, STAGES: gl.constexpr, HAS_RS: gl.constexpr,
                      SWIGLU: gl.constexpr, TMA_STORE: gl.constexpr, PAIRED: gl.constexpr, ORDERED: gl.constexpr):
    """Persistent program p: tiles p, p + P, ... of the expert-major tile order (module docstring). N: the output's
    columns (GEMM1: I, of w's 2I rows per expert). ``o_desc``: with TMA_STORE a descriptor over out ``[M, N]`` of
    ``[64, BLOCK_N]`` boxes, else out again (unread)."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    # GEMM1: a slot's w tile is the gate and up boxes stacked
    BN: gl.constexpr = w_desc.block_type.shape[0] * (2 if SWIGLU else 1)
    gl.static_assert(BM == _WG_ROWS * CONSUMERS, "a math warpgroup per 64 tile rows")
    gl.static_assert(128 % BN == 0, "the tile's weight rows lie in one 128-row scale block")
    gl.static_assert(not SWIGLU or (BN == 128 and not OVERLAP and not HAS_RS),
                     "GEMM1: one 128-channel scale block a tile, one product in flight, no routing weight")
    gl.static_assert(not (SWIGLU and TMA_STORE), "TMA_STORE: GEMM2's form")
    gl.static_assert(not ORDERED or CONSUMERS == 2, "ORDERED: two math warpgroups take turns")
    TURNS: gl.constexpr = 2 if ORDERED else 0  # ORDERED: the warpgroups' turn barriers, after the slots' ready ones
    x_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], x_desc.layout)
    w_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES + TURNS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if TMA_STORE:  # a staging tile a math warpgroup
        o_tiles = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS, _WG_ROWS, BN], o_desc.layout)
    else:  # unread: the partitions take an argument either way
        o_tiles = ready
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=CONSUMERS)  # each math warpgroup frees the slot once
    for j in gl.static_range(TURNS):
        mbarrier.init(ready.index(STAGES + j), count=1)  # warpgroup 1 - j arrives once a ring position
    fence_async_shared()
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (xs_ptr, ws_ptr, rs_ptr, out_ptr, os_ptr, offs_ptr, x_ring, w_ring, ready, empty, M, N, K, G,
                         N_TILES, o_desc, o_tiles.index(0), 0, CONSUMERS, STAGES, OVERLAP, HAS_RS, SWIGLU,
                         TMA_STORE, PAIRED)),
            (_consumer, (xs_ptr, ws_ptr, rs_ptr, out_ptr, os_ptr, offs_ptr, x_ring, w_ring, ready, empty, M, N, K, G,
                         N_TILES, o_desc, o_tiles.index(1), 1, CONSUMERS, STAGES, OVERLAP, HAS_RS, SWIGLU,
                         TMA_STORE, PAIRED)),
            (_producer, (x_desc, w_desc, offs_ptr, x_ring, w_ring, ready, empty, M, N, K, G, N_TILES, STAGES,
                         OVERLAP, SWIGLU)),
        ], [4, 1], [232, 24])
    else:
        gl.warp_specialize([
            (_consumer, (xs_ptr, ws_ptr, rs_ptr, out_ptr, os_ptr, offs_ptr, x_ring, w_ring, ready, empty, M, N, K, G,
                         N_TILES, o_desc, o_tiles.index(0), 0, CONSUMERS, STAGES, OVERLAP, HAS_RS, SWIGLU,
                         TMA_STORE, PAIRED)),
            (_producer, (x_desc, w_desc, offs_ptr, x_ring, w_ring, ready, empty, M, N, K, G, N_TILES, STAGES,
                         OVERLAP, SWIGLU)),
        ], [1], [24])
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(j))
        mbarrier.invalidate(empty.index(j))
    for j in gl.static_range(TURNS):
        mbarrier.invalidate(ready.index(STAGES + j))


def unavailable_reason() -> str | None:
    """Why :func:`gluon_fp8_grouped_gemm` (and :func:`gluon_fp8_swiglu_grouped_gemm`) cannot run here, or None where
    it can: it needs an sm_90 GPU (:func:`device_facts.sm90_unavailable_reason`)."""
    return device_facts.sm90_unavailable_reason()


def available() -> bool:
    """Whether :func:`gluon_fp8_grouped_gemm` can run here (an sm_90 GPU, no interpreter)."""
    return unavailable_reason() is None


CHECKED_TRITONS = ("3.6", "3.9")
"""Triton releases under which both forms of these kernels passed the GPU property tests (``tests/test_gluon_fp8.py``
on sm_90): the grouped-GEMM dispatcher takes this path under these only (:func:`dispatchable`); the entry points below
run under any."""


def dispatchable() -> bool:
    """Whether the grouped-GEMM dispatcher may take this path here: :func:`available`, under a Triton of
    :data:`CHECKED_TRITONS`."""
    return available() and _checked_triton()


def not_dispatchable_reason() -> str | None:
    """Why :func:`dispatchable` says False here (``moe-ep info`` shows it), or None."""
    reason = unavailable_reason()
    if reason is None and not _checked_triton():
        reason = f"Triton {triton.__version__}: both kernels were verified under {' / '.join(CHECKED_TRITONS)} only"
    return reason


def _checked_triton() -> bool:
    return triton_minor() in CHECKED_TRITONS


def _check_weights(w: Fp8Tensor, shape: str) -> tuple[int, int, int]:
    """w's own checks, both forms: an Fp8Tensor ``[G, R, K]`` of 128x128 blocks, G and R positive, G at most
    :data:`MAX_EXPERTS`, K a positive multiple of 16; its shape."""
    check(isinstance(w, Fp8Tensor), "type(w)", type(w).__name__, f"an Fp8Tensor {shape} (block_rows 128)")
    w.check("w")
    check(w.data.dim() == 3, "w.shape", tuple(w.shape), f"{shape} (3-D)")
    check(w.block_rows == 128, "w.block_rows", w.block_rows, "128 (one scale per 128x128 weight block)")
    G, R, K = w.shape
    check(G > 0 and R > 0, "w.shape", tuple(w.shape), "G > 0 and N > 0")
    check(G <= MAX_EXPERTS, "w.shape[0] (G)", G, f"<= {MAX_EXPERTS}")
    check(K % K_MULTIPLE == 0 and K > 0, "w.shape[2] (K)", K,
          f"a positive multiple of {K_MULTIPLE} (TMA: the e4m3 rows must be 16-byte multiples)")
    return G, R, K


def _check_rows(x: Fp8Tensor, w: Fp8Tensor, offsets: torch.Tensor, variants: dict, variant: str,
                num_programs: int | None) -> None:
    """The checks both forms share past w's own: x against w, the offsets, the variant, the grid (no device is
    touched)."""
    G, _, K = w.shape
    check(isinstance(x, Fp8Tensor), "type(x)", type(x).__name__, "an Fp8Tensor [M, K] (block_rows 1)")
    x.check("x")
    check(x.block_rows == 1 and not x.gate_up, "x.block_rows", x.block_rows, "1 (one scale per row per 128 columns)")
    check(x.data.dim() == 2 and x.shape[1] == K, "x.shape", tuple(x.shape), f"[M, {K}] (K of w)")
    check(x.shape[0] < 2**31, "x.shape[0] (M)", x.shape[0], "< 2^31")
    check(isinstance(offsets, torch.Tensor) and offsets.dtype == torch.int32, "offsets.dtype",
          getattr(offsets, "dtype", type(offsets).__name__), "torch.int32")
    check(tuple(offsets.shape) == (G + 1, ), "offsets.shape", tuple(offsets.shape), f"({G + 1},) (G + 1)")
    check(variant in variants, "variant", variant, " / ".join(variants))
    check(num_programs is None or (isinstance(num_programs, int) and num_programs > 0), "num_programs", num_programs,
          "None or a positive int")


def _check_devices(x: Fp8Tensor, w: Fp8Tensor, offsets: torch.Tensor) -> None:
    """The device checks, which come last (so that the others run on CPU tensors)."""
    check(x.device.type == "cuda" and w.device == x.device, "x.device", str(x.device),
          f"a CUDA device, the weights' ({w.device})")
    check(offsets.device == x.device, "offsets.device", str(offsets.device), str(x.device))


def check_gluon_fp8(x: Fp8Tensor, w: Fp8Tensor, offsets: torch.Tensor, row_scale: torch.Tensor | None = None,
                    variant: str = DEFAULT_VARIANT, num_programs: int | None = None) -> None:
    """Raise :class:`MoEEpInputError` unless the arguments are what :func:`gluon_fp8_grouped_gemm` takes (no device
    is touched; the device checks come last)."""
    _check_weights(w, "[G, N, K]")
    check(not w.gate_up, "w.gate_up", w.gate_up, "False (GEMM2's form: no SwiGLU)")
    _check_rows(x, w, offsets, VARIANTS, variant, num_programs)
    if row_scale is not None:
        check(isinstance(row_scale, torch.Tensor) and row_scale.dtype == torch.float32, "row_scale.dtype",
              getattr(row_scale, "dtype", type(row_scale).__name__), "torch.float32")
        check(tuple(row_scale.shape) == (x.shape[0], ), "row_scale.shape", tuple(row_scale.shape),
              f"({x.shape[0]},) (one weight per row of x)")
    _check_devices(x, w, offsets)
    if row_scale is not None:
        check(row_scale.device == x.device, "row_scale.device", str(row_scale.device), str(x.device))


def check_gluon_fp8_swiglu(x: Fp8Tensor, w13: Fp8Tensor, offsets: torch.Tensor, out: Fp8Tensor | None = None,
                           variant: str = DEFAULT_SWIGLU_VARIANT, num_programs: int | None = None) -> None:
    """Raise :class:`MoEEpInputError` unless the arguments are what :func:`gluon_fp8_swiglu_grouped_gemm` takes (no
    device is touched; the device checks come last)."""
    G, R, K = _check_weights(w13, "[G, 2I, K]")
    check(R % 2 == 0, "w.shape[1] (2I)", R, "even (gate rows, then up rows)")
    want = fp8_scales_shape(w13.shape, FP8_BLOCK, gate_up=True)
    check(tuple(w13.scales.shape) == want, "w.scales.shape", tuple(w13.scales.shape),
          f"{want}: gate's row blocks then up's (an Fp8Tensor with gate_up=True)")
    _check_rows(x, w13, offsets, SWIGLU_VARIANTS, variant, num_programs)
    if out is not None:
        shape = (x.shape[0], R // 2)
        check(isinstance(out, Fp8Tensor) and out.block_rows == 1 and tuple(out.shape) == shape
              and out.data.is_contiguous() and out.scales.is_contiguous() and out.device == x.device, "out",
              f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}",
              f"None or an Fp8Tensor {shape} (block_rows 1) of contiguous parts on {x.device}")
    _check_devices(x, w13, offsets)


def _constexprs(spec: Variant, swiglu: bool, has_rs: bool, tma_store: bool) -> dict:
    """:func:`_gluon_fp8_kernel`'s constexpr arguments, in its order, for variant ``spec`` of the form ``swiglu``:
    TMA_STORE as the launch takes it (the variant's, or off where ``out`` does not allow it)."""
    return dict(CONSUMERS=spec.consumers, OVERLAP=spec.overlap, STAGES=spec.stages, HAS_RS=has_rs and not swiglu,
                SWIGLU=swiglu, TMA_STORE=tma_store, PAIRED=spec.paired, ORDERED=spec.ordered)


def launch(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offsets: torch.Tensor,
           out: torch.Tensor, out_scales: torch.Tensor, row_scale: torch.Tensor | None, variant: str, *, swiglu: bool,
           num_programs: int) -> None:
    """Launch the kernel on checked parts (at least one row; the grouped-GEMM launcher's ``gluon-fp8`` path and the two
    entry points below): x codes ``xq [M, K]`` e4m3 and scales ``xs``, w codes ``wq [G, R, K]`` and scales ``ws``,
    int32 ``offsets [G + 1]``, ``out`` (bf16 ``[M, N]``, or with ``swiglu`` e4m3 ``[M, R / 2]`` and its scales
    ``out_scales``), ``variant`` of :data:`VARIANTS` (with ``swiglu``, :data:`SWIGLU_VARIANTS`; a TMA_STORE variant
    whose ``out`` is not :func:`tma_storable` stores from registers), the persistent grid ``num_programs``.
    Descriptors over x ``[M, K]`` and w ``[G * R, K]`` (GEMM1's w box is half a slot: the gate box and the up box fill
    one), with TMA_STORE over out ``[M, N]``."""
    spec = variant_spec(variant, swiglu)
    block_m, block_n = spec.block_m, spec.block_n
    G, R, K = wq.shape
    xq = xq.contiguous()
    if xq.data_ptr() % 16:  # TMA reads from a 16-byte aligned base (a row slice of a larger tensor may not be)
        xq = xq.clone()
    lay = shared_layouts(block_m, block_n)
    x_desc = TensorDescriptor.from_tensor(xq, [block_m, BLOCK_K], lay["x"])
    w_desc = TensorDescriptor.from_tensor(wq.contiguous().view(G * R, K), [block_n // 2 if swiglu else block_n,
                                                                          BLOCK_K], lay["w"])
    xs, ws = xs.contiguous(), ws.contiguous()
    rs = xs if row_scale is None else row_scale.contiguous()  # unread without HAS_RS
    n_out = R // 2 if swiglu else R
    n_tiles = -(-n_out // block_n)
    tma_store = spec.tma_store and tma_storable(out)
    o_desc = TensorDescriptor.from_tensor(out, [WG_ROWS, block_n], out_tile_layout(block_n)) if tma_store else out
    _gluon_fp8_kernel[(num_programs, )](x_desc, w_desc, xs, ws, rs, out, out_scales, offsets, xq.shape[0], n_out, K, G,
                                        n_tiles, o_desc, num_warps=4,
                                        **_constexprs(spec, swiglu, row_scale is not None, tma_store))


def _programs(x: Fp8Tensor, num_programs: int | None) -> int:
    return num_programs or torch.cuda.get_device_properties(x.device).multi_processor_count


def gluon_fp8_grouped_gemm(x: Fp8Tensor, w: Fp8Tensor, offsets: torch.Tensor, *,
                           row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           variant: str = DEFAULT_VARIANT, num_programs: int | None = None) -> torch.Tensor:
    """``y[offsets[g]:offsets[g+1]] = promoted FP8 product of x's rows with w[g]^T`` on sm_90a (H100 / H200).

    ``x``: :class:`Fp8Tensor` ``[M, K]`` (``block_rows`` 1: e4m3 codes, fp32 scales ``[M, ceil(K/128)]``), rows
    sorted by expert. ``w``: :class:`Fp8Tensor` ``[G, N, K]`` (``block_rows`` 128, not ``gate_up``); K a multiple of 16.
    ``offsets``: int32 ``[G + 1]`` on x's device, nondecreasing in ``[0, M]`` (clamped to it on the device; no host
    sync). ``row_scale``: optional fp32 ``[M]``, each output row's factor (the routing weight of its slot).
    Returns bf16 ``[M, N]``: ``out`` (contiguous bf16 of that shape on x's device) or a new ``torch.empty``; rows
    outside every expert are not written, as with the tl kernel. ``variant``: one of :data:`VARIANTS`.
    ``num_programs``: the persistent grid (default: the SM count). Bad arguments raise :class:`MoEEpInputError`; a
    machine without an sm_90 GPU raises :class:`MoEEpConfigError`.
    """
    check_gluon_fp8(x, w, offsets, row_scale, variant, num_programs)
    reason = unavailable_reason()
    if reason is not None:
        raise MoEEpConfigError(f"gluon_fp8_grouped_gemm {reason}")
    M, N = x.shape[0], w.shape[1]
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    else:
        check(isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and tuple(out.shape) == (M, N)
              and out.is_contiguous() and out.device == x.device, "out",
              f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}",
              f"a contiguous torch.bfloat16 ({M}, {N}) on {x.device}")
    if M:
        launch(x.data, x.scales, w.data, w.scales, offsets, out, x.scales, row_scale, variant, swiglu=False,
               num_programs=_programs(x, num_programs))
    return out


def gluon_fp8_swiglu_grouped_gemm(x: Fp8Tensor, w13: Fp8Tensor, offsets: torch.Tensor, *, out: Fp8Tensor | None = None,
                                  variant: str = DEFAULT_SWIGLU_VARIANT,
                                  num_programs: int | None = None) -> Fp8Tensor:
    """GEMM1 of an FP8 expert MLP on sm_90a (H100 / H200): ``h = silu(x w_gate[g]^T) * (x w_up[g]^T)`` per expert,
    promoted in fp32 as :func:`gluon_fp8_grouped_gemm` is, quantized per row per 128 channels to the FP8 activations
    GEMM2 takes, as the tl GEMM1 (``grouped_gemm(..., swiglu=True, quantize_out=True)``) writes them
    (``reference.swiglu_fp8_ref`` of the fp32 values; ``gluon_fp8_swiglu``).

    ``x``: :class:`Fp8Tensor` ``[M, K]`` (``block_rows`` 1), rows sorted by expert. ``w13``: :class:`Fp8Tensor`
    ``[G, 2I, K]`` (``block_rows`` 128): gate rows, then up rows, scales gate's row blocks then up's
    (``[G, 2 * ceil(I/128), ceil(K/128)]``: ``gate_up``, or the plain layout where I % 128 == 0); K a multiple of 16.
    ``offsets``: int32 ``[G + 1]`` as for :func:`gluon_fp8_grouped_gemm`. Returns an :class:`Fp8Tensor` ``[M, I]``
    (``block_rows`` 1: e4m3 codes, fp32 scales ``[M, ceil(I/128)]``): ``out`` (contiguous parts on x's device) or a
    new one of ``torch.empty`` parts; rows outside every expert are not written. ``variant``: one of
    :data:`SWIGLU_VARIANTS`. ``num_programs``: the persistent grid (default: the SM count). Bad arguments raise
    :class:`MoEEpInputError`; a machine without an sm_90 GPU raises :class:`MoEEpConfigError`.
    """
    check_gluon_fp8_swiglu(x, w13, offsets, out, variant, num_programs)
    reason = unavailable_reason()
    if reason is not None:
        raise MoEEpConfigError(f"gluon_fp8_swiglu_grouped_gemm {reason}")
    M, I = x.shape[0], w13.shape[1] // 2
    if out is None:
        out = Fp8Tensor(torch.empty(M, I, dtype=torch.float8_e4m3fn, device=x.device),
                        torch.empty(fp8_scales_shape((M, I), 1), dtype=torch.float32, device=x.device), 1)
    if M:
        launch(x.data, x.scales, w13.data, w13.scales, offsets, out.data, out.scales, None, variant, swiglu=True,
               num_programs=_programs(x, num_programs))
    return out


def compile_signature(variant: str, has_rs: bool = True, swiglu: bool = False) -> tuple[dict, dict, dict]:
    """(signature, constexprs, compile options) of :func:`_gluon_fp8_kernel` for a variant (of :data:`VARIANTS`, or
    with ``swiglu`` of :data:`SWIGLU_VARIANTS`), as a launch builds it, for a GPU-less ``triton.compile`` (compile
    checks)."""
    spec = variant_spec(variant, swiglu)
    block_m, block_n = spec.block_m, spec.block_n
    consts = _constexprs(spec, swiglu, has_rs, spec.tma_store)
    lay = shared_layouts(block_m, block_n)
    out_type = "*fp8e4nv" if swiglu else "*bf16"
    sig = {"x_desc": f"tensordesc<fp8e4nv[{block_m}, {BLOCK_K}],{lay['x']!r}>",
           "w_desc": f"tensordesc<fp8e4nv[{block_n // 2 if swiglu else block_n}, {BLOCK_K}],{lay['w']!r}>",
           "xs_ptr": "*fp32", "ws_ptr": "*fp32", "rs_ptr": "*fp32", "out_ptr": out_type,
           "os_ptr": "*fp32", "offs_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "G": "i32", "N_TILES": "i32",
           "o_desc": (f"tensordesc<bf16[{WG_ROWS}, {block_n}],{out_tile_layout(block_n)!r}>" if spec.tma_store
                      else out_type),
           **{name: "constexpr" for name in consts}}
    return sig, consts, dict(num_warps=4)


__all__ = ["gluon_fp8_grouped_gemm", "gluon_fp8_swiglu_grouped_gemm", "check_gluon_fp8", "check_gluon_fp8_swiglu",
           "available", "dispatchable", "not_dispatchable_reason", "launch", "unavailable_reason", "VARIANTS",
           "SWIGLU_VARIANTS", "K_MULTIPLE"]
