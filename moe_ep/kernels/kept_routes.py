"""Route buffers one caller keeps between its calls (the layer's bridged compute: LL RANK_MAJOR, HT FLAT), so that
a forward routes with no torch op of its own.

A route's int32 parts (slots, source rows, counts, offsets, the chain counters, the chunked launches' histograms)
are cut once from one allocation sized for ``capacity`` picks; per shape of ids, the route of views into them is made
once too and kept (views hold no memory of their own, so keeping one per batch size costs nothing on the device).
Each route launch overwrites them: a kept route is read only until the caller's next one (one forward at a time,
kernels in stream order). The allocation is never replaced, so a CUDA graph captured with it stays valid, and it is
not made inside a capture (its memory would belong to the graph's pool).
"""

from __future__ import annotations

import math

import torch

from .bridge import Route, _pieces, _route_chunks


class KeptRoutes:
    """Routes of up to ``capacity`` picks (ids ``[..., K]``, rows flattened) into ``L`` local experts on ``device``,
    with chain counters (``Route.chain_ready``), in buffers kept between calls (module doc)."""

    def __init__(self, capacity: int, L: int, device: torch.device):
        self.capacity, self.L, self.device = capacity, L, torch.device(device)
        self.scratch: dict = {}  # the chunked launches' histograms ([C, LP] for up to capacity picks)
        self._parts = None  # (slots, source rows, counts, offsets, chain counters): made at the first route
        self._routes: dict = {}  # ids' shape -> Route of views into _parts

    def route(self, idx: torch.Tensor) -> Route | None:
        """The kept route for ids of ``idx``'s shape (to be launched into: its values are the last launch's), or
        None where none can be kept: no picks, more than ``capacity``, or the buffers not made yet while a CUDA graph
        is being captured."""
        r = self._routes.get(idx.shape)
        if r is None:
            r = self._make(idx.shape)
        return r

    def _make(self, shape: torch.Size) -> Route | None:
        K = shape[-1]
        M = math.prod(shape[:-1])
        if M * K == 0 or M * K > self.capacity:
            return None
        if self._parts is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            self._parts = self._allocate()
        slots, rows, counts, offsets, ready = self._parts
        r = self._routes[shape] = Route._made(counts, offsets, slots[:M * K].view(M, K), rows[:M * K], None, ready)
        return r

    def _allocate(self) -> tuple:
        cap, L = self.capacity, self.L
        sizes = [cap, cap, L, L + 1, L]
        C, LP = _route_chunks(cap, L)[1:]  # (the chunked launches of up to cap ids: their histograms)
        if C > 1:
            sizes.append(C * LP)
        p = _pieces(sizes, torch.int32, self.device)
        if C > 1:
            self.scratch["hist"] = p[5].view(C, LP)
        return tuple(p[:5])
