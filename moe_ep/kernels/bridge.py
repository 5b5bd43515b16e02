"""The layout bridge: from per-row expert picks to an expert-sorted (ragged) buffer and back.

Given ``topk_idx [M, K]`` of *local* expert ids (-1, or any id outside ``[0, L)``, = "not here"):

* :func:`route_experts` — per-expert ``counts [L]``, ``offsets [L+1]`` (exclusive scan) and a slot for every
  valid pick ``(row, k)``. Within an expert, slots follow ascending ``(row, k)``, fixed by construction, never
  by atomics: the flattened ids are cut into chunks; each chunk's histogram, an exclusive scan over experts
  then chunks gives every (chunk, expert) its first slot, and a chunk sorts its (expert, position) keys so
  the j-th pick of expert e in the chunk lands at that first slot + j. One launch when the ids fit one
  chunk (up to 4096 ids: decode), two otherwise (histograms, then placement, each placing program scanning the
  chunks' histograms itself), each parallel over chunks. With ``padded_rows`` the slots are expert-major padded
  ones instead (LL EXPERT_MAJOR's ``e * rows + j``); with ``weights`` each slot's routing weight is written too.
* :func:`permute_rows` — gather rows into the expert-sorted buffer ``[M*K, H]`` (or quantize them to NVFP4
  on the way, through ``gather_quantize_nvfp4``).
* :func:`scatter_rows` — the other direction for padded slots: each pick's row written to its slot.
* :func:`unpermute_reduce` — ``out[row] = sum_k w[row, k] * y[slot(row, k)]`` in fp32; rows without a
  local pick get zeros.

Everything stays on the device: buffers are sized to the static bound ``M*K`` and the number of valid
slots is ``offsets[L]``, a device scalar. Rows past the valid slots are left untouched (garbage).

Every public launcher checks that its arguments agree (shapes, dtypes, devices; no host sync) and raises
:class:`MoEEpInputError` naming the argument otherwise; the ``_``-prefixed entries (``_route``, ``_permute``,
``_scatter``, ``_unpermute``) launch the same kernels without the checks, for this package's callers whose tensors
were checked already (the layout contract, the routing checks). What only the device knows has a defined result
instead: int64 ids of 2^31 and more are "not here" (compared in int64, never narrowed onto another expert), and a slot
past the end of ``y`` in :func:`unpermute_reduce` makes its row NaN (never read out of bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral

import torch
import triton
import triton.language as tl

from ..errors import fail
from ..triton_runtime import INTERPRETER, check_on_kernel_device
from . import autotuning, host_math, launch_cache
from .fp8 import Fp8Tensor
from .nvfp4 import NvFp4Tensor, gather_quantize_nvfp4, nan_f32
from .row_parts import row_parts, with_row_parts

_ROUTE_CHUNK = 1024  # ids per program when a route takes several (a power of two)
_ROUTE_ONE_LAUNCH = 4096  # up to this many ids one program does it all: one launch for decode-sized routes


def _is_int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


@dataclass
class Route:
    """Where every pick of ``topk_idx [M, K]`` lands in the expert-sorted buffer (all int32, on one device).

    :func:`route_experts` makes one. A route built by hand may leave out (None) the parts its consumer does not
    read: :func:`unpermute_reduce` reads ``slot`` only, :func:`permute_rows` ``slot``, ``offsets`` and
    ``row_of_slot``, :func:`scatter_rows` ``slot``. The parts given are checked against each other
    (:class:`MoEEpInputError`).
    """

    counts: torch.Tensor | None       # [L] valid picks per local expert
    offsets: torch.Tensor | None      # [L+1] first slot of each expert; offsets[L] = number of valid slots
    slot: torch.Tensor | None         # [M, K] slot of (row, k), -1 when the pick is not here
    row_of_slot: torch.Tensor | None  # [M*K] source row of each slot, -1 past offsets[L]
    slot_weight: torch.Tensor | None = None  # float32 [slots]: each valid slot's routing weight
    # (route_experts(weights=))
    chain_ready: torch.Tensor | None = None  # int32 [L], zeroed by the route's launch: the expert MLP's chain
    # counters (expert_mlp(chain_ready=)), so no zero-fill op of their own; this package's routes alone have one

    def __post_init__(self):
        self.check()

    @classmethod
    def _made(cls, counts, offsets, slot, row_of_slot, slot_weight=None, chain_ready=None) -> Route:
        """A route of parts made by this module's own code (agreeing by construction): not checked again."""
        r = object.__new__(cls)
        r.counts, r.offsets, r.slot, r.row_of_slot, r.slot_weight = counts, offsets, slot, row_of_slot, slot_weight
        r.chain_ready = chain_ready
        return r

    def check(self) -> None:
        """Raise :class:`MoEEpInputError` unless the given parts are int32 tensors of agreeing shapes on one device."""
        dims = {"counts": 1, "offsets": 1, "slot": 2, "row_of_slot": 1, "chain_ready": 1}
        devs = []
        for name, nd in dims.items():
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                fail(f"type(route.{name})", type(t).__name__, "an int32 torch.Tensor or None")
            if t.dtype != torch.int32 or t.dim() != nd:
                fail(f"route.{name}", f"{t.dtype} {tuple(t.shape)}", f"torch.int32, {nd}-D")
            devs.append(t.device)
        sw = self.slot_weight
        if sw is not None:
            if not isinstance(sw, torch.Tensor) or sw.dtype != torch.float32 or sw.dim() != 1:
                fail("route.slot_weight",
                     f"{getattr(sw, 'dtype', type(sw).__name__)} {tuple(getattr(sw, 'shape', ()))}",
                     "torch.float32, 1-D, or None")
            devs.append(sw.device)
        if any(d != devs[0] for d in devs):
            fail("route devices", [str(d) for d in devs], "one device for all parts")
        c, o, sl, r = self.counts, self.offsets, self.slot, self.row_of_slot
        if c is not None and o is not None and o.shape[0] != c.shape[0] + 1:
            fail("route.offsets.shape", tuple(o.shape), f"({c.shape[0] + 1},) (counts + 1)")
        if c is not None and self.chain_ready is not None and self.chain_ready.shape != c.shape:
            fail("route.chain_ready.shape", tuple(self.chain_ready.shape), f"{tuple(c.shape)} (counts')")
        if sl is not None and r is not None and r.shape[0] != sl.numel():
            fail("route.row_of_slot.shape", tuple(r.shape), f"({sl.numel()},) (M * K of slot {tuple(sl.shape)})")

    def _need(self, *parts: str) -> None:
        for p in parts:
            if getattr(self, p) is None:
                fail(f"route.{p}", None, f"a tensor (this call reads {', '.join(parts)})")


