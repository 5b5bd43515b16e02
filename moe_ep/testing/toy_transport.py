"""A toy expert compute that obeys the layout contract, for checking transports without the real experts.

Expert ``e`` (global id) multiplies a row by ``2**-(e % 3)`` (exact in bf16). ``toy_compute`` turns a dispatch
result (``moe_ep.layout_contract``) into what combine expects for its layout (weights applied where the contract
says); ``toy_reference`` is what combine must then return: ``out[b] = sum_k w[b,k] * 2**-(e_bk % 3) * x[b]``.
Rows past the valid counts are never read (they may be garbage, NaN included); :func:`valid_rows` says which are
valid. FP8 tokens (an ``Fp8Tensor``) go through the toy experts as their value, ``data * scale``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import EpConfig
from ..kernels.fp8 import Fp8Tensor
from ..layout_contract import (DispatchResult, HighThroughputExpertMajor, HighThroughputFlat, LowLatencyExpertMajor,
                               LowLatencyRankMajor)


def expert_scale(e: torch.Tensor) -> torch.Tensor:
    """The toy expert's factor for global expert ids ``e`` (float32)."""
    return torch.exp2(-(e.remainder(3)).float())


def _reduce(x, idx, w, valid_rows, first):
    """fp32 sum over the local picks of w * scale * x, zero where the row or the pick is not valid."""
    ok = (idx >= 0) & valid_rows.unsqueeze(-1)
    f = torch.where(ok, w.float() * expert_scale(idx.long().clamp(min=0) + first), torch.zeros((), device=w.device))
    xs = torch.where(valid_rows.unsqueeze(-1), x.float(), torch.zeros((), device=x.device))
    return (f.sum(-1, keepdim=True) * xs).to(torch.bfloat16)


def _ll_expert_major(res: LowLatencyExpertMajor, L: int, first: int) -> torch.Tensor:
    x = res.tokens
    return (x.float() * expert_scale(torch.arange(L, device=x.device) + first).view(L, 1, 1)).to(torch.bfloat16)


def _ll_rank_major(res: LowLatencyRankMajor, L: int, first: int) -> torch.Tensor:
    x = res.tokens
    T = x.shape[1]
    valid = torch.arange(T, device=x.device).view(1, T) < res.src_rank_counts.view(-1, 1).to(x.device)
    return _reduce(x, res.topk_idx, res.topk_weights, valid, first)


def _ht_flat(res: HighThroughputFlat, L: int, first: int) -> torch.Tensor:
    x = res.tokens
    valid = torch.arange(x.shape[0], device=x.device) < res.num_recv.to(x.device)
    return _reduce(x, res.topk_idx, res.topk_weights, valid, first)


def _ht_expert_major(res: HighThroughputExpertMajor, L: int, first: int) -> torch.Tensor:
    """Slot s belongs to the expert whose [offset, offset + count) holds it."""
    x = res.tokens
    S, dev = x.shape[0], x.device
    valid = torch.arange(S, device=dev) < res.num_recv.to(dev)
    off, cnt = res.expert_offsets.long().to(dev), res.expert_counts.long().to(dev)
    s = torch.arange(S, device=dev).view(S, 1)
    member = (s >= off.view(1, L)) & (s < (off + cnt).view(1, L))
    e = member.float().argmax(1) + first
    ok = valid & member.any(1)
    f = torch.where(ok, res.topk_weights.float() * expert_scale(e), torch.zeros((), device=dev))
    xs = torch.where(ok.unsqueeze(-1), x.float(), torch.zeros((), device=dev))
    return (f.unsqueeze(-1) * xs).to(torch.bfloat16)


TOY_COMPUTE = {LowLatencyExpertMajor: _ll_expert_major, LowLatencyRankMajor: _ll_rank_major,
               HighThroughputFlat: _ht_flat, HighThroughputExpertMajor: _ht_expert_major}


def toy_compute(res: DispatchResult, config: EpConfig, rank: int, world: int) -> torch.Tensor:
    """The compute's output for ``res`` (bf16 tokens, or FP8 ones taken at their value) in its layout's shape."""
    if isinstance(res.tokens, Fp8Tensor):
        from ..reference import dequantize_fp8_ref
        q = res.tokens
        res = dataclasses.replace(res, tokens=dequantize_fp8_ref(q.data, q.scales, 1).to(torch.bfloat16))
    L = config.local_experts(world)
    return TOY_COMPUTE[type(res)](res, L, rank * L)


def valid_rows(res: DispatchResult) -> torch.Tensor:
    """Which rows of ``res.tokens`` the layout contract says are valid: bool, the tokens' leading shape, on their
    device (expert e's first ``expert_counts[e]``, rank r's first ``src_rank_counts[r]``, or the first
    ``num_recv``)."""
    n, dev = res.tokens.shape, res.tokens.device
    if isinstance(res, LowLatencyExpertMajor):
        return torch.arange(n[1], device=dev) < res.expert_counts.long().view(-1, 1)
    if isinstance(res, LowLatencyRankMajor):
        return torch.arange(n[1], device=dev) < res.src_rank_counts.long().view(-1, 1)
    return torch.arange(n[0], device=dev) < res.num_recv.long()


def toy_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """What combine(toy_compute(dispatch(x, topk_idx, topk_weights))) should give, in fp32."""
    ok = topk_idx >= 0
    f = torch.where(ok, topk_weights.float() * expert_scale(topk_idx.long().clamp(min=0)),
                    torch.zeros((), device=x.device))
    return f.sum(-1, keepdim=True) * x.float()
