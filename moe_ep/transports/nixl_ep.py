"""NIXL-EP transport: ``nixl_ep_cu13.Buffer`` from the ``nixl-cu13`` wheel (1.5.1), low-latency mode.

Supported: LOW_LATENCY + EXPERT_MAJOR with bf16 activations (``low_latency_dispatch(..., use_fp8=False)``
returns ``[L, R*T, H]`` bf16 rows and ``[L]`` int32 counts; ``low_latency_combine`` applies the routing
weights on the receive side), which is this layout's contract, and with FP8 activations (``use_fp8=True``,
``round_scale=False``, ``use_ue8m0=False``: bf16 rows in, the library quantizes them while it sends, by DeepEP's
rule (DESIGN.md, FP8); out come e4m3 ``[L, R*T, H]`` and fp32 scales ``[L, R*T, H/128]`` whose last two dims
are column-major (TMA's layout), copied into an owned contiguous buffer: the result's ``tokens`` is an
``Fp8Tensor``; H a multiple of 512, ``EP_HOST_ASSERT(hidden % 512 == 0)``). Everything else is a
MoEEpConfigError:
- HIGH_THROUGHPUT: the library's HT path asserts ``num_ranks > NUM_MAX_NVL_PEERS (8) or low_latency_mode``
  and ``num_ranks % NUM_MAX_NVL_PEERS == 0`` (strings in ``nixl_ep_cpp_torch21x*.so``): it needs >= 16 ranks
  on several nodes, and it has no static receive size, so it is not offered by this transport.
- RANK_MAJOR and NVFP4 activations: the LL kernels have neither (bf16 rows or their own FP8 recipe only).
- ``topk_idx`` must be ``nixl_ep_cu13.topk_idx_t`` (int32 in 1.5.1: ``topk_idx.scalar_type() ==
  c10::CppTypeToScalarType<topk_idx_t>::value``); ``R*T`` must be a multiple of 4 (buffer.py, TMA alignment).

Set-up follows the library's own tests: ``Buffer(rank, explicitly_destroy=True, tcp_store_group=store)``,
``update_memory_buffers(num_ranks, num_experts_per_rank, num_rdma_bytes=get_rdma_size_hint(T, H, R, E))``,
``connect_ranks(all ranks)``. Metadata is exchanged through a TCP store: by default a PrefixStore over
torch.distributed's default store.
"""

from __future__ import annotations

import itertools

import torch

from ..config import Algorithm, EpConfig, Format, Layout
from ..errors import MoEEpBackendUnavailable, MoEEpConfigError, MoEEpInputError, fail
from ..kernels.fp8 import Fp8Tensor, fp8_row_scales
from ..layout_contract import LowLatencyExpertMajor
from ..triton_runtime import device as kernel_device
from .base import group_rank_world, padding_row

_instances = itertools.count()
# the LL kernels are compiled for these hidden sizes only (SWITCH_HIDDEN in csrc/kernels/launch.cuh of
# ai-dynamo/nixl examples/device/ep; others hit "Unsupported hidden") and at most 16 picks (kNumMaxTopK)
LL_HIDDEN_SIZES = (2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192)
LL_MAX_TOP_K = 16
FP8_HIDDEN_MULTIPLE = 512  # use_fp8: EP_HOST_ASSERT(hidden % 512 == 0) in the LL dispatch
ACTIVATION_FORMATS = (Format.BF16, Format.FP8)  # bf16 rows, or the LL kernels' own FP8 cast (use_fp8)


def load_nixl_ep():
    """Import ``nixl_ep_cu13`` after checking that this machine can run it; raise MoEEpBackendUnavailable."""
    from .discovery import INSTALL, nixl_ep_problem
    why = nixl_ep_problem()
    if why:
        raise MoEEpBackendUnavailable(f"transport 'nixl_ep' is unavailable: {why}. Install: {INSTALL['nixl_ep']}")
    import nixl_ep_cu13
    return nixl_ep_cu13