def _check_route(route, *parts: str) -> None:
    if not isinstance(route, Route):
        fail("type(route)", type(route).__name__, "a Route (from route_experts)")
    route.check()
    route._need(*parts)


@triton.jit
def _load_ids(idx_ptr, valid_ptr, i, N, K, ROWS_PER_GROUP, L, HAS_VALID: tl.constexpr):
    """Local ids of flat picks i, -1 where out of range, not local, or on a row past its group's count."""
    raw = tl.load(idx_ptr + i, mask=i < N, other=-1)
    ok = (raw >= 0) & (raw < L)  # in the ids' own type: an int64 id of 2^31 or more is not narrowed first
    if HAS_VALID:
        row = i // K
        nvalid = tl.load(valid_ptr + row // ROWS_PER_GROUP, mask=i < N, other=0)  # int32 or int64: not narrowed
        ok = ok & ((row % ROWS_PER_GROUP) < nvalid)
    return tl.where(ok, raw.to(tl.int32), -1)


@triton.jit
def _chunk_bins(idx_ptr, valid_ptr, c, N, K, ROWS_PER_GROUP, L, HAS_VALID: tl.constexpr, CHUNK: tl.constexpr):
    """Flat pick indices of chunk c and their bins: the local expert id, or L for "not here" (and past N)."""
    i = c * CHUNK + tl.arange(0, CHUNK)
    ids = _load_ids(idx_ptr, valid_ptr, i, N, K, ROWS_PER_GROUP, L, HAS_VALID)
    return i, tl.where(ids >= 0, ids, L)


@triton.jit
def _route_hist_kernel(idx_ptr, valid_ptr, hist_ptr, N, K, ROWS_PER_GROUP, L, HAS_VALID: tl.constexpr,
                       CHUNK: tl.constexpr, LP: tl.constexpr):
    c = tl.program_id(0)
    _, e = _chunk_bins(idx_ptr, valid_ptr, c, N, K, ROWS_PER_GROUP, L, HAS_VALID, CHUNK)
    tl.store(hist_ptr + c * LP + tl.arange(0, LP), tl.histogram(e, LP))


@triton.jit
def _store_totals(hist, counts_ptr, offsets_ptr, L, LP: tl.constexpr):
    """Per-bin pick totals [LP] -> counts [L] and offsets [L+1] stored; returns the offsets (first slot per bin)."""
    b = tl.arange(0, LP)
    tot = tl.where(b < L, hist, 0)
    first = tl.cumsum(tot, 0) - tot  # at b = L: the number of valid picks
    tl.store(counts_ptr + b, tot, mask=b < L)
    tl.store(offsets_ptr + b, first, mask=b <= L)
    return first


@triton.jit
def _route_place_kernel(idx_ptr, valid_ptr, hist_ptr, counts_ptr, offsets_ptr, slot_ptr, row_of_slot_ptr, C,
                        N, K, ROWS_PER_GROUP, L, PAD_ROWS, w_ptr, slot_w_ptr, ready_ptr, HAS_VALID: tl.constexpr,
                        ONE_CHUNK: tl.constexpr, PADDED: tl.constexpr, SLOT_W: tl.constexpr, ZERO_READY: tl.constexpr,
                        CHUNK: tl.constexpr, LP: tl.constexpr):
    c = tl.program_id(0)
    i, e = _chunk_bins(idx_ptr, valid_ptr, c, N, K, ROWS_PER_GROUP, L, HAS_VALID, CHUNK)
    b = tl.arange(0, LP)
    if ZERO_READY:  # the expert MLP's chain counters [L], zeroed here: no zero-fill op of their own per forward
        if c == 0:
            tl.store(ready_ptr + b, tl.zeros([LP], tl.int32), mask=b < L)
    if ONE_CHUNK:  # histogram and scan in this program: one launch for decode-sized routes
        hist = tl.histogram(e, LP)
        offs = _store_totals(hist, counts_ptr, offsets_ptr, L, LP)
        first = offs
        total = tl.sum(tl.where(b < L, hist, 0), 0)
    else:  # every program scans the C chunks' histograms itself (C is small), so no scan launch sits in between
        hist = tl.load(hist_ptr + c * LP + b)
        tot = tl.zeros([LP], tl.int32)
        before = tl.zeros([LP], tl.int32)  # each expert's picks in the chunks before this one
        c2 = 0
        while c2 < C:  # (while: the interpreter cannot take a runtime-bounded range)
            h = tl.load(hist_ptr + c2 * LP + b)
            tot += h
            before += tl.where(c2 < c, h, 0)
            c2 += 1
        tot = tl.where(b < L, tot, 0)
        offs = tl.cumsum(tot, 0) - tot  # at b = L: the number of valid picks
        if c == 0:
            _store_totals(tot, counts_ptr, offsets_ptr, L, LP)
        first = offs + tl.where(b < L, before, 0)
        total = tl.sum(tot, 0)
    # sorting (bin, position) keys groups the chunk's picks by expert in ascending position: the j-th key
    # sorted is pick number j - start[bin] of its expert in this chunk, whose slot is first[bin] + that
    start = tl.cumsum(hist, 0) - hist
    key = tl.sort(e * CHUNK + tl.arange(0, CHUNK))
    kb = key // CHUNK
    ki = c * CHUNK + key % CHUNK
    slot = tl.gather(first - start, kb, 0) + tl.arange(0, CHUNK)
    here = kb < L
    if PADDED:  # expert-major rows: pick j of expert e at e * PAD_ROWS + j; picks past PAD_ROWS are dropped
        j = slot - tl.gather(offs, kb, 0)
        here = here & (j < PAD_ROWS)
        slot = kb * PAD_ROWS + j
    tl.store(slot_ptr + ki, tl.where(here, slot, -1), mask=ki < N)
    if SLOT_W:  # each slot's routing weight, fp32
        wv = tl.load(w_ptr + ki, mask=here & (ki < N), other=0.0)
        tl.store(slot_w_ptr + slot, wv.to(tl.float32), mask=here)
    if not PADDED:
        tl.store(row_of_slot_ptr + slot, ki // K, mask=here)
        tl.store(row_of_slot_ptr + i, tl.full((CHUNK,), -1, tl.int32), mask=(i < N) & (i >= total))


def route_experts(topk_idx: torch.Tensor, num_local_experts: int, *, valid_rows: torch.Tensor | None = None,
                  rows_per_group: int | None = None, padded_rows: int | None = None,
                  weights: torch.Tensor | None = None) -> Route:
    """Histogram, offsets and slots of ``topk_idx [M, K]`` (int32/int64 local ids; anything outside [0, L) is
    skipped, int64 ids of 2^31 and more included: they are compared in int64, never truncated onto an expert).

    ``valid_rows`` (int tensor ``[G]``, ``G >= ceil(M / rows_per_group)``, on topk_idx's device) with
    ``rows_per_group`` (a positive int): row ``r`` is used only when
    ``r % rows_per_group < valid_rows[r // rows_per_group]`` (e.g. RANK_MAJOR's ``src_rank_counts`` with
    ``T``, or FLAT's ``num_recv`` with ``S``); rows past a count are ignored whatever ids they hold (a negative
    count: the whole group). No host sync.

    ``padded_rows`` (a positive int, ``L * padded_rows < 2**31``): expert-major padded slots instead of ragged ones,
    as LL EXPERT_MAJOR lays its rows out: the j-th pick of expert e (in the same ascending ``(row, k)`` order) gets
    slot ``e * padded_rows + j``, and a pick with ``j >= padded_rows`` (more picks than an expert's rows, which only
    duplicate ids in a row can cause) is dropped (slot -1); ``counts`` and ``offsets`` stay the ragged ones (counts
    not capped) and ``row_of_slot`` is None. ``weights`` (float ``[M, K]``, on topk_idx's device): also each valid
    slot's weight, fp32, in ``route.slot_weight`` (``[M*K]``, or ``[L * padded_rows]``; entries of no valid slot
    are left as they are).
    """
    if not isinstance(topk_idx, torch.Tensor):
        fail("type(topk_idx)", type(topk_idx).__name__, "a torch.Tensor [M, K]")
    if topk_idx.dim() != 2:
        fail("topk_idx.shape", tuple(topk_idx.shape), "[M, K]")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        fail("topk_idx.dtype", topk_idx.dtype, "torch.int32, torch.int64")
    check_on_kernel_device(topk_idx, "topk_idx")
    if not (_is_int(num_local_experts) and num_local_experts > 0):
        fail("num_local_experts", num_local_experts, "a positive int")
    M, K = topk_idx.shape
    N, L, dev = M * K, int(num_local_experts), topk_idx.device
    if N >= 2 ** 31:
        fail("topk_idx.numel()", N, "< 2**31 (slots are int32)")
    has_valid = valid_rows is not None
    if has_valid:
        if not (_is_int(rows_per_group) and rows_per_group > 0):
            fail("rows_per_group", rows_per_group, "a positive int (with valid_rows)")
        if not isinstance(valid_rows, torch.Tensor):
            fail("type(valid_rows)", type(valid_rows).__name__, "an int torch.Tensor [G]")
        if valid_rows.dtype.is_floating_point or valid_rows.dtype.is_complex or valid_rows.dtype == torch.bool:
            fail("valid_rows.dtype", valid_rows.dtype, "an integer dtype (int32, int64)")
        groups = -(-M // rows_per_group)
        if valid_rows.dim() != 1 or valid_rows.shape[0] < groups:
            fail("valid_rows.shape", tuple(valid_rows.shape),
                 f"[G] with G >= {groups} (one count per group of {rows_per_group} of the {M} rows)")
        if valid_rows.device != dev:
            fail("valid_rows.device", str(valid_rows.device), str(dev))
        if valid_rows.dtype not in (torch.int32, torch.int64):  # narrower ints widen losslessly
            valid_rows = valid_rows.to(torch.int32)
        valid_rows = valid_rows.contiguous()
    elif rows_per_group is not None:
        fail("rows_per_group", rows_per_group, "None without valid_rows (it sizes valid_rows' groups)")
    pad = 0
    if padded_rows is not None:
        if not (_is_int(padded_rows) and 0 < padded_rows and L * padded_rows < 2 ** 31):
            fail("padded_rows", padded_rows,
                 f"None or a positive int with num_local_experts ({L}) * padded_rows < 2**31")
        pad = int(padded_rows)
    if weights is not None:
        if not isinstance(weights, torch.Tensor):
            fail("type(weights)", type(weights).__name__, "a float torch.Tensor [M, K] or None")
        if tuple(weights.shape) != (M, K) or not weights.dtype.is_floating_point or weights.device != dev:
            fail("weights", f"{tuple(weights.shape)} {weights.dtype} on {weights.device}",
                 f"a float tensor ({M}, {K}) on {dev} (topk_idx's)")
        weights = weights.contiguous()
    return _route(topk_idx.contiguous(), L, valid_rows, rows_per_group or 1, pad, weights)


def _route(idx: torch.Tensor, L: int, valid_rows=None, rows_per_group: int = 1, pad_rows: int = 0,
           weights: torch.Tensor | None = None, index_dtype: torch.dtype = torch.int32,
           chain_ready: bool = False) -> Route:
    """:func:`route_experts` on arguments its caller has checked (contiguous ``idx [..., K]``, its rows flattened;
    ``pad_rows`` 0: ragged), its buffers allocated here. ``index_dtype`` int64: ``counts`` and ``offsets`` written
    as int64 (what HT EXPERT_MAJOR's contract holds; such a route is for this package's own use: :class:`Route` is
    int32). ``chain_ready`` (int32 index type only): the route also has ``chain_ready`` counters, zeroed by its
    launch."""
    K = idx.shape[-1]
    M = math.prod(idx.shape[:-1])
    dev = idx.device
    C, LP = _route_chunks(M * K, L)[1:]
    # the int32 parts (and the chunked launches' histograms) cut from one allocation: two torch ops, not one per part
    sizes = [M * K] if pad_rows else [M * K, M * K]  # slot (and row_of_slot)
    if index_dtype is torch.int32:
        sizes += [L, L + 1] + ([L] if chain_ready else [])
    if C > 1:
        sizes.append(C * LP)
    p, n = _pieces(sizes, torch.int32, dev), 1 if pad_rows else 2
    slot, row_of_slot = p[0].view(M, K), None if pad_rows else p[1]
    counts, offsets = (p[n], p[n + 1]) if index_dtype is torch.int32 else _pieces((L, L + 1), index_dtype, dev)
    hist = p[-1] if C > 1 else None
    slot_weight = None
    if weights is not None:
        slot_weight = torch.empty(L * pad_rows if pad_rows else M * K, dtype=torch.float32, device=dev)
    ready = p[n + 2] if chain_ready and index_dtype is torch.int32 else None
    route = Route._made(counts, offsets, slot, row_of_slot, slot_weight, ready)
    if M * K == 0:
        offsets.zero_()
        counts.zero_()
    else:
        _launch_route(idx, valid_rows, rows_per_group, L, route, pad_rows=pad_rows, weights=weights,
                      scratch=None if hist is None else {"hist": hist})
    return route


def _pieces(sizes, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """1-D tensors of ``sizes`` elements cut from one new allocation (two torch ops in all), each starting on a
    16-byte boundary as a tensor of its own would (what the kernels' compiled variants are specialized on): a
    size that is no multiple of 16 bytes is followed by a padding piece, left out."""
    per16 = 16 // dtype.itemsize
    cuts, keep, i = [], [], 0
    for n in sizes:  # (operators, not calls: this is on every forward's host path)
        pad = -n % per16
        cuts += (n, pad) if pad else (n,)
        keep += (i,)
        i += 2 if pad else 1
    # torch.split_with_sizes itself: Tensor.split's Python wrapper costs more than the op
    cut = torch.split_with_sizes(torch.empty(sum(cuts), dtype=dtype, device=device), cuts)
    return cut if i == len(keep) else [cut[j] for j in keep]


def _route_chunks(N: int, L: int) -> tuple[int, int, int]:
    """(ids per program, programs, histogram bins) of a route of ``N`` ids into ``L`` experts: one program for up
    to ``_ROUTE_ONE_LAUNCH`` ids, else chunks of ``_ROUTE_CHUNK``; bins for the L experts and "not here"."""
    chunk = max(16, host_math.next_power_of_2(N)) if N <= _ROUTE_ONE_LAUNCH else _ROUTE_CHUNK
    return chunk, host_math.cdiv(N, chunk), host_math.next_power_of_2(L + 1)


def _launch_route(idx, valid_rows, rows_per_group: int, L: int, out: Route, warps: int | None = None, *,
                  pad_rows: int = 0, weights: torch.Tensor | None = None, scratch: dict | None = None) -> None:
    """The route kernels for contiguous ``idx [..., K]`` into ``out``'s buffers: one launch up to
    ``_ROUTE_ONE_LAUNCH`` ids, else histogram then place over chunks (each placing program scans the histograms).
    ``warps``: the launch width (default: the best measured on the H200; ``benchmarks/bench_route.py`` sweeps it).
    ``pad_rows`` > 0: padded expert-major slots (``route_experts(padded_rows=)``; ``out.row_of_slot`` is not
    written); ``weights``: contiguous ``[M, K]``, written per slot into ``out.slot_weight``; ``out.chain_ready``
    (when it has one) zeroed; ``scratch``: a dict to keep the chunked launches' int32 ``[C, LP]`` histograms in
    between calls (a caller that routes the same shape again). No checks: the caller's."""
    K = idx.shape[-1]
    N, dev, has_valid = idx.numel(), idx.device, valid_rows is not None
    chunk, C, LP = _route_chunks(N, L)
    if warps is None:  # wide chunks keep more ids in flight with 8 warps; measured in docs/PERF.md
        warps = 8 if chunk >= 1024 else 4
    counts, offsets, slot = out.counts, out.offsets, out.slot
    row_of_slot = out.row_of_slot if out.row_of_slot is not None else slot
    slot_w = out.slot_weight if weights is not None else counts
    args = (idx, valid_rows if has_valid else counts)
    rest = (N, K, rows_per_group, L)
    ready = out.chain_ready
    place = (pad_rows, weights if weights is not None else counts, slot_w, ready if ready is not None else counts)
    flags = dict(HAS_VALID=has_valid, PADDED=pad_rows > 0, SLOT_W=weights is not None, ZERO_READY=ready is not None,
                 CHUNK=chunk, LP=LP, num_warps=warps)
    if C == 1:
        launch_cache.launch(_route_place_kernel, (1,), *args, counts, counts, offsets, slot, row_of_slot, 1, *rest,
                            *place, ONE_CHUNK=True, **flags)
    else:
        hist = scratch.get("hist") if scratch is not None else None
        if hist is None or hist.numel() < C * LP:
            hist = torch.empty(C, LP, dtype=torch.int32, device=dev)
            if scratch is not None:
                scratch["hist"] = hist
        launch_cache.launch(_route_hist_kernel, (C,), *args, hist, *rest, HAS_VALID=has_valid, CHUNK=chunk, LP=LP,
                            num_warps=warps)
        launch_cache.launch(_route_place_kernel, (C,), *args, hist, counts, offsets, slot, row_of_slot, C, *rest,
                            *place, ONE_CHUNK=False, **flags)


def _gather_configs():
    if INTERPRETER:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_H": 256})]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_H": bh}, num_warps=w)
            for bm, bh, w in [(4, 1024, 4), (8, 512, 4), (16, 512, 8), (2, 2048, 8), (32, 256, 4)]]


@triton.autotune(configs=_gather_configs(), key=["H"])
@triton.jit
def _gather_rows_kernel(x_ptr, row_ptr, offsets_ptr, TOTAL_AT, out_ptr, N, M_X, H, stride_x,
                        BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_m = tl.program_id(0)
    total = tl.load(offsets_ptr + TOTAL_AT)  # the route's offsets[L]: the valid slots
    if pid_m * BLOCK_M < total:  # programs past the valid slots do nothing
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        live = (rows < N) & (rows < total)
        src = tl.load(row_ptr + rows, mask=live, other=-1).to(tl.int64)
        cmask = cols[None, :] < H
        inside = (src >= 0) & (src < M_X)  # a hand-made row_of_slot never reads past x
        v = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=inside[:, None] & cmask, other=0)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], v, mask=live[:, None] & cmask)


