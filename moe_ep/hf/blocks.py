"""The transformers MoE blocks moe-ep converts: how each routes, what else it computes, what it returns.

Each block keeps its router module (``block.gate``) as the model holds it. Where that module computes the
routing itself (transformers 5.x: ``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``DeepseekV3TopkRouter``
returning ``(router_logits, topk_weights, topk_ids)``; DeepSeek-V3 in 4.x returning ``(topk_ids,
topk_weights)``) it is called as it is. Where the gate is a plain ``nn.Linear`` and the block's forward does
the softmax and top-k (Qwen3-MoE and Mixtral in 4.x), :func:`softmax_topk` does what that forward does;
those blocks return ``(hidden_states, router_logits)``, the others ``hidden_states`` alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..errors import MoEEpConfigError, fail


class Routing(NamedTuple):
    """One routed batch: ``logits [B, E]`` (or None where the router does not return them), ``weights
    [B, K]`` as the block's router gives them (its dtype), ``ids [B, K]`` int64 global expert ids."""
    logits: torch.Tensor | None
    weights: torch.Tensor
    ids: torch.Tensor


def softmax_topk(gate: torch.nn.Linear, x: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """A 4.x Qwen3-MoE / Mixtral block's inline routing: logits in the model's dtype, softmax in fp32, top-k,
    the top-k probabilities renormalized where ``normalize``, then cast back to the hidden states' dtype."""
    logits = gate(x)
    probs = F.softmax(logits, dim=1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits, weights.to(x.dtype), ids)


def route(block_gate: torch.nn.Module, x: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """The routing of ``x [B, H]`` (the model's dtype) by the block's own router ``block_gate``."""
    if isinstance(block_gate, torch.nn.Linear):
        return softmax_topk(block_gate, x, top_k, normalize)
    out = block_gate(x)
    if len(out) == 3:  # 5.x: (router_logits, topk_weights, topk_ids)
        return Routing(out[0], out[1], out[2])
    return Routing(None, out[1], out[0])  # DeepSeek-V3 4.x: (topk_ids, topk_weights)


@dataclass(frozen=True)
class BlockSpec:
    """What converting one block class needs: its top-k, whether its inline routing (a Linear gate)
    renormalizes the top-k probabilities, and its shared experts (None: none)."""
    top_k: Callable[[torch.nn.Module], int]
    normalize: Callable[[torch.nn.Module], bool]
    shared_experts: Callable[[torch.nn.Module], torch.nn.Module | None] = lambda block: None


def _top_k(block: torch.nn.Module) -> int:
    for owner in (block, block.gate):
        k = getattr(owner, "top_k", None)
        if isinstance(k, int) and k > 0:
            return k
    fail(f"{type(block).__name__} top_k", None, "a block or router with an int top_k", MoEEpConfigError)


SUPPORTED: dict[str, BlockSpec] = {
    "Qwen3MoeSparseMoeBlock": BlockSpec(_top_k, lambda b: bool(getattr(b, "norm_topk_prob", False))),
    "MixtralSparseMoeBlock": BlockSpec(_top_k, lambda b: True),  # Mixtral always renormalizes
    "DeepseekV3MoE": BlockSpec(_top_k, lambda b: False, lambda b: b.shared_experts),
}
"""The block classes (by name, as transformers names them in 4.57 and 5.x) and how to convert each."""


def is_unsupported_moe(module: torch.nn.Module) -> bool:
    """A module that looks like an MoE block (its class name says MoE and it holds experts) but is not one of
    :data:`SUPPORTED`."""
    name = type(module).__name__
    return ("moe" in name.lower() and name not in SUPPORTED
            and isinstance(getattr(module, "experts", None), torch.nn.Module))
