"""NCCL-EP transport: ``nccl.ep`` from the ``nccl-extensions`` wheel (0.1.0, built for NCCL 2.30.7).

One ``nccl.ep.Group`` per transport (= per layer config), over a fresh NCCL communicator that mirrors the
torch process group (``nccl.ep.interop.torch.get_nccl_comm_from_group``). The handle is created on the
first step (``Group.create_handle``) and re-bound after (``Handle.update``: no re-allocation). Every output
buffer is allocated once, at the layout's static size, and reused, so pointers stay the same from step to
step (HT's cached mode and CUDA graphs rely on it).

What each layout asks of the library (``nccl_ep.h`` in the wheel; asserts quoted from ``libnccl_ep.so``):

| layout | dispatch outputs | layout_info | combine outputs |
|---|---|---|---|
| LL EXPERT_MAJOR | tokens [L, R*T, H] | dispatch: expert_counters [L] int32 | tokens [B, H], topk_weights [B, K] f32 (weights applied here) |
| LL RANK_MAJOR | tokens [R, T, H], topk_weights [R, T, K] f32, topk_idx [R, T, K] **int32** | dispatch: src_rank_counters [R] int32, kind LOCAL | tokens [B, H] |
| HT FLAT | tokens [S, H], topk_weights [S, K] f32, topk_idx [S, K] **int64**; S = T*R | handle: recv_total_counter [1], kind LOCAL | tokens [B, H] |
| HT EXPERT_MAJOR | tokens [S, H], topk_weights [S] f32 (1-D); S = T*R*K | handle: expert_counters, expert_offsets [L], recv_total_counter [1], all int64 | tokens [B, H] |

LL dispatch also takes ``inputs.topk_weights`` for RANK_MAJOR; HT (forward pass) always. NVFP4 activations
(as in the portable transport): dispatch takes bf16 rows, quantizes each with its own global scale
(``quantize_nvfp4_tokens``: ``2688 / amax(token)``, or the config's static scale) and sends them with ``DispatchQuantizationRecipe.FWD``: packed FP4 tokens (``ncclFloat4x2``
= 12, ``[B, H/2]``) plus one raw ``uint8`` scale row per token (FWD accepts raw uint8 scales of any 16-byte
multiple width): the ``H/16`` e4m3 block scales, then the fp32 global scale, zero padded to ``H/16 + 16``
bytes. The received ``tokens`` are an ``NvFp4Tensor`` with linear scales and a per-row ``global_scale``.

FP8 activations (the received ``tokens`` are an ``Fp8Tensor``, block_rows 1: e4m3 ``[..., H]`` + fp32
``[..., ceil(H/128)]``):
- LL: ``DispatchQuantizationRecipe.DS_FP8E3M4`` (``nccl_ep.h``: LL only, "the caller supplies BF16 tokens; dispatch
  emits E4M3 token bytes and generated FP32 scales, one per 128 token elements", H a multiple of 512, no input
  scales, ``outputs.scales`` fp32 ``[*lead, H/128]``). bf16 rows go in and the library quantizes them while it
  sends, by DeepEP's rule, not ours (DESIGN.md, FP8): ``amax = max(|x| over 128, 1e-4)``, scale ``amax * fp32(1/448)``,
  code ``e4m3_satfinite(x * (448 / amax))``; the value is still ``data * scale``.
- HT (the recipe is LL only): ``FWD`` with caller-made tokens, as NVFP4: each token quantized once here
  (``quantize_fp8``, our definition, bit-exact), ``ncclFloat8e4m3`` rows ``[B, H]`` plus raw ``uint8`` scale rows
  (the fp32 scales' bytes, zero padded to a multiple of 16 bytes), split into contiguous fp32 scales on receipt.
"""

from __future__ import annotations

import torch

from ..config import Algorithm, EpConfig, Format, Layout
from ..errors import MoEEpBackendUnavailable, MoEEpConfigError, MoEEpInputError, check, fail
from ..kernels.fp8 import fp8_row_scales
from ..layout_contract import (DispatchResult, HighThroughputExpertMajor, HighThroughputFlat, LowLatencyExpertMajor,
                               LowLatencyRankMajor, result_type)