def permute_rows(x, route: Route, *, nvfp4_global_scale=None, quantize: bool = False,
                 out: torch.Tensor | None = None):
    """Rows ``x[row_of_slot]`` into the expert-sorted buffer ``[M*K, H]`` (rows past ``offsets[L]`` untouched).

    ``x [M, H]`` (M = ``route.slot.shape[0]``, on the route's device): any float or integer dtype (bf16 tokens, or
    the bytes of packed rows), or an ``NvFp4Tensor`` with linear scales (its packed rows, scales and global
    scales -- one, or one per row -- are gathered as they are, no requantization), or an ``Fp8Tensor`` with one
    scale per row per 128 columns (``block_rows`` 1: codes and scales gathered as they are). With ``quantize`` a
    float x is quantized to NVFP4 on the way (``gather_quantize_nvfp4``; ``nvfp4_global_scale`` None =
    from all of x, on the device; rows past the valid slots are all-zero codes). ``out``: a contiguous
    ``[M*K, H]`` tensor of x's dtype and device to write into (plain gathers only).
    """
    _check_route(route, "offsets", "slot", "row_of_slot")
    M = route.slot.shape[0]
    if not isinstance(quantize, bool):
        fail("quantize", quantize, "True or False")
    if isinstance(x, (NvFp4Tensor, Fp8Tensor)):
        x.check("x")
        kind, nvfp4 = type(x).__name__, isinstance(x, NvFp4Tensor)
        per_row = not x.swizzled if nvfp4 else x.block_rows == 1  # scales per row: the row parts gathered
        if len(x.shape) != 2 or not per_row:
            got = f"swizzled={x.swizzled}" if nvfp4 else f"block_rows={x.block_rows}"
            fail("x", f"{kind} {tuple(x.shape)} {got}",
                 f"an {kind} [M, H] with " + ("linear scales" if nvfp4 else "block_rows 1"))
        if quantize or out is not None or nvfp4_global_scale is not None:
            fail("quantize / out / nvfp4_global_scale", (quantize, type(out).__name__, type(nvfp4_global_scale).__name__),
                 f"False / None / None with an {kind} x (it is gathered as it is)")
        _check_rows(x.shape[0], M, x.data, route)
        return _permute(x, route)
    if not isinstance(x, torch.Tensor):
        fail("type(x)", type(x).__name__, "a torch.Tensor [M, H], an NvFp4Tensor or an Fp8Tensor")
    if x.dim() != 2:
        fail("x.dim()", x.dim(), "2 ([M, H])")
    if x.dtype == torch.bool or x.dtype.is_complex:
        fail("x.dtype", x.dtype, "a real float or integer dtype")
    _check_rows(x.shape[0], M, x, route)
    if quantize:
        if out is not None:
            fail("out", type(out).__name__, "None with quantize=True (a new NvFp4Tensor is returned)")
        if nvfp4_global_scale is None and x.numel() == 0:  # amax of nothing: the all-zero scale
            nvfp4_global_scale = torch.ones((), dtype=torch.float32, device=x.device)
        return gather_quantize_nvfp4(x, route.row_of_slot, nvfp4_global_scale, check_finite=False)
    if nvfp4_global_scale is not None:
        fail("nvfp4_global_scale", type(nvfp4_global_scale).__name__, "None unless quantize=True")
    return _gather(x, route, out)


