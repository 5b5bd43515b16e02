"""The layout contract (DESIGN.md): what a transport's dispatch hands the expert compute, one type per layout.

Notation: B tokens on this rank, H hidden, K top-k, R ranks, L = E/R local experts, T = max tokens per rank,
S received slots (HT). Ids the compute sees are *local* expert ids; -1 means "not here".

| algorithm, layout | dispatch result type | compute returns for combine | routing weights applied by |
|---|---|---|---|
| LL, EXPERT_MAJOR | :class:`LowLatencyExpertMajor` | ``[L, R*T, H]`` | the transport's combine |
| LL, RANK_MAJOR | :class:`LowLatencyRankMajor` | ``[R, T, H]``: per row, sum over its local picks of w * expert(x) | compute |
| HT, FLAT | :class:`HighThroughputFlat` | ``[S, H]``, pre-reduced as above | compute |
| HT, EXPERT_MAJOR | :class:`HighThroughputExpertMajor` | ``[S, H]``, each slot scaled by its weight | compute |

``tokens`` is a bf16 tensor, or with NVFP4 activations an :class:`~moe_ep.kernels.nvfp4.NvFp4Tensor` of the same
logical shape (packed uint8 ``[..., H/2]``, linear e4m3 scales ``[..., H/16]``, one global scale per row: each
row keeps its source rank's), or with FP8 activations an :class:`~moe_ep.kernels.fp8.Fp8Tensor` of the same shape
(``block_rows`` 1: float8_e4m3fn data ``[..., H]``, fp32 scales ``[..., ceil(H/128)]``, one per row per 128
channels). Rows past the valid counts are garbage (NaN included) and never read.

Each type checks its fields' ranks, agreeing dimensions, dtypes and devices when it is built (a few attribute
compares: this runs every forward; no host sync, no value checks) and raises :class:`MoEEpInputError` naming the
field. The results are views of a transport's buffers, valid until its next dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .config import Algorithm, EpConfig, Layout
from .errors import fail
from .kernels.fp8 import Fp8Tensor
from .kernels.nvfp4 import NvFp4Tensor


def _tokens(owner: str, tokens, ndim: int) -> tuple[torch.Size, torch.device]:
    """(logical shape, device) of ``tokens`` once it is a bf16 ``ndim``-D tensor, an NvFp4Tensor or a per-row
    Fp8Tensor, else raise (an Fp8Tensor checked its own parts against each other when it was made)."""
    if isinstance(tokens, torch.Tensor):
        shape = tokens.shape
        if tokens.dtype is not torch.bfloat16 or len(shape) != ndim:
            fail(f"{owner}.tokens", f"{tuple(shape)} {tokens.dtype}", f"a {ndim}-D torch.bfloat16 tensor")
        return shape, tokens.device
    if isinstance(tokens, NvFp4Tensor):
        data = tokens.data
        if len(tokens.shape) != ndim or data.dtype is not torch.uint8:
            fail(f"{owner}.tokens", f"NvFp4Tensor {tuple(tokens.shape)} data {data.dtype}",
                 f"an NvFp4Tensor of {ndim}-D logical shape (uint8 data)")
        return tokens.shape, data.device
    if isinstance(tokens, Fp8Tensor):
        if tokens.data.dim() != ndim or tokens.block_rows != 1:
            fail(f"{owner}.tokens", f"Fp8Tensor {tuple(tokens.shape)} block_rows={tokens.block_rows}",
                 f"an Fp8Tensor of {ndim}-D shape with block_rows 1 (one scale per row per 128 channels)")
        return tokens.shape, tokens.data.device
    fail(f"type({owner}.tokens)", type(tokens).__name__, "torch.Tensor (bf16), NvFp4Tensor or Fp8Tensor")


def _last_dim(t, ndim: int) -> int:
    """``t``'s last dimension when it is an ``ndim``-D tensor (a field whose width the contract leaves free)."""
    return t.shape[-1] if isinstance(t, torch.Tensor) and t.dim() == ndim else -1


def _field(owner: str, name: str, t, dtype: torch.dtype, device: torch.device, shape: tuple) -> None:
    """Raise unless ``t`` is a ``dtype`` tensor of exactly ``shape`` on ``device`` (one shape read: it costs)."""
    if not (isinstance(t, torch.Tensor) and t.dtype is dtype and t.shape == shape and t.device == device):
        got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        fail(f"{owner}.{name}", got, f"{list(shape)} {dtype} on {device} (the layout contract, moe_ep/layout_contract.py)")


@dataclass(frozen=True, eq=False)
class LowLatencyExpertMajor:
    """LL EXPERT_MAJOR: ``tokens [L, R*T, H]`` (expert e's rows at ``[e, :expert_counts[e]]``, the rest
    garbage), ``expert_counts [L]`` int32. The compute returns ``[L, R*T, H]`` unweighted: the transport's
    combine applies the routing weights (on the receive side)."""

    algorithm: ClassVar[Algorithm] = Algorithm.LOW_LATENCY
    layout: ClassVar[Layout] = Layout.EXPERT_MAJOR
    weights_applied_by_combine: ClassVar[bool] = True

    tokens: torch.Tensor | NvFp4Tensor | Fp8Tensor
    expert_counts: torch.Tensor

    def __post_init__(self):
        (L, _, _), dev = _tokens("LowLatencyExpertMajor", self.tokens, 3)
        _field("LowLatencyExpertMajor", "expert_counts", self.expert_counts, torch.int32, dev, (L,))


