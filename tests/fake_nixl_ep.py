"""A recording, checking stand-in for ``nixl_ep_cu13`` (nixl-cu13 1.5.1) -- for CONTRACT tests, not integration.

Same names and signatures as ``nixl_ep_cu13/buffer.py`` (``Buffer.__init__``, ``get_rdma_size_hint``,
``update_memory_buffers``, ``connect_ranks``, ``low_latency_dispatch``, ``low_latency_combine``, ``destroy``);
checks the asserts compiled into ``nixl_ep_cpp_torch21x*.so`` and, at world size 1, moves the data.
"""

from __future__ import annotations

import types

import torch

from fake_nccl_ep import ContractViolation, ds_fp8e3m4, need

calls: list = []


class EventOverlap:
    def __init__(self, event=None, extra_tensors=None):
        self.event = event

    def current_stream_wait(self):
        pass


class Buffer:
    num_sms = 20

    def __init__(self, disable_ll_nvlink=False, explicitly_destroy=False, rank=0, low_latency_mode=True,
                 group=None, comm=None, tcp_store_group=None, timeout_ms=30_000):
        calls.append(("Buffer", rank, low_latency_mode, explicitly_destroy))
        need(not (group and comm), "assert not (group and comm)")
        need(low_latency_mode, "moe-ep uses nixl-ep in low-latency mode only")
        need(tcp_store_group is not None, "moe-ep passes a TCP store for metadata exchange")
        self.rank, self.explicitly_destroy, self.runtime = rank, explicitly_destroy, object()
        self.group_size, self.connected = 0, None

    @staticmethod
    def get_low_latency_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        return 2 * num_max_dispatch_tokens_per_rank * hidden * num_ranks * 4

    @staticmethod
    def get_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        calls.append(("get_rdma_size_hint", num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts))
        return Buffer.get_low_latency_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                       num_experts)

    def update_memory_buffers(self, num_ranks, num_experts_per_rank, num_rdma_bytes, num_nvl_bytes=0):
        calls.append(("update_memory_buffers", num_ranks, num_experts_per_rank, num_rdma_bytes))
        need(num_ranks > 0 and 0 <= self.rank < num_ranks, "0 <= rank and rank < num_ranks")
        self.group_size, self.L, self.rdma = num_ranks, num_experts_per_rank, num_rdma_bytes

    def connect_ranks(self, remote_ranks, activate=True):
        calls.append(("connect_ranks", list(remote_ranks)))
        need(self.group_size > 0, "connect_ranks before update_memory_buffers")
        self.connected = sorted(set(remote_ranks) - {self.rank})

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts=None,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        calls.append(("low_latency_dispatch", x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8))
        need(self.runtime is not None and self.connected is not None, "dispatch on an unconnected buffer")
        R, T = self.group_size, num_max_dispatch_tokens_per_rank
        need(x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16, "x must be contiguous bf16 [B, H]")
        need((x.size(1) * x.element_size()) % 16 == 0, "(hidden * x.element_size()) % sizeof(int4) == 0")
        need(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx.dim() == 2 and topk_idx.is_contiguous()")
        need(topk_idx.dtype == topk_idx_t, "topk_idx.scalar_type() == c10::CppTypeToScalarType<topk_idx_t>::value")
        need(x.size(0) == topk_idx.size(0) and x.size(0) <= T,
             "x.size(0) == topk_idx.size(0) and x.size(0) <= num_max_dispatch_tokens_per_rank")
        need((R * T) % 4 == 0, "num_ranks * num_max_dispatch_tokens_per_rank must be a multiple of 4")
        need(num_experts == self.L * R, "num_experts must equal num_ranks * num_experts_per_rank")
        need(not async_finish and not return_recv_hook, "moe-ep runs dispatch synchronously on the stream")
        if use_fp8:
            need(x.size(1) % 512 == 0, "hidden % 512 == 0")
            need(not round_scale and not use_ue8m0, "moe-ep contract: fp32 scales amax / 448 (round_scale off)")
        B, H, L = x.size(0), x.size(1), self.L
        recv = torch.full((L, R * T, H), float("nan"), dtype=torch.bfloat16)
        count = torch.zeros(L, dtype=torch.int32)
        rows = [[] for _ in range(L)]
        if R == 1:
            for e in range(L):
                rows[e] = [b for b in range(B) if (topk_idx[b] == e).any()]
                count[e] = len(rows[e])
                for j, b in enumerate(rows[e]):
                    recv[e, j] = x[b]
        handle = (rows, torch.zeros(L, R, dtype=torch.int64), T, H)
        self.last = (B, L, R * T, H)
        if use_fp8:  # e4m3 rows and their fp32 scales, column-major in the last two dims (allocated [L, H/128, R*T])
            data = torch.full((L, R * T, H), float("nan")).to(torch.float8_e4m3fn)
            scales = torch.full((L, H // 128, R * T), float("nan")).transpose(1, 2)
            if R == 1:
                q, s = ds_fp8e3m4(x)   # the same DeepEP cast as NCCL-EP's DS_FP8E3M4
                for e in range(L):
                    for j, b in enumerate(rows[e]):
                        data[e, j], scales[e, j] = q[b], s[b]
            recv = (data, scales)
        return recv, count, handle, EventOverlap(), None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
        calls.append(("low_latency_combine", x, topk_idx, topk_weights, out))
        B, L, RT, H = self.last
        need(tuple(x.shape) == (L, RT, H) and x.dtype == torch.bfloat16, "x: [L, R*T, H] bf16")
        need(topk_idx.dim() == 2 and topk_idx.dtype == topk_idx_t and topk_idx.size(0) == B, "topk_idx [B, K]")
        need(topk_weights.dtype == torch.float32 and topk_weights.shape == topk_idx.shape,
             "topk_idx.size(0) == topk_weights.size(0) and topk_idx.size(1) == topk_weights.size(1)")
        need(not use_logfmt and not zero_copy and not async_finish and not return_recv_hook, "plain combine")
        need(out is None or (tuple(out.shape) == (B, H) and out.dtype == torch.bfloat16),
             "out->size(0) == num_combined_tokens and out->size(1) == hidden")
        rows = handle[0]
        acc = torch.zeros(B, H)
        if self.group_size == 1:
            for e in range(L):
                for j, b in enumerate(rows[e]):
                    for k in range(topk_idx.size(1)):
                        if topk_idx[b, k] == e:
                            acc[b] += topk_weights[b, k] * x[e, j].float()
        res = out if out is not None else torch.empty(B, H, dtype=torch.bfloat16)
        res.copy_(acc.to(torch.bfloat16))
        return res, EventOverlap(), None

    def destroy(self):
        calls.append(("destroy",))
        need(self.explicitly_destroy, "`explicitly_destroy` flag must be set")
        self.runtime = None


topk_idx_t = torch.int32


def make_module():
    """A fresh ``nixl_ep_cu13``-shaped module object; resets the call log."""
    calls.clear()
    m = types.ModuleType("nixl_ep_cu13")
    m.Buffer, m.EventOverlap, m.topk_idx_t, m.calls = Buffer, EventOverlap, topk_idx_t, calls
    m.ContractViolation = ContractViolation
    return m