from ..triton_runtime import device as kernel_device
from .base import group_rank_world, padding_row

HT_MAX_TOKENS_PER_RANK = 8192       # HT kernels' build-time MAX_SUPPORTED_TOKENS_PER_RANK (NCCL contrib/nccl_ep common.hpp)
NCCL_FLOAT4X2 = 12                  # nccl_ep.h line 22: ncclFloat4x2, not a member of nccl4py's NcclDataType

# dtype of the received top-k ids per (algorithm, layout), enforced by libnccl_ep.so:
# LL rank-major "recv_topk_idx->datatype == ncclInt32", HT flat "recv_topk_idx->datatype == ncclInt64"
RECV_TOPK_IDX_DTYPE = {(Algorithm.LOW_LATENCY, Layout.RANK_MAJOR): torch.int32,
                       (Algorithm.HIGH_THROUGHPUT, Layout.FLAT): torch.int64}
HT_EM_COUNTER_DTYPE = torch.int64   # "all preprocessing int output tensors must share dtype"
RECV_TOPK_IDX_KIND = "LOCAL"        # ExpertIdKind member: pinned (AUTO "may change in a future release")
DS_FP8_HIDDEN_MULTIPLE = 512        # DS_FP8E3M4: "tokens must be 2D with hidden divisible by 512" (nccl_ep.h)


