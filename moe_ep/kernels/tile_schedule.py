"""Which output tile a grouped-GEMM program computes, from the device-side counts (masked layout) or offsets (ragged)
alone: no host sync and no schedule tensor, so a launch can be captured in a CUDA graph.

Each program loads the per-expert counts, takes ``cumsum(cdiv(count, BLOCK_M))`` (:func:`expert_row_tiles`) and finds
the expert of its row tile by counting how many prefix sums lie at or below it (:func:`tile_expert`); linear tile
numbers run GROUP_M row tiles per weight column tile (:func:`group_order`). A one-tile-per-program grid is sized on the
host by :func:`tile_slots`, the bound the kernel's :func:`row_tile_slots` repeats; surplus programs exit at once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_row_tiles(cnt_ptr, G, M_MAX, S, RAGGED: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per expert (vectors of BLOCK_G): its row tiles, their running end, its row count and its first row, from the
    device-side counts (masked) or offsets (ragged) alone, clamped to the rows that exist."""
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
    return tiles, tl.cumsum(tiles, 0), cnt, lo


@triton.jit
def tile_expert(t, tiles, ends, cnt, lo, BLOCK_G: tl.constexpr):
    """Row tile t (< sum(tiles)) -> (expert g, tile within the expert, the expert's rows, its first row):
    the expert is the number of prefix sums at or below t."""
    g = tl.sum((ends <= t).to(tl.int32))
    sel = tl.arange(0, BLOCK_G) == g
    tile = t - tl.sum(tl.where(sel, ends - tiles, 0))
    return g, tile, tl.sum(tl.where(sel, cnt, 0)), tl.sum(tl.where(sel, lo, 0)).to(tl.int64)


@triton.jit
def group_order(t, tiles_m, n_tiles, GROUP_M: tl.constexpr):
    """Linear tile t -> (row tile, column tile): GROUP_M row tiles share a weight column tile while it is in L2."""
    width = GROUP_M * n_tiles
    first = (t // width) * GROUP_M
    rows = tl.minimum(tiles_m - first, GROUP_M)
    return first + (t % width) % rows, (t % width) // rows


@triton.jit
def row_tile_slots(G, M_MAX, S, RAGGED: tl.constexpr, BLOCK_M: tl.constexpr):
    """Upper bound of the row tiles, device side: every expert full when masked, or S rows plus a ragged tail each
    (:func:`tile_slots` sizes the grid with the same bound)."""
    if RAGGED:
        bound = tl.cdiv(S, BLOCK_M) + G
    else:
        bound = G * tl.cdiv(M_MAX, BLOCK_M)
    return bound


def tile_slots(ragged: bool, G: int, M_max: int, S: int, N: int, block_m: int, block_n: int) -> int:
    """Programs of a one-tile-per-program grid: row tiles (every expert full when masked, or S rows plus a ragged
    tail each; :func:`row_tile_slots`) times column tiles."""
    rows = triton.cdiv(S, block_m) + G if ragged else G * triton.cdiv(M_max, block_m)
    return rows * triton.cdiv(N, block_n)
