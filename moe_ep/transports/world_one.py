"""The portable transport at world size 1: every layout built from the caller's own tensors by the bridge kernels.

Nothing moves between ranks, so dispatch is the layout alone and combine the way back, with as few launches as the
layout allows (each torch op or kernel launch costs host time an eager forward pays; tests/test_launch_path.py
bounds them):

* LL EXPERT_MAJOR: one route launch gives each pick its padded row ``e * T + j`` (``route_experts(padded_rows=T)``),
  one scatter launch writes the token rows there; combine is one weighted unpermute-reduce over those rows.
* LL RANK_MAJOR: the tokens, ids (int32) and weights (fp32) as ``[1, T, ...]`` (the contract's T is
  ``max_tokens_per_rank``): the caller's tensors when the batch is T tokens, else copied into kept buffers (through
  views kept per batch size); combine is a view of the compute's rows.
* HT FLAT: the caller's tensors as they are (S = B received rows; int32 ids widened, weights made fp32).
* HT EXPERT_MAJOR: one route (its counts and offsets written as int64, each slot's weight written by the same
  launch) and one gather; combine is one unpermute-reduce.

Ids outside ``[0, E)`` are no expert, as on every path of this transport: the route skips them (compared in their
own type, int64 ids of 2**31 and more included), and the layouts that carry ids (RANK_MAJOR narrowed to int32 after
clamping to ``[-1, E]``, FLAT as they are) hand them to a compute whose route skips them too.

NVFP4 and FP8 activations: the tokens arrive quantized (``q``, an ``NvFp4Tensor`` with one global scale per row, or
an ``Fp8Tensor`` with one fp32 scale per row per 128 channels, from the transport's dispatch); the layouts move its
row parts (``moe_ep.kernels.row_parts``) as they are, one code path for every format.

Buffers the layouts return live until the next dispatch (views of persistent buffers, or new tensors).
"""

from __future__ import annotations

import torch

from ..config import EpConfig
from ..kernels.bridge import Route, _gather, _launch_route, _scatter, _unpermute
from ..kernels.row_parts import row_parts, with_row_parts
from ..layout_contract import (HighThroughputExpertMajor, HighThroughputFlat, LowLatencyExpertMajor,
                               LowLatencyRankMajor, result_type)


