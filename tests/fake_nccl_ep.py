"""A recording, checking stand-in for ``nccl.ep`` (nccl-extensions 0.1.0) -- for CONTRACT tests, not integration.

Same class, field and enum names as the real package (``nccl/ep/{enums,group,handle,tensor}.py``). Every call
is recorded in ``calls`` and checked against ``nccl_ep.h`` and the asserts compiled into ``libnccl_ep.so``
(required / forbidden fields per algorithm, layout and pass; shapes; dtypes); a breach raises
``ContractViolation``. At world size 1 it also moves the data the way the library does, so the wrapper's
DispatchResult can be checked end to end on a CPU. Rows the library leaves undefined are filled with NaN / -7.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from enum import IntEnum

import torch


class ContractViolation(AssertionError):
    """The wrapper called the stand-in in a way the real library rejects (or our contract forbids)."""


def need(cond, msg):
    if not cond:
        raise ContractViolation(msg)


class Algorithm(IntEnum):
    LOW_LATENCY = 0
    HIGH_THROUGHPUT = 1


class Layout(IntEnum):
    UNSET = 0
    EXPERT_MAJOR = 1
    RANK_MAJOR = 2
    FLAT = 3


class PassDir(IntEnum):
    FWD = 0
    BWD = 1


class OverflowPolicy(IntEnum):
    AUTO = 0
    TRAP = 1
    DROP = 2


class ZeroCopyMode(IntEnum):
    AUTO = 0
    OFF = 1
    ON = 2


class ExpertIdKind(IntEnum):
    AUTO = 0
    LOCAL = 1
    GLOBAL = 2


class DispatchQuantizationRecipe(IntEnum):
    NONE = 0
    FWD = 1
    DS_FP8E3M4 = 2


class CombineQuantizationRecipe(IntEnum):
    NONE = 0
    NVFP4 = 1


class NcclDataType(IntEnum):
    """nccl4py's enum: note there is no member 12 (ncclFloat4x2)."""
    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FLOAT8E4M3 = 10
    FLOAT8E5M2 = 11


FLOAT4X2 = 12
_FROM_TORCH = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
               torch.float64: 8, torch.bfloat16: 9, torch.float8_e4m3fn: 10, torch.float8_e5m2: 11}
I32, I64, F32, BF16, E4M3, U8 = 2, 4, 7, 9, 10, 1
_BYTES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1, FLOAT4X2: 1}  # per element
DS_ELEMENTS_PER_SCALE = 128   # kDsFp8E3M4ElementsPerScale
FP8_MARGIN = 1e-4             # kFP8Margin: the amax floor of DeepEP's FP8 cast, which DS_FP8E3M4 reproduces