@dataclass(frozen=True, eq=False)
class LowLatencyRankMajor:
    """LL RANK_MAJOR: ``tokens [R, T, H]`` (source rank r's tokens at ``[r, :src_rank_counts[r]]``),
    ``topk_idx [R, T, K]`` int32 local expert ids or -1, ``topk_weights [R, T, K]`` float32,
    ``src_rank_counts [R]`` int32. The compute returns ``[R, T, H]``: per row, the weighted sum over its local
    picks."""

    algorithm: ClassVar[Algorithm] = Algorithm.LOW_LATENCY
    layout: ClassVar[Layout] = Layout.RANK_MAJOR
    weights_applied_by_combine: ClassVar[bool] = False

    tokens: torch.Tensor | NvFp4Tensor | Fp8Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    src_rank_counts: torch.Tensor

    def __post_init__(self):
        (R, T, _), dev = _tokens("LowLatencyRankMajor", self.tokens, 3)
        picks = (R, T, _last_dim(self.topk_idx, 3))
        _field("LowLatencyRankMajor", "topk_idx", self.topk_idx, torch.int32, dev, picks)
        _field("LowLatencyRankMajor", "topk_weights", self.topk_weights, torch.float32, dev, picks)
        _field("LowLatencyRankMajor", "src_rank_counts", self.src_rank_counts, torch.int32, dev, (R,))


@dataclass(frozen=True, eq=False)
class HighThroughputFlat:
    """HT FLAT: ``tokens [S, H]`` (the first ``num_recv`` rows valid), ``topk_idx [S, K]`` int64 local expert
    ids or -1, ``topk_weights [S, K]`` float32, ``num_recv`` a 0-d int64 tensor. The compute returns
    ``[S, H]``: per row, the weighted sum over its local picks."""

    algorithm: ClassVar[Algorithm] = Algorithm.HIGH_THROUGHPUT
    layout: ClassVar[Layout] = Layout.FLAT
    weights_applied_by_combine: ClassVar[bool] = False

    tokens: torch.Tensor | NvFp4Tensor | Fp8Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_recv: torch.Tensor

    def __post_init__(self):
        (S, _), dev = _tokens("HighThroughputFlat", self.tokens, 2)
        picks = (S, _last_dim(self.topk_idx, 2))
        _field("HighThroughputFlat", "topk_idx", self.topk_idx, torch.int64, dev, picks)
        _field("HighThroughputFlat", "topk_weights", self.topk_weights, torch.float32, dev, picks)
        _field("HighThroughputFlat", "num_recv", self.num_recv, torch.int64, dev, ())


@dataclass(frozen=True, eq=False)
class HighThroughputExpertMajor:
    """HT EXPERT_MAJOR: ``tokens [S, H]`` grouped by local expert (expert e's slots at
    ``[expert_offsets[e], expert_offsets[e] + expert_counts[e])``), ``expert_offsets [L]`` and
    ``expert_counts [L]`` int64, ``topk_weights [S]`` float32 (one per slot), ``num_recv`` a 0-d int64 tensor
    (the valid slots). The compute returns ``[S, H]``, each slot scaled by its weight."""

    algorithm: ClassVar[Algorithm] = Algorithm.HIGH_THROUGHPUT
    layout: ClassVar[Layout] = Layout.EXPERT_MAJOR
    weights_applied_by_combine: ClassVar[bool] = False

    tokens: torch.Tensor | NvFp4Tensor | Fp8Tensor
    expert_offsets: torch.Tensor
    expert_counts: torch.Tensor
    topk_weights: torch.Tensor
    num_recv: torch.Tensor

    def __post_init__(self):
        (S, _), dev = _tokens("HighThroughputExpertMajor", self.tokens, 2)
        experts = (_last_dim(self.expert_offsets, 1),)
        _field("HighThroughputExpertMajor", "expert_offsets", self.expert_offsets, torch.int64, dev, experts)
        _field("HighThroughputExpertMajor", "expert_counts", self.expert_counts, torch.int64, dev, experts)
        _field("HighThroughputExpertMajor", "topk_weights", self.topk_weights, torch.float32, dev, (S,))
        _field("HighThroughputExpertMajor", "num_recv", self.num_recv, torch.int64, dev, ())


DispatchResult = LowLatencyExpertMajor | LowLatencyRankMajor | HighThroughputFlat | HighThroughputExpertMajor
"""What ``Transport.dispatch`` returns: one of the four result types."""

RESULT_TYPES: dict[tuple[Algorithm, Layout], type] = {
    (t.algorithm, t.layout): t
    for t in (LowLatencyExpertMajor, LowLatencyRankMajor, HighThroughputFlat, HighThroughputExpertMajor)}
"""The result type of each pair of :data:`moe_ep.config.SUPPORTED_LAYOUTS` (same keys, same order)."""


def result_type(config: EpConfig) -> type:
    """The type ``config``'s dispatch returns (its algorithm and layout are a supported pair: EpConfig checks)."""
    return RESULT_TYPES[(config.algorithm, config.layout)]


__all__ = ["LowLatencyExpertMajor", "LowLatencyRankMajor", "HighThroughputFlat", "HighThroughputExpertMajor",
           "DispatchResult", "RESULT_TYPES", "result_type"]
