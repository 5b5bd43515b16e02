"""A toy expert compute that obeys the layout contract, for checking transports without the real experts.

Expert ``e`` (global id) multiplies a row by ``2**-(e % 3)`` (exact in bf16). ``toy_compute`` turns a
DispatchResult into what combine expects for each layout (weights applied where the contract says);
``toy_reference`` is what combine must then return: ``out[b] = sum_k w[b,k] * 2**-(e_bk % 3) * x[b]``.
Rows past the valid counts are never read (they may be garbage, NaN included).
"""

from __future__ import annotations

import torch

from ..config import Algorithm, EpConfig, Layout
from .base import DispatchResult


def expert_scale(e: torch.Tensor) -> torch.Tensor:
    """The toy expert's factor for global expert ids ``e`` (float32)."""
    return torch.exp2(-(e.remainder(3)).float())


def _reduce(x, idx, w, valid_rows, first):
    """fp32 sum over the local picks of w * scale * x, zero where the row or the pick is not valid."""
    ok = (idx >= 0) & valid_rows.unsqueeze(-1)
    f = torch.where(ok, w.float() * expert_scale(idx.long().clamp(min=0) + first), torch.zeros((), device=w.device))
    xs = torch.where(valid_rows.unsqueeze(-1), x.float(), torch.zeros((), device=x.device))
    return (f.sum(-1, keepdim=True) * xs).to(torch.bfloat16)


def toy_compute(res: DispatchResult, config: EpConfig, rank: int, world: int) -> torch.Tensor:
    """The compute's output for ``res`` (bf16 tokens) in the layout's shape."""
    L = config.local_experts(world)
    first = rank * L
    x = res.tokens
    dev = x.device
    if config.algorithm is Algorithm.LOW_LATENCY and config.layout is Layout.EXPERT_MAJOR:
        return (x.float() * expert_scale(torch.arange(L, device=dev) + first).view(L, 1, 1)).to(torch.bfloat16)
    if config.layout is Layout.RANK_MAJOR:
        T = x.shape[1]
        valid = torch.arange(T, device=dev).view(1, T) < res.src_rank_counts.view(-1, 1).to(dev)
        return _reduce(x, res.topk_idx, res.topk_weights, valid, first)
    S = x.shape[0]
    valid = torch.arange(S, device=dev) < res.num_recv.to(dev)
    if config.layout is Layout.FLAT:
        return _reduce(x, res.topk_idx, res.topk_weights, valid, first)
    # HT EXPERT_MAJOR: slot s belongs to the expert whose [offset, offset + count) holds it
    off, cnt = res.expert_offsets.long().to(dev), res.expert_counts.long().to(dev)
    s = torch.arange(S, device=dev).view(S, 1)
    member = (s >= off.view(1, L)) & (s < (off + cnt).view(1, L))
    e = member.float().argmax(1) + first
    ok = valid & member.any(1)
    f = torch.where(ok, res.topk_weights.float() * expert_scale(e), torch.zeros((), device=dev))
    xs = torch.where(ok.unsqueeze(-1), x.float(), torch.zeros((), device=dev))
    return (f.unsqueeze(-1) * xs).to(torch.bfloat16)


def toy_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """What combine(toy_compute(dispatch(x, topk_idx, topk_weights))) should give, in fp32."""
    ok = topk_idx >= 0
    f = torch.where(ok, topk_weights.float() * expert_scale(topk_idx.long().clamp(min=0)),
                    torch.zeros((), device=x.device))
    return f.sum(-1, keepdim=True) * x.float()