def _permute(x, route: Route):
    """:func:`permute_rows` (no quantize, no ``out``) on checked arguments: a tensor, an NvFp4Tensor or an
    Fp8Tensor, each of its row parts (``moe_ep.kernels.row_parts``; any row dims, flattened) gathered as it is."""
    return with_row_parts(x, [_gather(p, route) for p in row_parts(x)])


def _check_rows(m: int, route_m: int, t: torch.Tensor, route: Route) -> None:
    """x's rows and device against the route's (fewer rows would be read past x's end)."""
    if m != route_m:
        fail("x.shape[0]", m, f"{route_m} (route.slot.shape[0]: the rows the route was made for)")
    check_on_kernel_device(t, "x")
    if t.device != route.slot.device:
        fail("x.device", str(t.device), f"{route.slot.device} (the route's device)")


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``t [..., H]`` as the kernels index it: (a tensor with unit column stride, its rows, its row stride). ``t``
    itself when it is 2-D with unit column stride or contiguous (no torch op), else a 2-D copy."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t, t.shape[0], t.stride(0)
    if t.is_contiguous():
        return t, math.prod(t.shape[:-1]), t.shape[-1]
    t = t.reshape(-1, t.shape[-1])
    if t.stride(1) != 1:
        t = t.contiguous()
    return t, t.shape[0], t.stride(0)