def check_nixl_config(config: EpConfig, world: int) -> None:
    """Raise MoEEpConfigError for what NIXL-EP cannot do (see the module docstring)."""
    if config.algorithm is Algorithm.HIGH_THROUGHPUT:
        raise MoEEpConfigError(
            f"EpConfig.algorithm = 'ht' at world size {world}; allowed with transport 'nixl_ep': 'll' "
            "(nixl-ep's high-throughput kernels need >= 16 ranks, a multiple of 8, and are not offered here; "
            "use transport 'nccl_ep' or 'torch' for HT)")
    if config.layout is not Layout.EXPERT_MAJOR:
        raise MoEEpConfigError(f"EpConfig.layout = {config.layout.value!r}; allowed with transport 'nixl_ep': "
                               "'expert_major'")
    if config.activation_format not in ACTIVATION_FORMATS:
        raise MoEEpConfigError(f"EpConfig.activation_format = {config.activation_format.value!r}; allowed with "
                               "transport 'nixl_ep': " + " or ".join(repr(f.value) for f in ACTIVATION_FORMATS))
    if config.activation_format is Format.FP8 and config.hidden_size % FP8_HIDDEN_MULTIPLE:
        raise MoEEpConfigError(f"EpConfig.hidden_size = {config.hidden_size}; allowed with FP8 activations on "
                               f"transport 'nixl_ep': a multiple of {FP8_HIDDEN_MULTIPLE}")
    if config.hidden_size not in LL_HIDDEN_SIZES:
        raise MoEEpConfigError(f"EpConfig.hidden_size = {config.hidden_size}; allowed with transport 'nixl_ep': "
                               + ", ".join(map(str, LL_HIDDEN_SIZES)))
    if config.top_k > LL_MAX_TOP_K:
        raise MoEEpConfigError(f"EpConfig.top_k = {config.top_k}; allowed with transport 'nixl_ep': "
                               f"<= {LL_MAX_TOP_K}")
    if (world * config.max_tokens_per_rank) % 4:
        raise MoEEpConfigError(f"EpConfig.max_tokens_per_rank = {config.max_tokens_per_rank}; allowed with "
                               f"transport 'nixl_ep': world size ({world}) * max_tokens_per_rank a multiple of 4")


