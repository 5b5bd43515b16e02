"""ExpertWeights: one rank's local expert weights, bf16 or quantized to NVFP4 once at construction."""

from __future__ import annotations

import torch

from .config import Format
from .errors import MoEEpConfigError, MoEEpInputError, check
from .kernels.nvfp4 import NvFp4Tensor, dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4


class ExpertWeights:
    """Local SwiGLU expert weights: ``w13 [L, 2I, H]`` (gate rows then up rows) and ``w2 [L, H, I]``.

    ``weight_format`` BF16 keeps them as bf16 tensors; NVFP4 quantizes each once, here, with one global
    scale per expert (``quantize_nvfp4(w, nvfp4_global_scale(w, per_slice=True))``); the layer then reads
    only the packed codes. ``w13``/``w2`` attributes hold what the grouped GEMM consumes (a bf16 tensor or
    an :class:`NvFp4Tensor`).
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, weight_format: Format | str = Format.BF16):
        try:
            weight_format = Format(weight_format)
        except ValueError:
            raise MoEEpConfigError(f"weight_format = {weight_format!r}; allowed: 'bf16', 'nvfp4'") from None
        for name, w in (("w13", w13), ("w2", w2)):
            check(isinstance(w, torch.Tensor), f"type({name})", type(w).__name__, "a torch.Tensor")
            check(w.dim() == 3, f"{name}.shape", tuple(w.shape), "3-D ([L, 2I, H] / [L, H, I])")
            check(w.is_floating_point(), f"{name}.dtype", w.dtype, "a floating dtype")
        L, two_i, H = w13.shape
        check(two_i % 2 == 0, "w13.shape[1] (2I)", two_i, "even (gate rows then up rows)")
        check(tuple(w2.shape) == (L, H, two_i // 2), "w2.shape", tuple(w2.shape), f"({L}, {H}, {two_i // 2})")
        check(w2.device == w13.device, "w2.device", str(w2.device), str(w13.device))
        self.format = weight_format
        self.num_local_experts, self.hidden_size, self.intermediate_size = L, H, two_i // 2
        if weight_format is Format.NVFP4:
            self.w13 = quantize_nvfp4(w13, nvfp4_global_scale(w13, per_slice=True))
            self.w2 = quantize_nvfp4(w2, nvfp4_global_scale(w2, per_slice=True))
        else:
            self.w13 = w13.to(torch.bfloat16).contiguous()
            self.w2 = w2.to(torch.bfloat16).contiguous()

    @classmethod
    def from_global(cls, w13_all: torch.Tensor, w2_all: torch.Tensor, rank: int, world_size: int,
                    weight_format: Format | str = Format.BF16, device=None) -> "ExpertWeights":
        """Rank ``rank``'s shard (experts ``rank*L .. rank*L+L-1``) of all experts' ``[E, 2I, H]``/``[E, H, I]``."""
        E = w13_all.shape[0]
        if world_size <= 0 or E % world_size:
            raise MoEEpConfigError(f"num_experts = {E}; allowed: a multiple of the world size ({world_size})")
        if not 0 <= rank < world_size:
            raise MoEEpInputError(f"rank = {rank}; allowed: [0, {world_size})")
        L = E // world_size
        sl = slice(rank * L, (rank + 1) * L)
        dev = device if device is not None else w13_all.device
        return cls(w13_all[sl].to(dev), w2_all[sl].to(dev), weight_format)

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights the layer computes with, as fp32 (dequantized when NVFP4): the reference's operands."""
        f = lambda w: dequantize_nvfp4(w, torch.float32) if isinstance(w, NvFp4Tensor) else w.float()  # noqa: E731
        return f(self.w13), f(self.w2)