def _gather(x: torch.Tensor, route: Route, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[slot] = x[row_of_slot[slot]]`` for the valid slots of ``route``, any dtype, ``x [..., H]`` (rows
    flattened)."""
    N, H = route.row_of_slot.shape[0], x.shape[-1]
    if out is None:
        out = torch.empty(N, H, dtype=x.dtype, device=x.device)
    else:
        if not isinstance(out, torch.Tensor):
            fail("type(out)", type(out).__name__, "a torch.Tensor or None")
        if tuple(out.shape) != (N, H) or not out.is_contiguous():
            fail("out", f"{tuple(out.shape)} contiguous={out.is_contiguous()}", f"contiguous ({N}, {H})")
        if out.dtype != x.dtype or out.device != x.device:
            fail("out", f"{out.dtype} on {out.device}", f"{x.dtype} on {x.device} (x's)")
    if N and H:
        x2, m_x, stride = _as_rows(x)
        offsets = route.offsets  # the kernel reads offsets[L] where it lies: no slice op
        grid = launch_cache.BlockGrid(N, H)
        autotuning.launch(_gather_rows_kernel, grid, x2, route.row_of_slot.contiguous(), offsets,
                          (offsets.shape[0] - 1) * offsets.stride(0), out, N, m_x, H, stride)
    return out


@triton.autotune(configs=_gather_configs(), key=["H"])
@triton.jit
def _scatter_rows_kernel(x_ptr, slot_ptr, out_ptr, N, K, H, stride_x, N_OUT,
                         BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    picks = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = picks < N
    dst = tl.load(slot_ptr + picks, mask=live, other=-1).to(tl.int64)
    ok = live & (dst >= 0) & (dst < N_OUT)  # a hand-made slot never writes past out
    cmask = cols[None, :] < H
    src = (picks // K).to(tl.int64)
    v = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=ok[:, None] & cmask, other=0)
    tl.store(out_ptr + dst[:, None] * H + cols[None, :], v, mask=ok[:, None] & cmask)


def scatter_rows(x: torch.Tensor, route: Route, out: torch.Tensor) -> torch.Tensor:
    """``out[slot[m, k]] = x[m]`` for every pick with a slot in ``[0, out.shape[0])``; other rows of ``out`` are
    left as they are. Returns ``out``.

    ``x [M, H]`` any real float or integer dtype (bf16 tokens, or the bytes of packed rows), ``route.slot [M, K]``
    (e.g. :func:`route_experts` with ``padded_rows``: LL EXPERT_MAJOR's ``[L * rows, H]`` buffer), ``out [P, H]``
    contiguous, x's dtype, all on one device. Two picks with one slot (a hand-made route) write one of the two.
    No host sync.
    """
    _check_route(route, "slot")
    if not isinstance(x, torch.Tensor):
        fail("type(x)", type(x).__name__, "a torch.Tensor [M, H]")
    if x.dim() != 2 or x.dtype == torch.bool or x.dtype.is_complex:
        fail("x", f"{tuple(x.shape)} {x.dtype}", "a 2-D real float or integer tensor [M, H]")
    _check_rows(x.shape[0], route.slot.shape[0], x, route)
    if not isinstance(out, torch.Tensor):
        fail("type(out)", type(out).__name__, "a torch.Tensor [P, H]")
    if out.dim() != 2 or out.shape[1] != x.shape[1] or not out.is_contiguous():
        fail("out", f"{tuple(out.shape)} contiguous={out.is_contiguous()}", f"contiguous (P, {x.shape[1]})")
    if out.dtype != x.dtype or out.device != x.device:
        fail("out", f"{out.dtype} on {out.device}", f"{x.dtype} on {x.device} (x's)")
    _scatter(x, route.slot.contiguous(), out)
    return out


def _scatter(x: torch.Tensor, slot: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`scatter_rows` on checked arguments (``x [..., H]``, rows flattened; ``slot`` contiguous ``[M, K]``;
    ``out`` contiguous ``[P, H]``)."""
    N, H = slot.numel(), x.shape[-1]
    if N and H:
        x2, _, stride = _as_rows(x)
        grid = launch_cache.BlockGrid(N, H)
        autotuning.launch(_scatter_rows_kernel, grid, x2, slot, out, N, slot.shape[1], H, stride, out.shape[0])


def _reduce_configs():
    if INTERPRETER:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_H": 256})]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_H": bh}, num_warps=w)
            for bm, bh, w in [(4, 1024, 4), (8, 512, 4), (16, 256, 4), (2, 2048, 8), (8, 1024, 8)]]