class WorldOneLayouts:
    """Dispatch and combine of one :class:`EpConfig` at world size 1 (module doc). ``dispatch(x, q, idx, w)``:
    ``x [B, H]`` bf16, ``q`` its NVFP4 or FP8 form or None, ``idx [B, K]`` int32/int64 global (= local) ids,
    ``w [B, K]`` float, all checked by the layer; ``combine(y)``: the compute's output for the last dispatch -> ``[B, H]`` bf16."""

    def __init__(self, config: EpConfig, device: torch.device):
        self.config, self.device = config, device
        self.L, self.T, self.K, self.H = (config.num_experts, config.max_tokens_per_rank, config.top_k,
                                          config.hidden_size)
        self._bufs: dict = {}
        self._state = None  # what combine needs of the last dispatch
        kind = result_type(config)
        self.dispatch = {LowLatencyExpertMajor: self._ll_expert_major, LowLatencyRankMajor: self._ll_rank_major,
                         HighThroughputFlat: self._ht_flat, HighThroughputExpertMajor: self._ht_expert_major}[kind]
        self.combine = {LowLatencyExpertMajor: self._combine_slots, LowLatencyRankMajor: self._combine_rank_major,
                        HighThroughputFlat: self._combine_flat, HighThroughputExpertMajor: self._combine_slots}[kind]

    def _kept(self, key, make, *args):
        """``make(*args)``, made once per ``key`` and kept; not kept when made inside a CUDA-graph capture (its values
        would then exist only in the graph's replays, and an eager forward would read garbage)."""
        t = self._bufs.get(key)
        if t is None:
            t = make(*args)
            if not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._bufs[key] = t
        return t

    def _count(self, n: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """A device tensor holding ``n`` (a count the host knows: the batch), made once per value."""
        return self._kept(("count", n, dtype, shape), lambda: torch.full(shape, n, dtype=dtype, device=self.device))

    def _route(self, idx, pad_rows: int = 0, weights=None, index_dtype=torch.int32):
        """The route of ``idx [B, K]`` into buffers kept per batch size (this layout routes every B the same way),
        with views kept beside it: its offsets' first L and their end (the valid slots)."""
        B, L, K, dev = idx.shape[0], self.L, self.K, self.device

        def make():
            sw = None if weights is None else torch.empty(L * pad_rows if pad_rows else B * K, dtype=torch.float32,
                                                          device=dev)
            offsets = torch.zeros(L + 1, dtype=index_dtype, device=dev)  # zeros: B = 0 launches nothing
            route = Route._made(torch.zeros(L, dtype=index_dtype, device=dev), offsets,
                                torch.empty(B, K, dtype=torch.int32, device=dev),
                                None if pad_rows else torch.empty(B * K, dtype=torch.int32, device=dev), sw)
            return route, {}, (offsets[:L], offsets[L])
        route, scratch, ends = self._kept(("route", B), make)
        if B:
            _launch_route(idx.contiguous(), None, 1, self.L, route, pad_rows=pad_rows,
                          weights=None if weights is None else weights.contiguous(), scratch=scratch)
        return route, ends

    # ---- dispatch ------------------------------------------------------------------------------------------
    def _ll_expert_major(self, x, q, idx, w) -> LowLatencyExpertMajor:
        L, T = self.L, self.T
        route, _ = self._route(idx, pad_rows=T)
        slot, payload = route.slot, x if q is None else q
        rows = []  # each part's padded rows, kept with their [L, T, width] view
        for i, part in enumerate(row_parts(payload, broadcast_shared=True)):
            width, dt = part.shape[-1], part.dtype
            buf, view = self._kept(("em", i, width, dt), self._viewed, (L * T, width), (L, T, width), dt)
            _scatter(part, slot, buf)
            rows.append(view)
        self._state = (slot, w.contiguous())
        return LowLatencyExpertMajor(with_row_parts(payload, rows), expert_counts=route.counts)

    def _viewed(self, shape, view_shape, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed buffer (garbage rows stay finite) and its view of ``view_shape``, to be kept together: a view
        made once is no torch op on the next forward."""
        buf = torch.zeros(shape, dtype=dtype, device=self.device)
        return buf, buf.view(view_shape)

    def _rows(self, name, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t [B, ...]`` as ``[1, T, ...]`` in ``dtype`` (the contract's T rows): ``t`` itself when B = T (converted
        if it must be), else copied into a kept buffer whose rows past B are garbage. The buffer's ``[1, T, ...]``
        view and its first B rows are kept with it: a forward of a kept batch size is one copy, no view op."""
        B = t.shape[0]
        if B == self.T:
            return (t if t.dtype is dtype else t.to(dtype)).unsqueeze(0)
        tail = tuple(t.shape[1:])
        buf, view = self._kept(name, self._viewed, (self.T, *tail), (1, self.T, *tail), dtype)
        self._kept((name, B), buf.narrow, 0, 0, B).copy_(t)
        return view

    def _ids(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx [B, K]`` as ``[1, T, K]`` int32 (the first B rows), never narrowed onto another expert: other
        dtypes are clamped to ``[-1, E]``, then copied into a kept buffer (its ``[1, T, K]`` view and first B rows
        kept too)."""
        if idx.dtype is torch.int32:
            return self._rows("ids32", idx, torch.int32)
        buf, view = self._kept("ids_clamped", self._viewed, (self.T, self.K), (1, self.T, self.K), torch.int32)
        B = idx.shape[0]
        (buf if B == self.T else self._kept(("ids_clamped", B), buf.narrow, 0, 0, B)).copy_(
            idx.clamp(-1, self.config.num_experts))
        return view

    def _ll_rank_major(self, x, q, idx, w) -> LowLatencyRankMajor:
        B, payload = x.shape[0], x if q is None else q
        rows = [self._rows(("rm", i), p, p.dtype) for i, p in enumerate(row_parts(payload, broadcast_shared=True))]
        self._state = B
        return LowLatencyRankMajor(with_row_parts(payload, rows), topk_idx=self._ids(idx),
                                   topk_weights=self._rows("w", w, torch.float32),
                                   src_rank_counts=self._count(B, torch.int32, (1,)))

    def _ht_flat(self, x, q, idx, w) -> HighThroughputFlat:
        B = x.shape[0]
        return HighThroughputFlat(x if q is None else q, topk_idx=idx if idx.dtype is torch.int64 else idx.long(),
                                  topk_weights=w if w.dtype is torch.float32 else w.float(),
                                  num_recv=self._count(B, torch.int64, ()))

    def _ht_expert_major(self, x, q, idx, w) -> HighThroughputExpertMajor:
        route, (offsets, total) = self._route(idx, weights=w, index_dtype=torch.int64)
        payload = x if q is None else q
        tokens = with_row_parts(payload, [_gather(p, route) for p in row_parts(payload, broadcast_shared=True)])
        self._state = (route.slot, None)  # the slots' weights were applied in GEMM2
        return HighThroughputExpertMajor(tokens, expert_offsets=offsets, expert_counts=route.counts,
                                         topk_weights=route.slot_weight, num_recv=total)

    # ---- combine -------------------------------------------------------------------------------------------
    def _combine_slots(self, expert_out: torch.Tensor) -> torch.Tensor:
        """The EXPERT_MAJOR layouts: a token's slots summed back into its row in fp32, times their routing weights
        (LL; HT's slots come weighted from GEMM2: no weights)."""
        slot, w = self._state
        out = torch.empty(slot.shape[0], self.H, dtype=torch.bfloat16, device=self.device)
        return _unpermute(expert_out, slot, w, out)

    def _combine_rank_major(self, expert_out: torch.Tensor) -> torch.Tensor:
        rows = expert_out.reshape(self.T, self.H)
        return rows if self._state == self.T else rows[:self._state]

    def _combine_flat(self, expert_out: torch.Tensor) -> torch.Tensor:
        return expert_out

    def close(self) -> None:
        self._bufs.clear()
        self._state = None
