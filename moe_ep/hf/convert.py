"""``convert``: replace every sparse MoE block of a transformers model, in place, by a :class:`MoEEpBlock`."""

from __future__ import annotations

import torch

from ..config import EpConfig
from ..errors import MoEEpConfigError, check
from ..layer import MoEEpLayer
from ..transports.base import group_rank_world
from ..weights import ExpertWeights
from .blocks import SUPPORTED, is_unsupported_moe
from .experts import num_experts, read_experts
from .module import MoEEpBlock

_SUPPORTED_NAMES = ", ".join(SUPPORTED)


def find_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, block)`` of every supported MoE block of ``model`` (outermost first; a block's own
    submodules are not searched). Raises :class:`MoEEpConfigError` naming the first module that looks like an
    MoE block (class name says MoE, holds ``experts``) but is not supported, or when there is none at all."""
    found, inside = [], ()
    for name, m in model.named_modules():
        if inside and any(name.startswith(p + ".") for p in inside):
            continue
        cls = type(m).__name__
        if cls in SUPPORTED:
            check(bool(name), "convert(model=...)", f"a {cls} itself", "a model holding MoE blocks (a block "
                  "is replaced inside its parent: pass the parent)", MoEEpConfigError)
            found.append((name, m))
            inside = (*inside, name)
        elif is_unsupported_moe(m):
            raise MoEEpConfigError(f"MoE block {name or '(the model)'} of class {cls} is not supported; allowed: "
                                   f"{_SUPPORTED_NAMES}")
    if not found:
        raise MoEEpConfigError(f"model of class {type(model).__name__} holds no MoE block; allowed: a model "
                               f"with blocks of class {_SUPPORTED_NAMES}")
    return found


def _config(name: str, block: torch.nn.Module, **options) -> EpConfig:
    """The block's EpConfig; a bad size or option is named with the block it came from."""
    spec = SUPPORTED[type(block).__name__]
    hidden = block.gate.weight.shape[1]
    E = num_experts(block.experts)
    w13, _ = read_experts(block.experts, slice(0, 1), hidden)  # one expert: its intermediate size
    try:
        return EpConfig(num_experts=E, top_k=spec.top_k(block), hidden_size=hidden,
                        intermediate_size=w13.shape[1] // 2, **options)
    except MoEEpConfigError as e:
        raise MoEEpConfigError(f"{name} ({type(block).__name__}): {e}") from None


def convert(model: torch.nn.Module, group=None, transport: str = "auto", weight_format: str = "bf16",
            activation_format: str = "bf16", *, max_tokens: int = 4096, algorithm: str = "ht",
            layout: str = "flat", activation_global_scale: float | None = None,
            validate: bool = True) -> list[str]:
    """Replace every sparse MoE block of ``model`` (``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``,
    ``DeepseekV3MoE``; transformers 4.57 and 5.x layouts) in place by a :class:`MoEEpBlock`; returns the
    converted blocks' qualified names.

    Each block keeps the model's router and shared experts; its routed experts run through moe-ep:
    :func:`moe_ep.fused_moe` when ``group`` (None: the default process group, or this process alone before
    ``init_process_group``) has one rank, else a :class:`moe_ep.MoEEpLayer` over ``group`` (``transport``,
    ``EpConfig(max_tokens_per_rank=max_tokens, algorithm, layout, weight_format, activation_format,
    activation_global_scale)``; HIGH_THROUGHPUT/flat by default, which takes any batch up to ``max_tokens``,
    prefill and decode alike). Rank ``r`` of ``R`` keeps experts ``r*E/R .. (r+1)*E/R - 1`` only (bf16, or
    quantized to NVFP4 with ``weight_format="nvfp4"``); the block's original expert parameters are dropped.
    With several ranks conversion is collective (every rank converts the same model), and so is every
    forward of a converted block: all ranks must run the model's forward in step (``generate`` with the
    same number of steps on every rank: pass ``min_new_tokens`` equal to ``max_new_tokens``).

    Raises :class:`~moe_ep.MoEEpConfigError`, before changing anything, for a module that looks like an MoE
    block (class name says MoE and it holds ``experts``) but is not supported, for a model with no MoE block,
    for experts moe-ep cannot compute (not SiLU-gated, biases, unknown layout) and for sizes the kernels do not
    take (hidden and intermediate sizes multiples of 16, E a multiple of the world size).
    """
    check(isinstance(model, torch.nn.Module), "type(model)", type(model).__name__, "a torch.nn.Module",
          MoEEpConfigError)
    rank, world = group_rank_world(group)
    options = dict(max_tokens_per_rank=max_tokens, algorithm=algorithm, layout=layout, weight_format=weight_format,
                   activation_format=activation_format, activation_global_scale=activation_global_scale)
    blocks = find_blocks(model)
    configs = [_config(name, block, **options) for name, block in blocks]  # every check before any change
    for cfg, (name, block) in zip(configs, blocks):
        try:
            cfg.local_experts(world)
        except MoEEpConfigError as e:
            raise MoEEpConfigError(f"{name} ({type(block).__name__}): {e}") from None
    for cfg, (name, block) in zip(configs, blocks):
        L = cfg.local_experts(world)
        w13, w2 = read_experts(block.experts, slice(rank * L, (rank + 1) * L), cfg.hidden_size)
        weights = ExpertWeights(w13, w2, cfg.weight_format)
        del w13, w2
        experts = weights if world == 1 else MoEEpLayer(cfg, weights, group=group, transport=transport,
                                                         validate=validate)
        spec = SUPPORTED[type(block).__name__]
        new = MoEEpBlock(block.gate, experts, cfg, normalize=spec.normalize(block),
                         shared_experts=spec.shared_experts(block),
                         returns_logits=isinstance(block.gate, torch.nn.Linear), original=type(block).__name__)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        del block.experts  # the full set of experts goes with the old block, even where it is still referenced
    return [name for name, _ in blocks]


__all__ = ["convert", "find_blocks"]