@triton.autotune(configs=_reduce_configs(), key=["H", "K"])
@triton.jit
def _unpermute_reduce_kernel(y_ptr, slot_ptr, w_ptr, out_ptr, M, H, K: tl.constexpr, N_Y, stride_y,
                             HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < M
    cmask = cols[None, :] < H
    acc = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)
    for k in tl.static_range(K):  # fixed k order: the sum is deterministic
        s = tl.load(slot_ptr + rows * K + k, mask=rmask, other=-1).to(tl.int64)
        hit = s >= 0
        v = tl.load(y_ptr + s[:, None] * stride_y + cols[None, :], mask=(hit & (s < N_Y))[:, None] & cmask, other=0.0)
        v = tl.where((s >= N_Y)[:, None], nan_f32(), v.to(tl.float32))  # a slot past y's end: NaN, never read
        if HAS_W:
            w = tl.load(w_ptr + rows * K + k, mask=rmask & hit, other=0.0).to(tl.float32)
            v = v * tl.where(hit, w, 0.0)[:, None]
        acc += v
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask)


def unpermute_reduce(y: torch.Tensor, route: Route, weights: torch.Tensor | None = None, *,
                     out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out[row] = sum_k w[row, k] * y[slot(row, k)]`` in fp32 (``w`` = 1 when ``weights`` is None).

    ``y [>= offsets[L], H]`` (2-D or more: leading dims are flattened) the expert outputs in slot order,
    bf16/fp16/fp32; ``route`` needs only its ``slot [M, K]``; ``weights [M, K]`` float; returns ``[M, H]``
    (``out_dtype``, or written into ``out``, contiguous, a float dtype), all on one device. Rows with no local
    pick get zeros. A row with a slot past the end of ``y`` comes out NaN (how short y is, only the device
    knows: there is no host sync). No host sync.
    """
    _check_route(route, "slot")
    if not isinstance(y, torch.Tensor):
        fail("type(y)", type(y).__name__, "a torch.Tensor [S, H]")
    if y.dim() < 2:
        fail("y.shape", tuple(y.shape), "[S, H] (2-D, one row per slot)")
    if not y.dtype.is_floating_point:
        fail("y.dtype", y.dtype, "a float dtype (bf16, fp16, fp32)")
    check_on_kernel_device(y, "y")
    slot = route.slot
    if slot.device != y.device:
        fail("route.slot.device", str(slot.device), f"{y.device} (y's)")
    M, K = slot.shape
    H = y.shape[-1]
    if out is None:
        if not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
            fail("out_dtype", out_dtype, "a float torch.dtype")
        out = torch.empty(M, H, dtype=out_dtype, device=y.device)
    else:
        if not isinstance(out, torch.Tensor):
            fail("type(out)", type(out).__name__, "a torch.Tensor or None")
        if tuple(out.shape) != (M, H) or not out.is_contiguous():
            fail("out", f"{tuple(out.shape)} contiguous={out.is_contiguous()}", f"contiguous ({M}, {H})")
        if not out.dtype.is_floating_point or out.device != y.device:
            fail("out", f"{out.dtype} on {out.device}", f"a float dtype on {y.device} (y's)")
    if weights is not None:
        if not isinstance(weights, torch.Tensor):
            fail("type(weights)", type(weights).__name__, "a float torch.Tensor [M, K] or None")
        if tuple(weights.shape) != (M, K):
            fail("weights.shape", tuple(weights.shape), f"({M}, {K})")
        if not weights.dtype.is_floating_point or weights.device != y.device:
            fail("weights", f"{weights.dtype} on {weights.device}", f"a float dtype on {y.device} (y's)")
        weights = weights.contiguous()
    _unpermute(y, slot.contiguous(), weights, out)
    return out


def _unpermute(y: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """:func:`unpermute_reduce` on checked arguments: ``y [..., H]`` (rows flattened), ``slot`` contiguous
    ``[M, K]``, ``weights`` contiguous with ``M * K`` elements or None, ``out`` contiguous with ``M`` rows of H.
    Returns ``out``."""
    M, K = slot.shape
    H = y.shape[-1]
    if M and H:
        y2, n_y, stride = _as_rows(y)
        grid = launch_cache.BlockGrid(M, H)
        autotuning.launch(_unpermute_reduce_kernel, grid, y2, slot, weights if weights is not None else y2, out, M,
                          H, K, n_y, stride, HAS_W=weights is not None)
    return out


__all__ = ["Route", "route_experts", "permute_rows", "scatter_rows", "unpermute_reduce", "NvFp4Tensor"]