def fp8_scale_row_bytes(hidden_size: int) -> int:
    """Bytes of one token's raw scale row on HT's FWD path: its ceil(H/128) fp32 scales, zero padded to a multiple
    of 16 (FWD: "scale bytes per token must be non-zero and 16-byte aligned")."""
    return -(-4 * fp8_row_scales(hidden_size) // 16) * 16


def load_nccl_ep():
    """Import ``nccl.ep`` after checking that this machine can run it; raise MoEEpBackendUnavailable if not."""
    from .discovery import INSTALL, nccl_ep_problem
    why = nccl_ep_problem()
    if why:
        raise MoEEpBackendUnavailable(f"transport 'nccl_ep' is unavailable: {why}. Install: {INSTALL['nccl_ep']}")
    import nccl.ep
    import nccl.ep.interop.torch  # noqa: F401  (get_nccl_comm_from_group)
    return nccl.ep


def ht_recv_budget(config: EpConfig, world: int) -> int:
    """HT's static ``max_recv_tokens_per_rank``: T*R (FLAT), T*R*K (EXPERT_MAJOR: a token per local pick)."""
    s = config.max_tokens_per_rank * world
    return s * config.top_k if config.layout is Layout.EXPERT_MAJOR else s


# ---- per layout: the leading dims of the received rows and the other receive buffers (the module docstring's
# table), named as the layout's result fields. Arguments: z(*shape, dt=dtype) allocates; R ranks, T max tokens
# per rank, L local experts, K top-k, S the HT receive budget.

def _ll_expert_major_buffers(z, R, T, L, K, S):
    return (L, R * T), {"expert_counts": z(L, dt=torch.int32)}


def _ll_rank_major_buffers(z, R, T, L, K, S):
    idx_dt = RECV_TOPK_IDX_DTYPE[(Algorithm.LOW_LATENCY, Layout.RANK_MAJOR)]
    return (R, T), {"topk_idx": z(R, T, K, dt=idx_dt), "topk_weights": z(R, T, K, dt=torch.float32),
                    "src_rank_counts": z(R, dt=torch.int32)}


def _ht_flat_buffers(z, R, T, L, K, S):
    idx_dt = RECV_TOPK_IDX_DTYPE[(Algorithm.HIGH_THROUGHPUT, Layout.FLAT)]
    return (S,), {"topk_idx": z(S, K, dt=idx_dt), "topk_weights": z(S, K, dt=torch.float32),
                  "num_recv": z(1, dt=HT_EM_COUNTER_DTYPE)}


def _ht_expert_major_buffers(z, R, T, L, K, S):
    return (S,), {"topk_weights": z(S, dt=torch.float32), "expert_counts": z(L, dt=HT_EM_COUNTER_DTYPE),
                  "expert_offsets": z(L, dt=HT_EM_COUNTER_DTYPE), "num_recv": z(1, dt=HT_EM_COUNTER_DTYPE)}


RECEIVE_BUFFERS = {LowLatencyExpertMajor: _ll_expert_major_buffers, LowLatencyRankMajor: _ll_rank_major_buffers,
                   HighThroughputFlat: _ht_flat_buffers, HighThroughputExpertMajor: _ht_expert_major_buffers}


class NcclEpTransport:
    """Dispatch/combine over NCCL-EP for one layer config (see the module docstring for the layouts).

    ``group``: the torch process group (None = default); ``ep``: the ``nccl.ep`` module (None = import it
    after the environment checks; tests pass a stand-in); ``comm``: an existing ``nccl.core.Communicator``.
    """

    name = "nccl_ep"

    def __init__(self, config: EpConfig, group=None, *, ep=None, comm=None, rank: int | None = None,
                 world_size: int | None = None, device=None):
        self.config = c = config
        if rank is None or world_size is None:
            rank, world_size = group_rank_world(group, needs_process_group="nccl_ep")
        self.rank, self.world = rank, world_size
        self.L = c.local_experts(world_size)
        self.kind = result_type(c)   # the layout's result type: its receive buffers, who applies the weights
        self.ht = c.algorithm is Algorithm.HIGH_THROUGHPUT
        self.graph_capturable = not self.ht  # LL: captured and replayed in tests (1 and 2 ranks); HT: not verified
        self.replayable = False  # the library moves the tokens (forward_plan.py records torch ops and kernels alone)
        self.fp4 = c.activation_format is Format.NVFP4
        fp8 = c.activation_format is Format.FP8
        self.fp8_ds = fp8 and not self.ht     # LL: the library's DS_FP8E3M4 recipe quantizes bf16 rows
        self.fp8_fwd = fp8 and self.ht        # HT: our quantize, forwarded (FWD)
        self.n_scales = fp8_row_scales(c.hidden_size)
        # HT FP8 scale rows need no padding when ceil(H/128) is a multiple of 4 (H a multiple of 512, as DeepSeek-V3's
        # and Qwen3's are): then the send and receive rows are the fp32 scales themselves, no copy on either side
        self.fp8_rows_unpadded = self.fp8_fwd and 4 * self.n_scales == fp8_scale_row_bytes(c.hidden_size)
        if self.ht and c.max_tokens_per_rank > HT_MAX_TOKENS_PER_RANK:
            raise MoEEpConfigError(f"EpConfig.max_tokens_per_rank = {c.max_tokens_per_rank}; allowed: "
                                   f"<= {HT_MAX_TOKENS_PER_RANK} with HIGH_THROUGHPUT on transport 'nccl_ep'")
        if not self.ht and c.hidden_size % 128:
            # libnccl_ep.so, LL combine: "x->sizes[2] % 128 == 0"
            raise MoEEpConfigError(f"EpConfig.hidden_size = {c.hidden_size}; allowed with LOW_LATENCY on transport "
                                   "'nccl_ep': a multiple of 128")
        if self.fp4 and c.hidden_size % 256:
            # FWD forwards the e4m3 scale rows as they are; libnccl_ep.so: "scale bytes per token must be
            # non-zero and 16-byte aligned" -> H/16 bytes % 16 == 0
            raise MoEEpConfigError(f"EpConfig.hidden_size = {c.hidden_size}; allowed with NVFP4 activations on "
                                   "transport 'nccl_ep': a multiple of 256 (16-byte rows of e4m3 scales)")
        if self.fp8_ds and c.hidden_size % DS_FP8_HIDDEN_MULTIPLE:
            raise MoEEpConfigError(f"EpConfig.hidden_size = {c.hidden_size}; allowed with FP8 activations and "
                                   f"LOW_LATENCY on transport 'nccl_ep': a multiple of {DS_FP8_HIDDEN_MULTIPLE} (its "
                                   "DS_FP8E3M4 dispatch recipe)")
        self.ep = ep = ep if ep is not None else load_nccl_ep()   # after the config checks: they need no library
        self.device = torch.device(device) if device is not None else kernel_device()
        self.ep_layout = {Layout.EXPERT_MAJOR: ep.Layout.EXPERT_MAJOR, Layout.RANK_MAJOR: ep.Layout.RANK_MAJOR,
                          Layout.FLAT: ep.Layout.FLAT}[c.layout]
        self.budget = ht_recv_budget(c, world_size) if self.ht else 0
        self.handle, self.group, self._own_comm = None, None, comm is None
        self._desc_cache, self._plans = {}, {}
        self.comm = comm if comm is not None else ep.interop.torch.get_nccl_comm_from_group(group)
        self.group = ep.Group.create(self.comm, ep.GroupConfig(
            algorithm=ep.Algorithm.HIGH_THROUGHPUT if self.ht else ep.Algorithm.LOW_LATENCY,
            num_experts=c.num_experts, max_dispatch_tokens_per_rank=c.max_tokens_per_rank,
            max_recv_tokens_per_rank=self.budget, max_token_bytes=2 * c.hidden_size,
            num_topk=c.top_k if self.ht else 0))
        self._cuda = self.device.type == "cuda"
        self._last = None   # (combine outputs bundle, output view, stream) of the last dispatch
        self._result = None  # what dispatch returns: views of the owned buffers, built after the first dispatch
        try:
            self._alloc()
        except BaseException:
            self.close()
            raise

    # ---- buffers, allocated once ----
    def _alloc(self):
        R, T, K, H, L, dev = self.world, self.config.max_tokens_per_rank, self.config.top_k, \
            self.config.hidden_size, self.L, self.device
        z = lambda *s, dt: torch.zeros(*s, dtype=dt, device=dev)  # noqa: E731
        lead, recv = RECEIVE_BUFFERS[self.kind](z, R, T, L, K, self.budget)
        b = self.bufs = {}
        e4m3 = torch.float8_e4m3fn
        b["tokens"] = z(*lead, H // 2 if self.fp4 else H,
                        dt=torch.uint8 if self.fp4 else e4m3 if self.fp8_ds or self.fp8_fwd else torch.bfloat16)
        if self.fp8_ds:
            b["scales"] = z(*lead, self.n_scales, dt=torch.float32)       # the recipe writes them here
        if self.fp8_fwd:
            w = fp8_scale_row_bytes(H)
            b["scale_rows"] = z(*lead, w, dt=torch.uint8)                  # what travels: fp32 scale bytes, pad
            b["x_scale_rows"] = z(T, w, dt=torch.uint8)                    # the send side's rows
            b["x_codes"] = z(T, H, dt=e4m3)                                # ... and codes (same address each step)
            if self.fp8_rows_unpadded:  # the rows are the scales themselves: quantized into, read as they are
                b["scales"] = b["scale_rows"].view(torch.float32)
            else:
                b["scales"] = z(*lead, self.n_scales, dt=torch.float32)    # what the compute reads (contiguous)
        if self.fp4:
            b["scale_rows"] = z(*lead, H // 16 + 16, dt=torch.uint8)   # what travels: e4m3 scales, fp32 gs, pad
            b["scales"] = z(*lead, H // 16, dt=torch.float8_e4m3fn)     # what the compute reads (contiguous)
            b["row_gs"] = z(*lead, dt=torch.float32)
            b["x_scale_rows"] = z(T, H // 16 + 16, dt=torch.uint8)       # the send side's rows
            b["x_codes"] = z(T, H // 2, dt=torch.uint8)                  # ... and codes (same address each step)
        b.update(recv)
        self._recv_fields = tuple(recv)
        b["out"] = z(T, H, dt=torch.bfloat16)
        b["idx_in"] = z(T, K, dt=torch.int64)      # only used when the caller's ids are not int64
        b["w_in"] = z(T, K, dt=torch.float32)      # ... or its weights not float32
        ep = self.ep
        if self.ht:  # handle-time layout info (HT); LL's goes to dispatch
            self.handle_info = ep.LayoutInfo(
                recv_total_counter=self._desc(b["num_recv"]),
                expert_counters=self._desc(b["expert_counts"]) if "expert_offsets" in b else None,
                expert_offsets=self._desc(b["expert_offsets"]) if "expert_offsets" in b else None,
                recv_topk_idx_kind=ep.ExpertIdKind[RECV_TOPK_IDX_KIND])
            self.dispatch_info = None
        else:
            self.handle_info = None
            self.dispatch_info = ep.LayoutInfo(
                expert_counters=self._desc(b["expert_counts"]) if "expert_counts" in b else None,
                src_rank_counters=self._desc(b["src_rank_counts"]) if "src_rank_counts" in b else None,
                recv_topk_idx_kind=ep.ExpertIdKind[RECV_TOPK_IDX_KIND])
        self.dispatch_out = ep.DispatchOutputs(
            tokens=self._desc(b["tokens"], fp4=self.fp4), topk_weights=self._opt(b.get("topk_weights")),
            scales=self._opt(b.get("scale_rows", b.get("scales"))), topk_idx=self._opt(b.get("topk_idx")))
        recipe = "DS_FP8E3M4" if self.fp8_ds else "FWD" if self.fp4 or self.fp8_fwd else "NONE"
        self.dispatch_cfg = ep.DispatchConfig(quantization_recipe=ep.DispatchQuantizationRecipe[recipe])

    def _opt(self, t):
        return None if t is None else self._desc(t)

    def _desc(self, t: torch.Tensor, fp4: bool = False):
        """An ``nccl.ep.Tensor`` for ``t`` (cached by address/shape/dtype: it anchors ``t``, so that is safe)."""
        key = (t.data_ptr(), tuple(t.shape), t.dtype, fp4)
        d = self._desc_cache.get(key)
        if d is None:
            d = self.ep.Tensor(t)
            if fp4:  # packed FP4: nccl4py has no ncclFloat4x2 member, so set the C field directly
                d._ep_t.datatype = NCCL_FLOAT4X2
            if len(self._desc_cache) > 64:
                self._desc_cache.clear()
            self._desc_cache[key] = d
        return d

    def _bundle(self, cls: str, **fields):
        """``ep.<cls>(**fields)``, cached by the identity of the (cached) descriptors it holds."""
        key = (cls, *((k, id(v)) for k, v in fields.items()))
        b = self._desc_cache.get(key)
        if b is None:
            b = self._desc_cache[key] = getattr(self.ep, cls)(**fields)
        return b

    # ---- the Transport interface ----
    def dispatch(self, hidden_states, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> DispatchResult:
        """Send each token to its experts' ranks; returns the layout's result type (views of owned buffers).

        ``hidden_states``: bf16 ``[B, H]`` (with NVFP4 activations, and FP8 ones on HT, quantized here; FP8 on LL
        by the library's recipe: see the module docstring).
        ``topk_idx`` ``[B, K]`` global ids (-1 = none), int64 (other dtypes are
        copied into an owned int64 buffer first: ``Group.create_handle`` documents int64); ``topk_weights``
        ``[B, K]`` float32 (likewise). The descriptors of a step are cached by the inputs' addresses, so
        a caller that reuses its input buffers (CUDA graphs, static serving buffers) pays no set-up per step.
        """
        # a rank with no tokens still takes part in the collective: it sends one row that picks no expert
        self._empty = hidden_states.dim() == 2 and hidden_states.shape[0] == 0
        if self._empty:
            if getattr(self, "_pad", None) is None:  # owned, so the step's addresses stay the same
                self._pad = padding_row(hidden_states, topk_idx, topk_weights, self.config.top_k)
            hidden_states, topk_idx, topk_weights = self._pad
        x, xs = hidden_states, None
        if self.fp4 or self.fp8_fwd:
            if not (x.dtype == torch.bfloat16 and x.dim() == 2):
                fail("hidden_states", f"{tuple(x.shape)} {x.dtype}",
                     f"bf16 [B, H] ({self.config.activation_format.name} activations are quantized by the transport)")
            x, xs = self._quantize_fp8(x) if self.fp8_fwd else self._quantize(x)
        if topk_idx.dtype is not torch.int64:   # staged into an owned buffer: same address every step
            topk_idx = self.bufs["idx_in"][:topk_idx.shape[0]].copy_(topk_idx)
        if topk_weights.dtype is not torch.float32:
            topk_weights = self.bufs["w_in"][:topk_weights.shape[0]].copy_(topk_weights)
        x, topk_idx, topk_weights = x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()
        key = (x.data_ptr(), x.shape, x.dtype, topk_idx.data_ptr(), topk_idx.shape, topk_idx.dtype,
               topk_weights.data_ptr(), topk_weights.shape, None if xs is None else xs.data_ptr())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(x, xs, topk_idx, topk_weights)
            if len(self._plans) > 16:
                self._plans.clear()
            self._plans[key] = plan
        idx_d, inputs, cout, out = plan
        stream = torch.cuda.current_stream().cuda_stream if self._cuda else 0
        if self.handle is None:
            self.handle = self.group.create_handle(self.ep_layout, idx_d, layout_info=self.handle_info,
                                                   stream=stream)
        else:
            self.handle.update(idx_d, layout_info=self.handle_info, stream=stream)
        self.handle.dispatch(inputs, self.dispatch_out, layout_info=self.dispatch_info, config=self.dispatch_cfg,
                             stream=stream)
        self._last = (cout, out, stream)
        if self.fp4:  # split the received scale rows into the compute's contiguous scales + per-row scale
            b, h16 = self.bufs, self.config.hidden_size // 16
            b["scales"].view(torch.uint8).copy_(b["scale_rows"][..., :h16])
            b["row_gs"].view(torch.uint8).view(*b["row_gs"].shape, 4).copy_(b["scale_rows"][..., h16:h16 + 4])
        elif self.fp8_fwd and not self.fp8_rows_unpadded:  # the received rows' fp32 bytes into contiguous scales
            b = self.bufs
            b["scales"].view(torch.uint8).copy_(b["scale_rows"][..., :4 * self.n_scales])
        if self._result is None:  # after the library's first call, so its own checks on the buffers come first
            self._result = self._make_result()
        return self._result

    def _quantize(self, x: torch.Tensor):
        """NVFP4 codes of ``x``, one global scale per token, and their scale rows (e4m3 | fp32 gs | 0)."""
        from ..kernels.nvfp4 import quantize_nvfp4_tokens
        B, h16 = x.shape[0], self.config.hidden_size // 16
        q = quantize_nvfp4_tokens(x, self.config.activation_global_scale)
        rows = self.bufs["x_scale_rows"][:B]
        rows[:, :h16].copy_(q.scales.view(torch.uint8))
        rows[:, h16:h16 + 4].copy_(q.global_scale.reshape(B, 1).view(torch.uint8))
        return self.bufs["x_codes"][:B].copy_(q.data), rows

    def _quantize_fp8(self, x: torch.Tensor):
        """FP8 codes of ``x`` (``quantize_fp8``, one scale per token per 128 channels) and their scale rows (the fp32
        scales' bytes, zero padded). Non-finite tokens: the layer's validate refuses them before dispatch."""
        from ..kernels.fp8 import Fp8Tensor, quantize_fp8
        B = x.shape[0]
        rows = self.bufs["x_scale_rows"][:B]
        if self.fp8_rows_unpadded:  # straight into the send buffers
            q = quantize_fp8(x, 1, check_finite=False,
                             out=Fp8Tensor(self.bufs["x_codes"][:B], rows.view(torch.float32)))
            return q.data, rows
        q = quantize_fp8(x, 1, check_finite=False)
        rows[:, :4 * self.n_scales].copy_(q.scales.view(torch.uint8))
        return self.bufs["x_codes"][:B].copy_(q.data), rows

    def _plan(self, x, xs, topk_idx, topk_weights):
        """Validate a new input signature and build its descriptors and bundles (once)."""
        c, b = self.config, self.bufs
        if not (self.fp4 or self.fp8_fwd):
            check(x.dtype == torch.bfloat16, "hidden_states.dtype", x.dtype, "torch.bfloat16")
        B = x.shape[0]
        H = c.hidden_size // 2 if self.fp4 else c.hidden_size
        check(x.dim() == 2 and 0 < B <= c.max_tokens_per_rank and x.shape[1] == H, "hidden_states.shape",
              tuple(x.shape), f"[B, {H}] with B <= max_tokens_per_rank ({c.max_tokens_per_rank})")
        check(tuple(topk_idx.shape) == (B, c.top_k), "topk_idx.shape", tuple(topk_idx.shape), f"({B}, {c.top_k})")
        check(tuple(topk_weights.shape) == (B, c.top_k), "topk_weights.shape", tuple(topk_weights.shape),
              f"({B}, {c.top_k})")
        in_combine = self.kind.weights_applied_by_combine   # else dispatch carries the weights to the compute
        inputs = self._bundle("DispatchInputs", tokens=self._desc(x, fp4=self.fp4),  # x: codes if NVFP4
                              topk_weights=None if in_combine else self._desc(topk_weights),
                              scales=None if xs is None else self._desc(xs))
        out = b["out"][:B]
        cout = self._bundle("CombineOutputs", tokens=self._desc(out),
                            topk_weights=self._desc(topk_weights) if in_combine else None)
        return self._desc(topk_idx), inputs, cout, out

    def _make_result(self) -> DispatchResult:
        """The layout's result over the owned buffers (the same object every step: the buffers never move)."""
        b = self.bufs
        tokens = b["tokens"]
        if self.fp4:
            from ..kernels.nvfp4 import NvFp4Tensor
            tokens = NvFp4Tensor(tokens, b["scales"], b["row_gs"],
                                 torch.Size((*tokens.shape[:-1], self.config.hidden_size)))
        elif "scales" in b:  # FP8 (either recipe): contiguous fp32 scales beside the e4m3 rows
            from ..kernels.fp8 import Fp8Tensor
            tokens = Fp8Tensor(tokens, b["scales"])
        fields = {name: b[name] for name in self._recv_fields}
        if "num_recv" in fields:  # the library's counter is [1]; the contract's num_recv is its 0-d view
            fields["num_recv"] = fields["num_recv"][0]
        return self.kind(tokens, **fields)

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Return ``[B, H]`` bf16 (a view of an owned buffer, valid until the next combine)."""
        if self._last is None:
            raise MoEEpInputError("combine called before dispatch; allowed: dispatch, then combine")
        cout, out, stream = self._last
        cin = self._plans.get((expert_out.data_ptr(), expert_out.shape, expert_out.dtype))
        if cin is None:
            want = self.bufs["tokens"].shape[:-1] + (self.config.hidden_size,)
            check(expert_out.shape == want and expert_out.dtype == torch.bfloat16, "expert_out",
                  f"{tuple(expert_out.shape)} {expert_out.dtype}", f"{tuple(want)} torch.bfloat16")
            expert_out = expert_out.contiguous()
            cin = self._bundle("CombineInputs", tokens=self._desc(expert_out))
            self._plans[(expert_out.data_ptr(), expert_out.shape, expert_out.dtype)] = cin
        self.handle.combine(cin, cout, stream=stream)
        return out[:0] if self._empty else out

    def close(self) -> None:
        """Release the handle, then the group, then the communicator (in that order). Idempotent."""
        if self.handle is not None:
            self.handle.destroy()
            self.handle = None
        if self.group is not None:
            self.group.destroy()
            self.group = None
        if self.comm is not None and self._own_comm:
            self.comm.destroy()
        self.comm = None
        self._desc_cache.clear()
        self._plans.clear()
