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

from .. import host_math
from . import config_space


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def expert_row_tiles(cnt_ptr, G, M_MAX, S, RAGGED: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per expert (vectors of BLOCK_G): its row tiles, their running end, its row count and its first row, from the
    device-side counts (masked) or offsets (ragged) alone, clamped to the rows that exist.

    Whatever the values, no two experts share a row and none reaches past the rows that exist: counts are clamped to
    [0, M_MAX] and offsets to [0, S] in their own width (int64 values of 2^31 and more become "all rows", never a
    wrapped int32), and offsets are made nondecreasing by a running maximum, so expert g owns rows
    [max(offsets[:g+1]), max(offsets[:g+2])) (non-monotone offsets are outside the API; this only keeps them safe)."""
    gi = tl.arange(0, BLOCK_G)
    gmask = gi < G
    if RAGGED:
        lo = tl.minimum(tl.maximum(tl.load(cnt_ptr + gi, mask=gmask, other=0), 0), S).to(tl.int32)
        hi = tl.minimum(tl.maximum(tl.load(cnt_ptr + gi + 1, mask=gmask, other=0), 0), S).to(tl.int32)
        lo = tl.associative_scan(lo, 0, _max)
        hi = tl.maximum(tl.associative_scan(hi, 0, _max), lo)
        cnt = tl.where(gmask, hi - lo, 0)  # lanes past G own nothing
    else:
        cnt = tl.minimum(tl.maximum(tl.load(cnt_ptr + gi, mask=gmask, other=0), 0), M_MAX).to(tl.int32)
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
    rows = host_math.cdiv(S, block_m) + G if ragged else G * host_math.cdiv(M_max, block_m)
    return rows * host_math.cdiv(N, block_n)


def grid_size(meta: dict, ragged: bool, G: int, M_max: int, S: int, N: int, swiglu: bool) -> int:
    """Programs a launch of config ``meta`` takes: one per tile slot (:func:`tile_slots`), or for persistent grids as
    many as fit on the GPU at once (TMA configs) or PERSISTENT_ROUNDS times that (PERSISTENT pointer-load launches)."""
    bound = tile_slots(ragged, G, M_max, S, N, meta["BLOCK_M"], meta["BLOCK_N"])
    if meta.get("TMA"):
        bound = min(bound, config_space.resident_programs(meta, swiglu))
    elif meta.get("PERSISTENT"):
        bound = min(bound, config_space.persistent_programs(meta, swiglu))
    return bound


def persistent_grid(a: dict) -> bool:
    """Whether a masked-layout pointer-load launch walks its tiles with a persistent grid: when one program per tile
    slot of the whole row capacity would be more programs than the persistent grid. Most of those programs would find
    no rows and exit, and launching them costs more than walking (docs/PERF.md). ``a``: the kernel's arguments."""
    if a["RAGGED"] or a.get("TMA"):
        return False
    slots = tile_slots(False, a["G"], a["M_MAX"], a["S"], a["N"], a["BLOCK_M"], a["BLOCK_N"])
    return slots > config_space.persistent_programs(a, a["SWIGLU"])