def ds_fp8e3m4(x: torch.Tensor):
    """What DS_FP8E3M4 makes of bf16 rows ``x [B, H]`` (``castAndWriteToSendBuf`` / ``calculate_fp8_scales`` with
    round_scales 0, in fp32 as the kernel computes): per 128 elements ``amax = max(1e-4, max |x|)``, the stored
    scale ``amax * fp32(1/448)``, the code ``e4m3_satfinite(x * (448 / amax))``. Returns (e4m3 ``[B, H]``, fp32
    ``[B, H/128]``)."""
    B, H = x.shape
    xf = x.float().reshape(B, H // DS_ELEMENTS_PER_SCALE, DS_ELEMENTS_PER_SCALE)
    amax = xf.abs().amax(-1).clamp(min=FP8_MARGIN)
    scale_inv = amax * torch.tensor(1 / 448.0, dtype=torch.float32)
    scale = torch.tensor(448.0, dtype=torch.float32) / amax
    q = (xf * scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)   # __NV_SATFINITE, round to nearest
    return q.reshape(B, H), scale_inv


class _EpT:
    """The C struct ncclEpTensor_t as the binding exposes it (``datatype`` is settable, any int)."""

    def __init__(self, datatype, data, sizes):
        self.datatype, self.data_, self.sizes = datatype, data, sizes


class Tensor:
    """Like nccl.ep.Tensor: from a torch tensor, or a raw int pointer with dtype= and shape=."""

    def __init__(self, buffer, *, dtype=None, shape=None, window=None, window_offset=None):
        if isinstance(buffer, int):
            need(dtype is not None and shape is not None, "Raw integer pointer requires `dtype` and `shape` kwargs")
            dt = NcclDataType(dtype)   # ValueError for 12, as in nccl4py
            self._buffer, sizes, ptr = None, tuple(shape), buffer
        else:
            need(dtype is None and shape is None, "`dtype`/`shape` are only valid with a raw integer pointer")
            need(isinstance(buffer, torch.Tensor), f"unsupported buffer {type(buffer)}")
            need(buffer.dtype in _FROM_TORCH, f"Unsupported torch dtype {buffer.dtype}")
            need(buffer.is_contiguous(), "descriptor of a non-contiguous tensor (the library assumes dense rows)")
            dt, sizes, ptr, self._buffer = NcclDataType(_FROM_TORCH[buffer.dtype]), tuple(buffer.shape), \
                buffer.data_ptr(), buffer
        need(len(sizes) > 0, "Tensor requires at least one dimension")
        self._sizes, self._datatype = sizes, dt
        self._ep_t = _EpT(int(dt), ptr, sizes)

    # what the C library sees
    @property
    def dt(self):
        return self._ep_t.datatype

    @property
    def sizes(self):
        return self._sizes

    @property
    def ndim(self):
        return len(self._sizes)

    @property
    def buffer(self):
        return self._buffer

    @property
    def ptr(self):
        return id(self._ep_t)


class _Snapshot:
    """Like nccl._extensions._binding_helpers.binding_dataclass: the C struct (``_lowpp``) is filled once, at
    construction; assigning a field afterwards does not reach the library. The stand-in reads ``_lowpp``."""

    def __post_init__(self):
        object.__setattr__(self, "_lowpp", types.SimpleNamespace(**{k: getattr(self, k)
                                                                     for k in self.__dataclass_fields__}))


def lib(obj):
    """What the library sees of a bundle / config (None stays None)."""
    return None if obj is None else obj._lowpp


@dataclass
class AllocConfig:
    alloc_fn: object = None
    free_fn: object = None
    context: object = None


@dataclass
class GroupConfig(_Snapshot):
    algorithm: Algorithm = Algorithm.LOW_LATENCY
    num_experts: int = 0
    max_dispatch_tokens_per_rank: int = 0
    max_recv_tokens_per_rank: int = 0
    max_token_bytes: int = 0
    rdma_buffer_size: int = 0
    num_qp_per_rank: int = 0
    num_channels: int = 0
    max_num_sms: int = 0
    alloc: AllocConfig = field(default_factory=AllocConfig)
    enable_mask: bool = False
    timeout_ns: int = 0
    zero_copy: ZeroCopyMode = ZeroCopyMode.AUTO
    overflow_policy: OverflowPolicy = OverflowPolicy.AUTO
    num_topk: int = 0


@dataclass
class HandleConfig(_Snapshot):
    dispatch_output_per_expert_alignment: int = 0


@dataclass
class DispatchConfig(_Snapshot):
    send_only: int = 0
    round_scales: int = 0
    pass_direction: PassDir = PassDir.FWD
    quantization_recipe: DispatchQuantizationRecipe = DispatchQuantizationRecipe.NONE


@dataclass
class CombineConfig(_Snapshot):
    send_only: int = 0
    pass_direction: PassDir = PassDir.FWD
    quantization_recipe: CombineQuantizationRecipe = CombineQuantizationRecipe.NONE


@dataclass
class LayoutInfo(_Snapshot):
    expert_counters: Tensor | None = None
    src_rank_counters: Tensor | None = None
    expert_offsets: Tensor | None = None
    recv_total_counter: Tensor | None = None
    recv_topk_idx_kind: ExpertIdKind = ExpertIdKind.AUTO


@dataclass
class DispatchInputs(_Snapshot):
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None


@dataclass
class DispatchOutputs(_Snapshot):
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None
    topk_idx: Tensor | None = None


@dataclass
class CombineInputs(_Snapshot):
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None


@dataclass
class CombineOutputs(_Snapshot):
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None


calls: list = []
live = {"groups": 0, "handles": 0}


class FakeComm:
    """Stands in for nccl.core.Communicator."""

    def __init__(self, nranks=1, rank=0):
        self.nranks, self.rank, self.destroyed, self.groups = nranks, rank, False, 0

    def destroy(self):
        calls.append(("comm.destroy",))
        need(self.groups == 0, "communicator destroyed while an EP group is alive")
        self.destroyed = True


def _is(t, dt, shape, what):
    need(t is not None, f"{what} is required")
    need(t.dt == dt, f"{what}: datatype {t.dt}, library requires {dt}")
    need(tuple(t.sizes) == tuple(shape), f"{what}: sizes {tuple(t.sizes)}, library requires {tuple(shape)}")


def _absent(t, what):
    need(t is None, f"{what} must be absent here")


class Group:
    def __init__(self, comm, cfg):
        self.comm, self.cfg, self.alive, self.handles = comm, cfg, True, 0
        self.R, self.rank = comm.nranks, comm.rank
        self.L = cfg.num_experts // self.R

    @classmethod
    def create(cls, comm, config):
        calls.append(("Group.create", config))
        need(isinstance(config, GroupConfig), "config must be a GroupConfig")
        c = lib(config)
        need(isinstance(comm, FakeComm), "Group.create needs the nccl.core communicator")
        need(c.algorithm in (Algorithm.LOW_LATENCY, Algorithm.HIGH_THROUGHPUT), "invalid algorithm")
        need(c.num_experts > 0 and c.num_experts % comm.nranks == 0, "num_experts must be > 0, a multiple of R")
        need(c.max_dispatch_tokens_per_rank > 0, "max_dispatch_tokens_per_rank must be > 0")
        need(c.max_token_bytes > 0, "max_token_bytes must be > 0")
        need(c.num_topk <= c.num_experts, "num_topk must be <= num_experts")
        if c.algorithm is Algorithm.HIGH_THROUGHPUT:
            need(c.max_token_bytes % 16 == 0, "HT max_token_bytes must be a multiple of 16")
            # our contract: a static budget (CUDA graphs; eager mode cannot be captured)
            need(c.max_recv_tokens_per_rank >= c.max_dispatch_tokens_per_rank,
                 "HT needs a static max_recv_tokens_per_rank >= max_dispatch_tokens_per_rank")
        else:
            need(c.max_recv_tokens_per_rank == 0, "LL: max_recv_tokens_per_rank is unused, pass NCCL_EP_AUTO (0)")
        need(c.overflow_policy != OverflowPolicy.DROP, "DROP not used by moe-ep")
        live["groups"] += 1
        comm.groups += 1
        return cls(comm, c)

    def create_handle(self, layout, topk_idx, *, layout_info=None, config=None, stream):
        calls.append(("Group.create_handle", layout, layout_info, topk_idx))
        need(self.alive, "Group destroyed")
        h = Handle(self, Layout(layout))
        h._bind(topk_idx, lib(layout_info))
        live["handles"] += 1
        self.handles += 1
        return h

    def destroy(self):
        calls.append(("Group.destroy",))
        need(self.handles == 0, "group destroyed before its handles")
        self.alive = False
        live["groups"] -= 1
        self.comm.groups -= 1


class Handle:
    def __init__(self, group, layout):
        g = group
        self.g, self.layout, self.alive, self.dispatched = g, layout, True, False
        ht = g.cfg.algorithm is Algorithm.HIGH_THROUGHPUT
        self.ht = ht
        need(layout != Layout.UNSET, "layout must be set explicitly")
        need(layout in ((Layout.FLAT, Layout.EXPERT_MAJOR) if ht else (Layout.EXPERT_MAJOR, Layout.RANK_MAJOR)),
             f"{'HT' if ht else 'LL'} does not support layout {layout!r}")

    def _bind(self, topk_idx, info):
        g = self.g
        need(isinstance(topk_idx, Tensor) and topk_idx.ndim == 2, "topk_idx must be a 2-D Tensor")
        need(topk_idx.dt in (I32, I64), "topk_idx must be ncclInt32 or ncclInt64")
        # moe-ep pins int64: Group.create_handle documents int64; NCCL's contrib ncclEpUpdateHandle asserts it
        need(topk_idx.dt == I64, "moe-ep contract: handle topk_idx is int64")
        self.B, self.K = topk_idx.sizes
        need(self.B <= g.cfg.max_dispatch_tokens_per_rank, "Token count exceeds max_dispatch_tokens_per_rank")
        if hasattr(self, "K0"):
            need(self.K == self.K0, "num_topk mismatch between create_handle and update")
        self.K0 = self.K
        self.idx = topk_idx.buffer
        if not self.ht:
            _absent(info, "LL create_handle/update layout_info")
            return
        if g.cfg.num_topk:
            need(self.K <= g.cfg.num_topk, "num_topk exceeds GroupConfig.num_topk")
        need(info is not None and info.recv_total_counter is not None,
             "moe-ep contract: HT passes recv_total_counter (num_recv)")
        need(info.recv_topk_idx_kind == ExpertIdKind.LOCAL, "moe-ep contract: recv_topk_idx_kind pinned to LOCAL")
        given = [t for t in (info.expert_counters, info.expert_offsets, info.recv_total_counter) if t is not None]
        need(len({t.dt for t in given}) == 1, "all preprocessing int output tensors must share dtype")
        for t in given:
            need(t.dt in (I32, I64) and t.ndim == 1, "layout_info counters must be 1-D ncclInt32/ncclInt64")
        need(tuple(info.recv_total_counter.sizes) == (1,), "recv_total_counter must be [1]")
        if self.layout == Layout.EXPERT_MAJOR:
            for t in (info.expert_counters, info.expert_offsets):
                need(t is not None and t.sizes[0] >= g.L, "HT EM: expert_counters/offsets [>= L] required")
            need(info.expert_counters.dt == I64, "HT EM: counters are int64 (seen on H200)")
        else:
            _absent(info.expert_offsets, "HT FLAT expert_offsets")
            if info.expert_counters is not None:
                need(info.expert_counters.dt == I32, "HT flat: recv_expert_counter must be ncclInt32")
        self.info = info

    def update(self, topk_idx, *, layout_info=None, stream):
        calls.append(("Handle.update", layout_info, topk_idx))
        need(self.alive, "Handle destroyed")
        self._bind(topk_idx, lib(layout_info))

    # ---- dispatch ----
    def dispatch(self, inputs, outputs, *, layout_info=None, config=None, stream):
        calls.append(("Handle.dispatch", inputs, outputs, layout_info, config))
        need(self.alive, "Handle destroyed")
        inputs, outputs, layout_info, config = lib(inputs), lib(outputs), lib(layout_info), lib(config)
        g, B, K = self.g, self.B, self.K
        R, T, L = g.R, g.cfg.max_dispatch_tokens_per_rank, g.L
        cfg = config or lib(DispatchConfig())
        need(cfg.send_only == 0 and cfg.pass_direction == PassDir.FWD, "moe-ep uses blocking forward dispatch")
        rec = cfg.quantization_recipe
        need(rec in (DispatchQuantizationRecipe.NONE, DispatchQuantizationRecipe.FWD,
                     DispatchQuantizationRecipe.DS_FP8E3M4), f"recipe {rec!r} not implemented")
        x = inputs.tokens
        need(x is not None and x.ndim == 2 and x.sizes[0] == B, "inputs.tokens must be 2D [num_tokens, hidden]")
        if rec == DispatchQuantizationRecipe.NONE:
            _absent(inputs.scales, "inputs->scales (NONE)")
            _absent(outputs.scales, "outputs->scales (NONE)")
            need(x.dt == BF16, f"inputs.tokens datatype {x.dt}: moe-ep sends bf16 rows")
            row_bytes = 2 * x.sizes[1]
        elif rec == DispatchQuantizationRecipe.FWD:
            need(cfg.round_scales == 0, "round_scales must be zero when scales are forwarded")
            # the library forwards FP32/FP16/BF16/FP8/ncclFloat4x2 rows; moe-ep sends packed FP4 or e4m3 ones
            need(x.dt in (FLOAT4X2, E4M3), f"FWD tokens datatype {x.dt}: moe-ep forwards ncclFloat4x2 (12) or "
                 "ncclFloat8e4m3 (10) rows")
            need(x.sizes[1] * _BYTES[x.dt] % 16 == 0, "QUANT_FWD token rows must be 16-byte aligned")
            s = inputs.scales
            need(s is not None and s.ndim == 2 and s.sizes[0] == B, "inputs->scales must be 2D [tokens, scales]")
            need(s.dt in (F32, E4M3, U8) and s.sizes[1] * _BYTES[s.dt] % 16 == 0,
                 "scale bytes per token must be non-zero and 16-byte aligned")
            row_bytes = x.sizes[1] * _BYTES[x.dt] + s.sizes[1] * _BYTES[s.dt]
            need(row_bytes <= g.cfg.max_token_bytes, "token bytes plus scale bytes exceed the group token-byte limit")
        else:  # DS_FP8E3M4 (nccl_ep.cc validateDispatchRecipe)
            need(not self.ht, "DS_FP8E3M4 is supported only in LL mode")
            need(x.dt == BF16, "DS_FP8E3M4 requires BF16 input tokens")
            need(x.ndim == 2 and x.sizes[1] % (4 * DS_ELEMENTS_PER_SCALE) == 0,
                 "DS_FP8E3M4 tokens must be 2D with hidden divisible by 512")
            _absent(inputs.scales, "DS_FP8E3M4 does not accept inputs->scales")
            need(cfg.round_scales == 0, "moe-ep contract: DS_FP8E3M4 with round_scales 0 (fp32 scales amax / 448)")
            row_bytes = x.sizes[1] + 4 * (x.sizes[1] // DS_ELEMENTS_PER_SCALE)
            need(row_bytes <= g.cfg.max_token_bytes,
                 "DS_FP8E3M4 token bytes plus scale bytes exceed the group token-byte limit")
        need(row_bytes <= g.cfg.max_token_bytes, "token row exceeds max_token_bytes")
        w_in = inputs.topk_weights
        if self.ht or self.layout == Layout.RANK_MAJOR:
            _is(w_in, F32, (B, K), "inputs.topk_weights")
        else:
            _absent(w_in, "LL expert-major inputs.topk_weights (topk_weights_in == nullptr)")
        out = outputs
        if self.ht:
            _absent(layout_info, "HT dispatch layout_info (counters come at handle time)")
            S = g.cfg.max_recv_tokens_per_rank
            need(S == T * R * (K if self.layout == Layout.EXPERT_MAJOR else 1),
                 f"HT budget {S}: moe-ep sizes it T*R (FLAT) or T*R*K (EXPERT_MAJOR)")
            lead = (S,)
            if self.layout == Layout.FLAT:
                _is(out.topk_weights, F32, (S, K), "HT FLAT outputs.topk_weights")
                _is(out.topk_idx, I64, (S, K), "HT FLAT outputs.topk_idx")
            else:
                _is(out.topk_weights, F32, (S,), "HT EM recv_topk_weights must be 1D [num_recv_tokens]")
                _absent(out.topk_idx, "HT EM outputs.topk_idx")
        else:
            need(layout_info is not None, "LL dispatch needs layout_info")
            if self.layout == Layout.EXPERT_MAJOR:
                lead = (L, R * T)
                _is(layout_info.expert_counters, I32, (L,), "LL EM expert_counters")
                _absent(layout_info.src_rank_counters, "LL EM src_rank_counters (src_rank_counter == nullptr)")
                _absent(out.topk_weights, "LL EM outputs.topk_weights")
                _absent(out.topk_idx, "LL EM outputs.topk_idx")
            else:
                lead = (R, T)
                _is(out.topk_weights, F32, (R, T, K), "LL RM outputs.topk_weights")
                _is(out.topk_idx, I32, (R, T, K), "LL RM outputs.topk_idx (recv_topk_idx->datatype == ncclInt32)")
                _is(layout_info.src_rank_counters, I32, (R,), "LL RM src_rank_counters")
                _absent(layout_info.expert_counters, "LL RM expert_counters (recv_count == nullptr)")
                need(layout_info.recv_topk_idx_kind == ExpertIdKind.LOCAL,
                     "moe-ep contract: recv_topk_idx_kind pinned to LOCAL")
        if rec == DispatchQuantizationRecipe.DS_FP8E3M4:
            _is(out.tokens, E4M3, (*lead, x.sizes[1]), "DS_FP8E3M4 requires E4M3 output tokens")
            _is(out.scales, F32, (*lead, x.sizes[1] // DS_ELEMENTS_PER_SCALE),
                "DS_FP8E3M4 outputs->scales must be FP32 3D matching the selected layout and hidden / 128")
        else:
            _is(out.tokens, x.dt, (*lead, x.sizes[1]), "outputs.tokens")
        if rec == DispatchQuantizationRecipe.FWD:
            _is(out.scales, inputs.scales.dt, (*lead, inputs.scales.sizes[1]), "outputs.scales")
        self.out_shape = tuple(out.tokens.sizes)
        self.dispatched = True
        if R == 1:
            self._move(inputs, out, layout_info, rec)

    def _move(self, inputs, out, info, rec):
        """World size 1: do what the library does (rows past the counts get garbage)."""
        idx, B, K = self.idx, self.B, self.K
        L = self.g.L
        x = inputs.tokens.buffer
        sx = inputs.scales.buffer if inputs.scales is not None else None
        if rec == DispatchQuantizationRecipe.DS_FP8E3M4:  # quantized on the send side, moved as rows + scales
            x, sx = ds_fp8e3m4(x)
        w = inputs.topk_weights.buffer if inputs.topk_weights is not None else None
        ot, os_ = out.tokens.buffer, out.scales.buffer if out.scales is not None else None
        _garbage(ot)
        if os_ is not None:
            _garbage(os_)
        valid = idx >= 0
        self.slots = []
        if not self.ht and self.layout == Layout.EXPERT_MAJOR:
            cnt = info.expert_counters.buffer
            for e in range(L):
                rows = [b for b in range(B) if (idx[b] == e).any()]
                cnt[e] = len(rows)
                for j, b in enumerate(rows):
                    ot[e, j] = x[b]
                    if os_ is not None:
                        os_[e, j] = sx[b]
            self.rows = [[b for b in range(B) if (idx[b] == e).any()] for e in range(L)]
        elif not self.ht:
            ot[0, :B] = x
            if os_ is not None:
                os_[0, :B] = sx
            oi, ow = out.topk_idx.buffer, out.topk_weights.buffer
            oi.fill_(-7)
            ow.fill_(float("nan"))
            oi[0, :B] = torch.where(valid, idx, -1).to(oi.dtype)
            ow[0, :B] = w
            info.src_rank_counters.buffer[0] = B
        elif self.layout == Layout.FLAT:
            rows = [b for b in range(B) if valid[b].any()]
            oi, ow = out.topk_idx.buffer, out.topk_weights.buffer
            oi.fill_(-7)
            ow.fill_(float("nan"))
            for j, b in enumerate(rows):
                ot[j] = x[b]
                if os_ is not None:
                    os_[j] = sx[b]
                oi[j] = torch.where(valid[b], idx[b], -1)
                ow[j] = w[b]
            self.rows = rows
            self.info.recv_total_counter.buffer[0] = len(rows)
        else:
            ow = out.topk_weights.buffer
            ow.fill_(float("nan"))
            cnt, off = self.info.expert_counters.buffer, self.info.expert_offsets.buffer
            j, self.rows = 0, []
            for e in range(L):
                off[e] = j
                for b in range(B):
                    for k in range(K):
                        if idx[b, k] == e:
                            ot[j] = x[b]
                            if os_ is not None:
                                os_[j] = sx[b]
                            ow[j] = w[b, k]
                            self.rows.append(b)
                            j += 1
                cnt[e] = j - off[e]
            self.info.recv_total_counter.buffer[0] = j

    # ---- combine ----
    def combine(self, inputs, outputs, *, config=None, stream):
        calls.append(("Handle.combine", inputs, outputs, config))
        need(self.alive and self.dispatched, "combine needs the handle of a dispatch")
        inputs, outputs = lib(inputs), lib(outputs)
        cfg = lib(config) or lib(CombineConfig())
        need(cfg.pass_direction == PassDir.FWD and cfg.send_only == 0, "moe-ep uses blocking forward combine")
        need(cfg.quantization_recipe == CombineQuantizationRecipe.NONE, "combine recipe NONE")
        _absent(inputs.topk_weights, "inputs.topk_weights (FWD combine forbids it)")
        _absent(inputs.scales, "inputs.scales (NONE)")
        _is(inputs.tokens, BF16, self.out_shape[:-1] + (inputs.tokens.sizes[-1],), "combine inputs.tokens")
        H = inputs.tokens.sizes[-1]
        need(self.ht or H % 128 == 0, "LL combine: x->sizes[2] % 128 == 0")
        _is(outputs.tokens, BF16, (self.B, H), "combine outputs.tokens")
        if not self.ht and self.layout == Layout.EXPERT_MAJOR:
            _is(outputs.topk_weights, F32, (self.B, self.K), "expert-major combine requires topk_weights in outputs")
        else:
            _absent(outputs.topk_weights, "combine outputs.topk_weights (only LL expert-major)")
        if self.g.R == 1:
            y, o = inputs.tokens.buffer.float(), outputs.tokens.buffer
            acc = torch.zeros(self.B, H)
            if not self.ht and self.layout == Layout.EXPERT_MAJOR:
                w = outputs.topk_weights.buffer
                for e, rows in enumerate(self.rows):
                    for j, b in enumerate(rows):
                        for k in range(self.K):
                            if self.idx[b, k] == e:
                                acc[b] += w[b, k] * y[e, j]
            elif not self.ht:
                acc = y[0, :self.B].clone()
            else:
                for j, b in enumerate(self.rows):
                    acc[b] += y[j]
            o.copy_(acc.to(torch.bfloat16))

    def destroy(self):
        calls.append(("Handle.destroy",))
        if self.alive:
            live["handles"] -= 1
            self.g.handles -= 1
        self.alive = False


def _garbage(t):
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(0xA5 if t.dtype == torch.uint8 else -7)


def get_nccl_comm_from_group(group=None):
    calls.append(("get_nccl_comm_from_group", group))
    return FakeComm(*(group if isinstance(group, tuple) else (1, 0)))


def make_module():
    """A fresh ``nccl.ep``-shaped module object (with ``interop.torch``); resets the call log."""
    calls.clear()
    live.update(groups=0, handles=0)
    m = types.ModuleType("nccl.ep")
    for name, obj in list(globals().items()):
        if isinstance(obj, type) or name in ("get_nccl_comm_from_group",):
            setattr(m, name, obj)
    m.calls, m.live = calls, live
    m.interop = types.SimpleNamespace(torch=types.SimpleNamespace(get_nccl_comm_from_group=get_nccl_comm_from_group))
    return m
