"""MoEEpBlock: a transformers MoE block whose routed experts run through moe-ep."""

from __future__ import annotations

import torch

from ..config import EpConfig
from ..fused import fused_moe
from ..layer import MoEEpLayer
from ..weights import ExpertWeights
from .blocks import Routing, route


class MoEEpBlock(torch.nn.Module):
    """Replaces one sparse MoE block: the block's own router (``gate``, the model's module, in the model's
    dtype) picks the experts, moe-ep runs the routed experts (bf16 in and out; the routing weights applied
    in fp32), and the block's ``shared_experts`` (DeepSeek-V3), if any, are added as the block adds them.

    ``experts``: a :class:`~moe_ep.MoEEpLayer` holding this rank's shard when the group spans several ranks
    (every rank must then run the model's forward in step: each block's forward is one collective), else
    an :class:`~moe_ep.ExpertWeights` of all experts for :func:`~moe_ep.fused_moe`.

    ``forward(hidden_states [..., H])`` returns what the original block returned: ``hidden_states`` of the
    same shape and dtype, or ``(hidden_states, router_logits [tokens, E])`` for the blocks that returned
    that pair. Inference only (call it under ``torch.no_grad()``); with several ranks at most
    ``EpConfig.max_tokens_per_rank`` tokens per forward.
    """

    def __init__(self, gate: torch.nn.Module, experts: MoEEpLayer | ExpertWeights, config: EpConfig, *,
                 normalize: bool, shared_experts: torch.nn.Module | None, returns_logits: bool,
                 original: str):
        super().__init__()
        self.gate = gate
        self.shared_experts = shared_experts
        self.config, self.normalize, self.returns_logits, self.original = config, normalize, returns_logits, original
        if isinstance(experts, MoEEpLayer):
            self.experts, self.weights = experts, None
        else:
            self.experts, self.weights = None, experts

    def extra_repr(self) -> str:
        c = self.config
        where = f"world size {self.experts.world_size}" if self.experts is not None else "fused_moe"
        return (f"{self.original}: E={c.num_experts}, top_k={c.top_k}, H={c.hidden_size}, I={c.intermediate_size}, "
                f"{where}, weights {c.weight_format.value}, activations {c.activation_format.value}")

    def route(self, x: torch.Tensor) -> Routing:
        """The original block's routing of ``x [B, H]`` (the model's dtype): logits, weights, int64 ids."""
        r = route(self.gate, x, self.config.top_k, self.normalize)
        return Routing(r.logits, r.weights, r.ids.long())

    def routed_experts(self, x: torch.Tensor, r: Routing) -> torch.Tensor:
        """``[B, H]`` in ``x``'s dtype: the routed experts' weighted sum for ``x [B, H]``."""
        xb, ids, w = x.to(torch.bfloat16).contiguous(), r.ids.contiguous(), r.weights.float().contiguous()
        if self.experts is not None:
            y = self.experts(xb, ids, w)
        else:
            y = fused_moe(xb, ids, w, self.weights, activation_format=self.config.activation_format,
                          activation_global_scale=self.config.activation_global_scale)
        return y.to(x.dtype)

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        r = self.route(x)
        out = self.routed_experts(x, r).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return (out, r.logits) if self.returns_logits else out


__all__ = ["MoEEpBlock"]
