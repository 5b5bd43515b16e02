"""The portable transport at world size 1: every layout built from the caller's own tensors by the bridge kernels.

Nothing moves between ranks, so dispatch is the layout alone and combine the way back, with as few launches as the
layout allows (each torch op or kernel launch costs host time an eager forward pays; tests/test_launch_path.py
bounds them):

* LL EXPERT_MAJOR: one route launch gives each pick its padded row ``e * T + j`` (``route_experts(padded_rows=T)``),
  one scatter launch writes the token rows there; combine is one weighted unpermute-reduce over those rows.
* LL RANK_MAJOR: the tokens, ids (int32) and weights (fp32) as ``[1, T, ...]`` (the contract's T is
  ``max_tokens_per_rank``): the caller's tensors when the batch is T tokens, else copied into buffers; combine is a
  view of the compute's rows.
* HT FLAT: the caller's tensors as they are (S = B received rows; int32 ids widened, weights made fp32).
* HT EXPERT_MAJOR: one route (its counts and offsets written as int64, each slot's weight written by the same
  launch) and one gather; combine is one unpermute-reduce.

Ids outside ``[0, E)`` are no expert, as on every path of this transport: the route skips them (compared in their
own type, int64 ids of 2**31 and more included), and the layouts that carry ids (RANK_MAJOR narrowed to int32 after
clamping to ``[-1, E]``, FLAT as they are) hand them to a compute whose route skips them too.

NVFP4 and FP8 activations: the tokens arrive quantized (``q``, an ``NvFp4Tensor`` with one global scale per row, or
an ``Fp8Tensor`` with one fp32 scale per row per 128 channels, from the transport's dispatch); the layouts move its
codes and scales as they are.

Buffers the layouts return live until the next dispatch (views of persistent buffers, or new tensors).
"""

from __future__ import annotations

import torch

from ..config import EpConfig
from ..kernels.bridge import Route, _gather, _launch_route, _scatter, _unpermute
from ..kernels.fp8 import FP8_BLOCK, Fp8Tensor
from ..kernels.nvfp4 import NvFp4Tensor
from ..layout_contract import (HighThroughputExpertMajor, HighThroughputFlat, LowLatencyExpertMajor,
                               LowLatencyRankMajor, result_type)


