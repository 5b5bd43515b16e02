"""Reading a transformers MoE block's routed experts into moe-ep's layout, one shard at a time.

moe-ep's layout: ``w13 [L, 2I, H]`` (gate rows, then up rows) and ``w2 [L, H, I]``, each expert
``w2 @ (silu(w1 x) * (w3 x))``. transformers holds the experts in one of several layouts, depending on its
version; each has one reader below, and :data:`READERS` lists them in the order they are tried. A reader
takes the ``experts`` module and the slice of experts this rank keeps and returns fresh (copied) tensors
of that slice only, so no full copy of the experts survives conversion.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import MoEEpConfigError, fail

Shard = tuple[torch.Tensor, torch.Tensor]


def _detached(p: torch.Tensor) -> torch.Tensor:
    return p.detach()


def read_fused(experts: torch.nn.Module, sl: slice) -> Shard | None:
    """transformers 5.x: one module holding ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (its
    forward: ``gate, up = linear(x, gate_up_proj[e]).chunk(2)``; ``linear(act(gate) * up, down_proj[e])``),
    or ``[E, H, 2I]`` / ``[E, I, H]`` where the class says ``is_transposed``, gate and up rows interleaved
    where it says ``is_concatenated=False``."""
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None
    name = type(experts).__name__
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
        fail(f"{name} expert biases", True, "experts without biases (moe-ep's experts have none)", MoEEpConfigError)
    if not getattr(experts, "has_gate", True):
        fail(f"{name}.has_gate", False, "gated (SwiGLU) experts", MoEEpConfigError)
    gu, down = _detached(gu[sl]), _detached(down[sl])
    if getattr(experts, "is_transposed", False):  # [L, H, 2I] / [L, I, H]
        gu, down = gu.transpose(1, 2), down.transpose(1, 2)
    if not getattr(experts, "is_concatenated", True):  # rows gate0, up0, gate1, up1, ...
        gu = torch.cat([gu[:, 0::2], gu[:, 1::2]], dim=1)
    _check_activation(name, getattr(experts, "act_fn", None))
    return gu.contiguous().clone(), down.contiguous().clone()


def _per_expert(names: tuple[str, str, str]) -> Callable[[torch.nn.Module, slice], Shard | None]:
    """A reader of a ModuleList of per-expert MLPs whose Linear layers are named (gate, up, down)."""
    g, u, d = names

    def read(experts: torch.nn.Module, sl: slice) -> Shard | None:
        if not isinstance(experts, torch.nn.ModuleList) or not len(experts):
            return None
        if not all(isinstance(getattr(m, n, None), torch.nn.Linear) for m in experts for n in names):
            return None
        for m in experts:
            for n in names:
                if getattr(m, n).bias is not None:
                    fail(f"{type(m).__name__}.{n}.bias", "present", "experts without biases", MoEEpConfigError)
        picked = list(experts)[sl]
        _check_activation(type(picked[0]).__name__ if picked else "experts",
                          getattr(picked[0], "act_fn", None) if picked else F.silu)
        w13 = torch.stack([torch.cat([_detached(getattr(m, g).weight), _detached(getattr(m, u).weight)]) for m in picked])
        w2 = torch.stack([_detached(getattr(m, d).weight) for m in picked])
        return w13, w2

    read.__doc__ = f"transformers 4.x: a ModuleList of experts with Linear {g}/{u}/{d} (gate, up, down)."
    return read


read_gate_up_down = _per_expert(("gate_proj", "up_proj", "down_proj"))  # Qwen3-MoE, DeepSeek-V3 (4.x)
read_w1_w3_w2 = _per_expert(("w1", "w3", "w2"))  # Mixtral (4.x): w1 gate, w3 up, w2 down

READERS = (read_fused, read_gate_up_down, read_w1_w3_w2)
"""Every layout understood, tried in order; adding a layout is adding a reader here."""


def _check_activation(owner: str, act) -> None:
    """The experts' activation must be SiLU (moe-ep computes SwiGLU): checked on a probe, whatever its class."""
    probe = torch.linspace(-6, 6, 25)
    try:
        ok = callable(act) and torch.allclose(act(probe), F.silu(probe), atol=1e-6)
    except Exception:  # noqa: BLE001 (an activation that cannot run on a probe is no SiLU)
        ok = False
    if not ok:
        fail(f"{owner}.act_fn", type(act).__name__, "SiLU (hidden_act 'silu': moe-ep's experts are SwiGLU)",
             MoEEpConfigError)


def read_experts(experts: torch.nn.Module, sl: slice, hidden_size: int) -> Shard:
    """``(w13 [L, 2I, H], w2 [L, H, I])`` of experts ``sl`` of ``experts``, fresh tensors in its dtype and on
    its device. Raises :class:`MoEEpConfigError` for a layout no reader knows, or one inconsistent with H."""
    for reader in READERS:
        shard = reader(experts, sl)
        if shard is not None:
            w13, w2 = shard
            L, two_i, H = w13.shape
            if H != hidden_size or two_i % 2 or tuple(w2.shape) != (L, H, two_i // 2):
                fail(f"{type(experts).__name__} weight shapes (w13, w2)", (tuple(w13.shape), tuple(w2.shape)),
                     f"([L, 2I, {hidden_size}], [L, {hidden_size}, I])", MoEEpConfigError)
            return w13, w2
    fail(f"experts layout of {type(experts).__name__}", "unknown",
         "fused gate_up_proj/down_proj parameters, or a ModuleList of experts with gate_proj/up_proj/down_proj "
         "or w1/w3/w2 Linear layers", MoEEpConfigError)


def num_experts(experts: torch.nn.Module) -> int:
    """E, however the experts are held."""
    gu = getattr(experts, "gate_up_proj", None)
    if isinstance(gu, torch.Tensor):
        return gu.shape[0]
    if isinstance(experts, torch.nn.ModuleList):
        return len(experts)
    fail(f"experts layout of {type(experts).__name__}", "unknown", "fused parameters or a ModuleList",
         MoEEpConfigError)
