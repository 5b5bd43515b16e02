"""The portable transport: dispatch/combine over torch.distributed ``all_to_all_single``.

Works with any process group (gloo on CPU, nccl on GPU, gloo with CUDA tensors staged through host
memory) and with no group at all (world size 1: no collectives, no host sync, CUDA-graph capturable).

How a step goes (world size R > 1):

1. dispatch: every token is sent once to each rank owning one of its picks (ascending token order per
   destination), with its K ids made local to that rank (-1 elsewhere) and its K weights. Per-destination
   token and pick counts are exchanged first; their split sizes are needed on the host, so **each dispatch
   and each combine costs one device->host sync** on this transport (accepted: it is the portable one).
2. The receiver holds the rows *compact* (source-rank segments, token order within), and builds the
   layout its config asks for (DESIGN.md's contract) from them on the device.
3. combine: RANK_MAJOR / FLAT / HT EXPERT_MAJOR send one pre-reduced row per received token back and the
   owner sums them in fp32; LL EXPERT_MAJOR sends one row per pick and the owner applies the routing
   weights (the receive side), in fp32.

NVFP4 activations: dispatch quantizes each token with its own global scale (or the config's static one;
``quantize_nvfp4_tokens``, on the device) and ships packed codes + e4m3 scales + that scale; the received
``tokens`` are an ``NvFp4Tensor`` whose ``global_scale`` holds one value per row (shape ``tokens.shape[:-1]``).

FP8 activations: dispatch quantizes each token once (``quantize_fp8``, one fp32 scale per 128 channels, on the
device) and ships the e4m3 bytes + those scales (no bf16 round trip); the received ``tokens`` are an ``Fp8Tensor``
(block_rows 1) with scales ``[..., ceil(H/128)]`` beside the rows. Both travel as their row parts
(``moe_ep.kernels.row_parts``): one code path packs, receives and lays out every format. Combine stays bf16.

Buffers are allocated once per transport (at their largest size) and reused; the tensors a dispatch
returns are views of them, valid until the next dispatch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import EpConfig, Format
from ..errors import MoEEpConfigError
from ..kernels.bridge import Route, permute_rows, route_experts, unpermute_reduce
from ..kernels.fp8 import quantize_fp8
from ..kernels.nvfp4 import quantize_nvfp4_tokens
from ..kernels.row_parts import from_row_parts, payload_type, reshape_rows, row_part_specs, row_parts
from ..layout_contract import (DispatchResult, HighThroughputExpertMajor, HighThroughputFlat, LowLatencyExpertMajor,
                               LowLatencyRankMajor, result_type)
from ..rank_agreement import raise_if_peer_failed
from ..triton_runtime import device as kernel_device
from .base import group_rank_world
from .world_one import WorldOneLayouts


class TorchDistTransport:
    """Dispatch/combine for one :class:`EpConfig` over ``group`` (see the module docstring)."""

    name = "torch"

    def __init__(self, config: EpConfig, group=None, *, device: torch.device | None = None):
        self.config, self.group = config, group
        self.rank, self.world = group_rank_world(group)
        self.graph_capturable = self.world == 1  # with more ranks the split sizes go through the host
        self.replayable = self.world == 1  # no collective, no host sync: kernels and torch ops alone
        self.L = config.local_experts(self.world)
        self.device = torch.device(device) if device is not None else kernel_device()
        self.nvfp4 = config.activation_format is Format.NVFP4
        self.fp8 = config.activation_format is Format.FP8
        # the payload's row parts (moe_ep.kernels.row_parts): packed, received and laid out one by one
        self.payload = payload_type(self.nvfp4, self.fp8)
        self.part_specs = {f"part{i}": spec for i, spec in enumerate(row_part_specs(self.payload, config.hidden_size))}
        self.stage = False
        if self.world > 1:
            backend = dist.get_backend(group)
            if self.device.type == "cuda" and backend != "nccl":
                self.stage = True  # e.g. gloo: CUDA tensors go through host memory
            elif self.device.type == "cpu" and backend == "nccl":
                raise MoEEpConfigError("transport group backend = 'nccl' with CPU tensors; allowed: gloo on CPU")
        self._bufs: dict[str, torch.Tensor] = {}
        self._state = None
        # world size 1: nothing to exchange; the layouts come from the caller's tensors (world_one.py)
        self._local = WorldOneLayouts(config, self.device) if self.world == 1 else None
        # the layout, chosen once: how the compact received rows become its result, and, except where combine
        # applies the routing weights itself (LL EXPERT_MAJOR), how the compute's output becomes one row per
        # received token to send back
        kind = result_type(config)
        if kind is LowLatencyExpertMajor and self.L * config.max_tokens_per_rank * self.world >= 2 ** 31:
            raise MoEEpConfigError(f"EpConfig.max_tokens_per_rank = {config.max_tokens_per_rank}; allowed: local "
                                   f"experts ({self.L}) * world size ({self.world}) * max_tokens_per_rank < 2**31 "
                                   "(LL EXPERT_MAJOR's padded rows are int32)")
        self._build = {LowLatencyExpertMajor: self._ll_expert_major, LowLatencyRankMajor: self._ll_rank_major,
                       HighThroughputFlat: self._ht_flat, HighThroughputExpertMajor: self._ht_expert_major}[kind]
        self._combine = self._combine_picks if kind.weights_applied_by_combine else self._combine_rows
        if self._local is not None:
            self._combine = self._local.combine
        self._rows = {LowLatencyRankMajor: self._rank_major_rows, HighThroughputFlat: self._flat_rows,
                      HighThroughputExpertMajor: self._slot_rows}.get(kind)

    def _const(self, name: str, make) -> torch.Tensor:
        """A tensor that depends on the config alone, made once (``make()``) and kept with the buffers."""
        t = self._bufs.get(name)
        if t is None:
            t = self._bufs[name] = make()
        return t

    def _buf(self, name: str, shape, dtype) -> torch.Tensor:
        """A persistent buffer (allocated once at this size, zeroed so garbage rows stay finite)."""
        b = self._bufs.get(name)
        if b is None or tuple(b.shape) != tuple(shape) or b.dtype != dtype:
            b = self._bufs[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        return b

    # ---- the exchange ---------------------------------------------------------------------------------
    def _a2a(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], name: str) -> torch.Tensor:
        width = send.shape[1]
        rows = self.config.max_tokens_per_rank * self.world * max(self.config.top_k, 1)
        out = self._buf(name, (rows, width), send.dtype)[:sum(recv_splits)]
        if self.stage:
            host = torch.empty(out.shape, dtype=out.dtype)
            dist.all_to_all_single(host, send.cpu(), recv_splits, send_splits, group=self.group)
            out.copy_(host)
        else:
            dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=self.group)
        return out

    def _pack(self, x, q, rows: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Byte rows: the token's row parts (bf16; NVFP4 codes, scales, global scale; FP8 codes, scales), K int32 ids,
        K fp32 weights."""
        parts = [p[rows].view(torch.uint8) for p in row_parts(x if q is None else q, broadcast_shared=True)]
        parts += [ids.to(torch.int32).view(torch.uint8), w.float().contiguous().view(torch.uint8)]
        return torch.cat(parts, dim=1)

    def _unpack_into_compact(self, recv: torch.Tensor, n: int) -> None:
        K = self.config.top_k
        c, o = self._compact(), 0
        for name, (width, dtype) in (*self.part_specs.items(), ("ids", (K, torch.int32)), ("w", (K, torch.float32))):
            nbytes = width * dtype.itemsize
            c[name][:n] = recv[:, o:o + nbytes].clone(memory_format=torch.contiguous_format).view(dtype)  # aligned
            o += nbytes

    def _compact(self) -> dict[str, torch.Tensor]:
        """Received rows, compact: [R*T, ...] (rows past the received count are stale): the payload's row parts
        (e4m3 as uint8 bytes, what the gathers and the exchange move), ids, weights."""
        K, M = self.config.top_k, self.config.max_tokens_per_rank * self.world
        c = {name: self._buf("c_" + name, (M, width), dtype) for name, (width, dtype) in self.part_specs.items()}
        c.update(ids=self._buf("c_ids", (M, K), torch.int64), w=self._buf("c_w", (M, K), torch.float32))
        return c

    # ---- dispatch -------------------------------------------------------------------------------------
    def dispatch(self, hidden_states: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchResult:
        """Send tokens to the ranks owning their picks; returns the config's layout (module docstring)."""
        x, B = hidden_states, hidden_states.shape[0]
        q = None
        if self.nvfp4:  # one global scale per token, on the device
            q = quantize_nvfp4_tokens(x, self.config.activation_global_scale)
        elif self.fp8:  # once, before the exchange; non-finite tokens: the layer's validate refuses them
            q = quantize_fp8(x, 1, check_finite=False)
        if self._local is not None:  # no exchange, no sync
            return self._local.dispatch(x, q, topk_idx, topk_weights)
        c = self._compact()
        R, L = self.world, self.L
        st = {"B": B, "topk_weights": topk_weights}
        idx = topk_idx.long()
        owner = torch.where((idx >= 0) & (idx < self.config.num_experts), idx // L, -1)  # else: no expert
        hit = owner[:, :, None] == torch.arange(R, device=self.device)  # [B, K, R]
        to_dst = hit.any(1)                                              # [B, R]
        counts = torch.stack([to_dst.sum(0), hit.sum((0, 1))], 1)        # tokens, picks per dst
        recv_counts = torch.empty_like(counts)
        self._a2a_counts(counts, recv_counts)
        host = torch.cat([counts, recv_counts], 1).tolist()  # the one host sync of this dispatch
        send_tok, send_pick = [h[0] for h in host], [h[1] for h in host]
        n_from, recv_pick = [h[2] for h in host], [h[3] for h in host]
        if min(n_from) < 0:  # a rank failed its forward checks and sent a marker instead (moe_ep.rank_agreement)
            raise_if_peer_failed(n_from, self.group, self.rank, self.world, self.device)
        d_idx, b_idx = to_dst.T.nonzero(as_tuple=True)  # dst-major, tokens ascending
        local = torch.where(owner[b_idx] == d_idx[:, None], idx[b_idx] - d_idx[:, None] * L, -1)
        send = self._pack(x, q, b_idx, local, topk_weights[b_idx])
        recv = self._a2a(send, send_tok, n_from, "recv_dispatch")
        self._unpack_into_compact(recv, sum(n_from))
        n_total = torch.full((1,), sum(n_from), dtype=torch.int64, device=self.device)
        st.update(to_dst=to_dst, owner=owner, send_tok=send_tok, send_pick=send_pick, recv_pick=recv_pick)
        st["n_from"] = n_from
        self._state = st
        return self._build(c, n_total, st)

    def _a2a_counts(self, counts: torch.Tensor, out: torch.Tensor) -> None:
        if self.stage:
            host = torch.empty(out.shape, dtype=out.dtype)
            dist.all_to_all_single(host, counts.cpu(), group=self.group)
            out.copy_(host)
        else:
            dist.all_to_all_single(out, counts, group=self.group)

    def _tokens(self, c, shape=None):
        """The payload (bf16, NvFp4Tensor with per-row global scale, or per-row Fp8Tensor) of row parts ``c``,
        optionally with its rows reshaped to ``shape``."""
        tokens = from_row_parts(self.payload, [c[name] for name in self.part_specs])
        return tokens if shape is None else reshape_rows(tokens, shape)

    # ---- the layouts: compact rows -> the contract's result type ------------------------------------------
    def _ht_flat(self, c, n_total: torch.Tensor, st) -> HighThroughputFlat:
        return HighThroughputFlat(self._tokens(c), topk_idx=c["ids"], topk_weights=c["w"], num_recv=n_total[0])

    def _ll_rank_major(self, c, n_total: torch.Tensor, st) -> LowLatencyRankMajor:
        R, T, K = self.world, self.config.max_tokens_per_rank, self.config.top_k
        rm = self._to_rank_major(c, st["n_from"])
        counts = torch.tensor(st["n_from"], dtype=torch.int32, device=self.device)
        return LowLatencyRankMajor(self._tokens(rm, shape=(R, T)), topk_idx=rm["ids"].view(R, T, K).to(torch.int32),
                                   topk_weights=rm["w"].view(R, T, K), src_rank_counts=counts)

    def _route(self, c, n_total: torch.Tensor, st) -> Route:
        """The received picks routed to the local experts (the expert-major layouts group rows by it)."""
        route = st["route"] = route_experts(c["ids"], self.L, valid_rows=n_total,
                                            rows_per_group=self.config.max_tokens_per_rank * self.world)
        return route

    def _ht_expert_major(self, c, n_total: torch.Tensor, st) -> HighThroughputExpertMajor:
        S = self.config.max_tokens_per_rank * self.world * self.config.top_k
        route = self._route(c, n_total, st)
        slot = route.slot.reshape(-1).long()
        w_slot = self._buf("em_w", (S + 1,), torch.float32)
        w_slot.index_copy_(0, torch.where(slot >= 0, slot, S), c["w"].reshape(-1))
        pc = {name: permute_rows(c[name], route, out=self._buf("em_" + name, (S, width), dtype))
              for name, (width, dtype) in self.part_specs.items()}
        return HighThroughputExpertMajor(self._tokens(pc), expert_offsets=route.offsets[:-1].long(),
                                         expert_counts=route.counts.long(), topk_weights=w_slot[:S],
                                         num_recv=route.offsets[-1].long())

    def _ll_expert_major(self, c, n_total: torch.Tensor, st) -> LowLatencyExpertMajor:
        """Expert e's rows packed at [e, 0:count), in (source rank, token) order."""
        L, K, M = self.L, self.config.top_k, self.config.max_tokens_per_rank * self.world
        route = self._route(c, n_total, st)
        e = c["ids"].clamp(0, L - 1)
        # pick -> its padded row e * M + (slot - offsets[e]): int32 throughout (L * M fits: the config checks it)
        first_row = self._const("ll_first_row", lambda: torch.arange(L, dtype=torch.int32, device=self.device) * M)
        dest = torch.where(route.slot >= 0, route.slot + (first_row - route.offsets[:L])[e], -1)
        st["dest"] = dest  # -1: no local expert (combine skips it)
        flat = torch.where(dest >= 0, dest, L * M).reshape(-1).long()  # invalid picks -> a spare row
        src_rows = self._const("ll_src_rows",
                               lambda: torch.arange(M, device=self.device).repeat_interleave(K))  # pick -> its row

        def scatter(name, src, width, dtype):
            buf = self._buf(name, (L * M + 1, width), dtype)
            buf.index_copy_(0, flat, src[src_rows].reshape(-1, width))
            return buf[:L * M]
        em = {name: scatter("ll_" + name, c[name], width, dtype) for name, (width, dtype) in self.part_specs.items()}
        return LowLatencyExpertMajor(self._tokens(em, shape=(L, M)), expert_counts=route.counts)

    def _to_rank_major(self, c, n_from: list[int]) -> dict[str, torch.Tensor]:
        T, R = self.config.max_tokens_per_rank, self.world
        rm, o = {}, 0
        for k, v in c.items():
            rm[k] = self._buf("rm_" + k, v.shape, v.dtype)
            rm[k].view(R, T, -1)[:] = 0 if k != "ids" else -1
        for s, n in enumerate(n_from):
            for k, v in c.items():
                rm[k][s * T:s * T + n] = v[o:o + n]
            o += n
        return rm

    # ---- combine --------------------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` bf16 in the original token order from the compute's output for the last dispatch."""
        return self._combine(expert_out)

    def _combine_picks(self, expert_out: torch.Tensor) -> torch.Tensor:
        """LL EXPERT_MAJOR: one row per pick goes back and the owner applies the routing weights, in fp32."""
        st, cfg = self._state, self.config
        R, L, T, B, H = self.world, self.L, cfg.max_tokens_per_rank, st["B"], cfg.hidden_size
        y = expert_out.reshape(L * R * T, H)
        flat = st["dest"].reshape(-1).long()
        send = y[flat[flat >= 0]]  # one row per received pick, in compact order
        ret = self._a2a(send, st["recv_pick"], st["send_pick"], "recv_combine")
        owner, K = st["owner"], cfg.top_k
        onehot = (owner.reshape(-1, 1) == torch.arange(R, device=self.device)).long()
        rank_in_dst = onehot.cumsum(0) - 1
        base = torch.tensor([0] + st["send_pick"][:-1], device=self.device).cumsum(0)
        oc = owner.reshape(-1).clamp(min=0)
        pos = base[oc] + rank_in_dst.gather(1, oc[:, None]).reshape(-1)
        pick = Route(None, None, torch.where(owner.reshape(-1) >= 0, pos, -1).reshape(B, K).to(torch.int32), None)
        return unpermute_reduce(ret, pick, st["topk_weights"])

    def _rank_major_rows(self, expert_out: torch.Tensor, st) -> torch.Tensor:
        R, T = self.world, self.config.max_tokens_per_rank
        rm = expert_out.reshape(R, T, self.config.hidden_size)
        return torch.cat([rm[s, :n] for s, n in enumerate(st["n_from"])])

    def _flat_rows(self, expert_out: torch.Tensor, st) -> torch.Tensor:
        return expert_out.reshape(-1, self.config.hidden_size)

    def _slot_rows(self, expert_out: torch.Tensor, st) -> torch.Tensor:
        """HT EXPERT_MAJOR: a token's slots summed back into its row (the slots are already weighted)."""
        return unpermute_reduce(expert_out.reshape(-1, self.config.hidden_size), st["route"])

    def _combine_rows(self, expert_out: torch.Tensor) -> torch.Tensor:
        """One pre-reduced row per received token goes back; the owner sums them in fp32."""
        st, H = self._state, self.config.hidden_size
        rows = self._rows(expert_out, st)  # compact order: source-rank segments, token order within
        ret = self._a2a(rows[:sum(st["n_from"])].to(torch.bfloat16), st["n_from"], st["send_tok"], "recv_combine")
        to_dst = st["to_dst"]  # [B, R]: ret holds, per dst in order, one row per token sent there
        base = torch.tensor([0] + st["send_tok"][:-1], device=self.device).cumsum(0)
        pos = torch.where(to_dst, base[None, :] + to_dst.long().cumsum(0) - 1, ret.shape[0])
        ext = torch.cat([ret, ret.new_zeros(1, H)])
        return ext[pos.T].float().sum(0).to(torch.bfloat16)  # fixed order over ranks: deterministic

    def close(self) -> None:
        """Drop the buffers (the process group belongs to the caller)."""
        self._bufs.clear()
        self._state = None
        if self._local is not None:
            self._local.close()