class WorldOneLayouts:
    """Dispatch and combine of one :class:`EpConfig` at world size 1 (module doc). ``dispatch(x, q, idx, w)``:
    ``x [B, H]`` bf16, ``q`` its NVFP4 or FP8 form or None, ``idx [B, K]`` int32/int64 global (= local) ids, ``w [B, K]``
    float, all checked by the layer; ``combine(y)``: the compute's output for the last dispatch -> ``[B, H]`` bf16."""

    def __init__(self, config: EpConfig, device: torch.device):
        self.config, self.device = config, device
        self.L, self.T, self.K, self.H = (config.num_experts, config.max_tokens_per_rank, config.top_k,
                                          config.hidden_size)
        self.S = -(-self.H // FP8_BLOCK)  # an FP8 row's scales
        self._bufs: dict = {}
        self._state = None  # what combine needs of the last dispatch
        kind = result_type(config)
        self.dispatch = {LowLatencyExpertMajor: self._ll_expert_major, LowLatencyRankMajor: self._ll_rank_major,
                         HighThroughputFlat: self._ht_flat, HighThroughputExpertMajor: self._ht_expert_major}[kind]
        self.combine = {LowLatencyExpertMajor: self._combine_weighted, LowLatencyRankMajor: self._combine_rank_major,
                        HighThroughputFlat: self._combine_flat, HighThroughputExpertMajor: self._combine_slots}[kind]

    def _kept(self, key, make):
        """``make()``, made once per ``key`` and kept; not kept when made inside a CUDA-graph capture (its values
        would then exist only in the graph's replays, and an eager forward would read garbage)."""
        t = self._bufs.get(key)
        if t is None:
            t = make()
            if not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._bufs[key] = t
        return t

    def _buf(self, name, shape, dtype) -> torch.Tensor:
        """A persistent buffer (zeroed, so garbage rows stay finite)."""
        return self._kept(name, lambda: torch.zeros(shape, dtype=dtype, device=self.device))

    def _count(self, n: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """A device tensor holding ``n`` (a count the host knows: the batch), made once per value."""
        return self._kept(("count", n, dtype, shape), lambda: torch.full(shape, n, dtype=dtype, device=self.device))

    def _route(self, idx, pad_rows: int = 0, weights=None, index_dtype=torch.int32) -> Route:
        """The route of ``idx [B, K]`` into buffers kept per batch size (this layout routes every B the same way)."""
        B, L, K, dev = idx.shape[0], self.L, self.K, self.device

        def make():
            sw = None if weights is None else torch.empty(L * pad_rows if pad_rows else B * K, dtype=torch.float32,
                                                          device=dev)
            return (Route._made(torch.zeros(L, dtype=index_dtype, device=dev),  # zeros: B = 0 launches nothing
                                torch.zeros(L + 1, dtype=index_dtype, device=dev),
                                torch.empty(B, K, dtype=torch.int32, device=dev),
                                None if pad_rows else torch.empty(B * K, dtype=torch.int32, device=dev), sw), {})
        route, scratch = self._kept(("route", B), make)
        if B:
            _launch_route(idx.contiguous(), None, 1, self.L, route, pad_rows=pad_rows,
                          weights=None if weights is None else weights.contiguous(), scratch=scratch)
        return route

    # ---- dispatch ------------------------------------------------------------------------------------------
    def _ll_expert_major(self, x, q, idx, w) -> LowLatencyExpertMajor:
        L, T, H = self.L, self.T, self.H
        route = self._route(idx, pad_rows=T)
        slot = route.slot
        if q is None:
            tok = self._buf("tok", (L * T, H), torch.bfloat16)
            _scatter(x, slot, tok)
            tokens = tok.view(L, T, H)
        elif isinstance(q, Fp8Tensor):
            data, scales = self._buf("data", (L * T, H), torch.uint8), self._buf("sc", (L * T, self.S), torch.float32)
            _scatter(q.data.view(torch.uint8), slot, data)
            _scatter(q.scales, slot, scales)
            tokens = Fp8Tensor(data.view(torch.float8_e4m3fn).view(L, T, H), scales.view(L, T, self.S), 1)
        else:
            data, scales = self._buf("data", (L * T, H // 2), torch.uint8), self._buf("sc", (L * T, H // 16), torch.uint8)
            gs = self._buf("gs", (L * T, 1), torch.float32)
            _scatter(q.data, slot, data)
            _scatter(q.scales.view(torch.uint8), slot, scales)
            _scatter(q.global_scale.view(-1, 1), slot, gs)
            tokens = NvFp4Tensor(data.view(L, T, H // 2), scales.view(torch.float8_e4m3fn).view(L, T, H // 16),
                                 gs.view(L, T), torch.Size((L, T, H)))
        self._state = (slot, w.contiguous())
        return LowLatencyExpertMajor(tokens, expert_counts=route.counts)

    def _rows(self, name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t [B, ...]`` as the first B of the contract's T rows, in ``dtype``: ``t`` itself when B = T (converted
        if it must be), else copied into a buffer whose rows past B are garbage."""
        if t.shape[0] == self.T:
            return t if t.dtype is dtype else t.to(dtype)
        buf = self._buf(name, (self.T, *t.shape[1:]), dtype)
        buf[:t.shape[0]] = t
        return buf

    def _ll_rank_major(self, x, q, idx, w) -> LowLatencyRankMajor:
        B, T, H = x.shape[0], self.T, self.H
        if idx.dtype is not torch.int32:  # never narrowed onto another expert
            idx = idx.clamp(-1, self.config.num_experts)
        ids, wts = self._rows("ids", idx, torch.int32), self._rows("w", w, torch.float32)
        if q is None:
            tokens = self._rows("tok", x, torch.bfloat16).unsqueeze(0)
        elif isinstance(q, Fp8Tensor):
            data = self._rows("data", q.data.view(torch.uint8), torch.uint8).view(torch.float8_e4m3fn)
            tokens = Fp8Tensor(data.unsqueeze(0), self._rows("sc", q.scales, torch.float32).unsqueeze(0), 1)
        else:
            data, scales = self._rows("data", q.data, torch.uint8), self._rows("sc", q.scales.view(torch.uint8),
                                                                               torch.uint8)
            tokens = NvFp4Tensor(data.unsqueeze(0), scales.view(torch.float8_e4m3fn).unsqueeze(0),
                                 self._rows("gs", q.global_scale, torch.float32).unsqueeze(0), torch.Size((1, T, H)))
        self._state = B
        return LowLatencyRankMajor(tokens, topk_idx=ids.unsqueeze(0), topk_weights=wts.unsqueeze(0),
                                   src_rank_counts=self._count(B, torch.int32, (1,)))

    def _ht_flat(self, x, q, idx, w) -> HighThroughputFlat:
        B = x.shape[0]
        return HighThroughputFlat(x if q is None else q, topk_idx=idx if idx.dtype is torch.int64 else idx.long(),
                                  topk_weights=w if w.dtype is torch.float32 else w.float(),
                                  num_recv=self._count(B, torch.int64, ()))

    def _ht_expert_major(self, x, q, idx, w) -> HighThroughputExpertMajor:
        L = self.L
        route = self._route(idx, weights=w, index_dtype=torch.int64)
        if q is None:
            tokens = _gather(x, route)
        elif isinstance(q, Fp8Tensor):
            tokens = Fp8Tensor(_gather(q.data.view(torch.uint8), route).view(torch.float8_e4m3fn), _gather(q.scales, route),
                               1)
        else:
            gs = _gather(q.global_scale.view(-1, 1), route)
            tokens = NvFp4Tensor(_gather(q.data, route), _gather(q.scales.view(torch.uint8), route).view(q.scales.dtype),
                                 gs.view(-1), torch.Size((gs.shape[0], self.H)))
        self._state = route.slot
        offsets = route.offsets
        return HighThroughputExpertMajor(tokens, expert_offsets=offsets[:L], expert_counts=route.counts,
                                         topk_weights=route.slot_weight, num_recv=offsets[L])

    # ---- combine -------------------------------------------------------------------------------------------
    def _combine_weighted(self, expert_out: torch.Tensor) -> torch.Tensor:
        """LL EXPERT_MAJOR: each token's picks summed back with their routing weights, in fp32."""
        slot, w = self._state
        out = torch.empty(slot.shape[0], self.H, dtype=torch.bfloat16, device=self.device)
        return _unpermute(expert_out.reshape(-1, self.H), slot, w, out)

    def _combine_rank_major(self, expert_out: torch.Tensor) -> torch.Tensor:
        rows = expert_out.reshape(self.T, self.H)
        return rows if self._state == self.T else rows[:self._state]

    def _combine_flat(self, expert_out: torch.Tensor) -> torch.Tensor:
        return expert_out

    def _combine_slots(self, expert_out: torch.Tensor) -> torch.Tensor:
        """HT EXPERT_MAJOR: a token's slots (already weighted) summed back into its row, in fp32."""
        slot = self._state
        out = torch.empty(slot.shape[0], self.H, dtype=torch.bfloat16, device=self.device)
        return _unpermute(expert_out.reshape(-1, self.H), slot, None, out)

    def close(self) -> None:
        self._bufs.clear()
        self._state = None