class NixlEpTransport:
    """LL EXPERT_MAJOR dispatch/combine over NIXL-EP for one layer config.

    ``group``: torch process group (None = default); ``nixl``: the ``nixl_ep_cu13`` module (None = import it
    after the environment checks; tests pass a stand-in); ``store``: a TCPStore-like object for metadata.
    """

    name = "nixl_ep"
    graph_capturable = True  # LL: captured and replayed in tests (1 and 2 ranks)
    replayable = False  # the library moves the tokens (forward_plan.py records torch ops and kernels alone)

    def __init__(self, config: EpConfig, group=None, *, nixl=None, store=None, rank: int | None = None,
                 world_size: int | None = None, device=None):
        if rank is None or world_size is None:
            rank, world_size = group_rank_world(group, needs_process_group="nixl_ep")
        check_nixl_config(config, world_size)
        self.nixl = nixl if nixl is not None else load_nixl_ep()
        self.config, self.rank, self.world = config, rank, world_size
        self.L = config.local_experts(world_size)
        self.device = torch.device(device) if device is not None else kernel_device()
        if store is None:
            import torch.distributed as dist
            from torch.distributed import distributed_c10d as c10d
            store = dist.PrefixStore(f"moe_ep_nixl/{next(_instances)}", c10d._get_default_store())
        T, H, E = config.max_tokens_per_rank, config.hidden_size, config.num_experts
        B = self.nixl.Buffer
        self.buffer = B(rank=rank, low_latency_mode=True, explicitly_destroy=True, group=group,
                        tcp_store_group=store)
        self.buffer.update_memory_buffers(num_ranks=world_size, num_experts_per_rank=self.L,
                                          num_rdma_bytes=B.get_rdma_size_hint(T, H, world_size, E))
        self.buffer.connect_ranks(list(range(world_size)))
        self.out = torch.zeros(T, H, dtype=torch.bfloat16, device=self.device)
        self._idx = torch.zeros(T, config.top_k, dtype=self.nixl.topk_idx_t, device=self.device)
        self._w = torch.zeros(T, config.top_k, dtype=torch.float32, device=self.device)
        self.fp8 = config.activation_format is Format.FP8
        # FP8: the received scales, contiguous (the library's are column-major in their last two dims)
        self._scales = torch.zeros(self.L, world_size * T, fp8_row_scales(H), dtype=torch.float32,
                                   device=self.device) if self.fp8 else None
        self._rows = {}  # B -> the staging and output views of B rows (made once: a slice costs what a check does)
        self._last = None

    def _views(self, B: int) -> tuple:
        """(ids staging, weights staging, output) views of their first ``B`` rows."""
        v = self._rows.get(B)
        if v is None:
            v = self._rows[B] = (self._idx[:B], self._w[:B], self.out[:B])
        return v

    def dispatch(self, hidden_states: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> LowLatencyExpertMajor:
        """``tokens [L, R*T, H]`` bf16 (FP8 activations: an ``Fp8Tensor``, e4m3 + fp32 ``[L, R*T, H/128]``
        contiguous scales) and ``expert_counts [L]`` int32 (rows past a count are garbage)."""
        # a rank with no tokens still takes part in the collective: it sends one row that picks no expert
        self._empty = hidden_states.dim() == 2 and hidden_states.shape[0] == 0
        if self._empty:
            if getattr(self, "_pad", None) is None:  # owned, so the step's addresses stay the same
                self._pad = padding_row(hidden_states, topk_idx, topk_weights, self.config.top_k)
            hidden_states, topk_idx, topk_weights = self._pad
        c = self.config
        x = hidden_states
        B = x.shape[0] if x.dim() else 0
        if not (x.dtype == torch.bfloat16 and x.dim() == 2 and 0 < B <= c.max_tokens_per_rank):
            fail("hidden_states", f"{tuple(x.shape)} {x.dtype}", f"bf16 [B, H] with B <= {c.max_tokens_per_rank}")
        if topk_idx.shape != (B, c.top_k):
            fail("topk_idx.shape", tuple(topk_idx.shape), f"({B}, {c.top_k})")
        idx_rows, w_rows, out = self._views(B)
        idx = topk_idx.contiguous() if topk_idx.dtype == self.nixl.topk_idx_t else \
            idx_rows.copy_(topk_idx)          # staged: nixl_ep_cu13.topk_idx_t (int32 in 1.5.1)
        w = topk_weights.contiguous() if topk_weights.dtype == torch.float32 else w_rows.copy_(topk_weights)
        recv_x, recv_count, handle, _event, _hook = self.buffer.low_latency_dispatch(
            x.contiguous(), idx, c.max_tokens_per_rank, c.num_experts, use_fp8=self.fp8, round_scale=False,
            use_ue8m0=False, async_finish=False, return_recv_hook=False)
        self._last = (B, idx, w, handle, out)
        if self.fp8:
            data, scales = recv_x
            recv_x = Fp8Tensor(data, self._scales.copy_(scales))
        return LowLatencyExpertMajor(tokens=recv_x, expert_counts=recv_count)

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's expert rows, ``[B, H]`` bf16 (view of an owned buffer)."""
        if self._last is None:
            raise MoEEpInputError("combine called before dispatch; allowed: dispatch, then combine")
        _, idx, w, handle, out = self._last
        combined, _event, _hook = self.buffer.low_latency_combine(
            expert_out.contiguous(), idx, w, handle, async_finish=False, return_recv_hook=False, out=out)
        return combined[:0] if self._empty else combined

    def close(self) -> None:
        """Destroy the NIXL buffer (it was created with ``explicitly_destroy=True``). Idempotent."""
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None
